"""Object-store requests with a deadline and retries: a store that stops answering fails the save.

Runs wherever the object-store path talks to the network: the background writer
(each part of a bucket's upload, its rank's checksum record) and the coordinator (small
objects: ``.metadata``, listings). The boto3 client's own timeouts bound each socket operation,
not a request: an endpoint that accepts the connection and then answers one byte at a
time never trips them, and its retries multiply them. Here every request runs on a
helper thread and the caller waits at most ``timeout_s`` for it; a request that has not
finished by then is abandoned (its thread ends when the client's socket timeout fires)
and counts as a failed attempt. Transient failures (timeouts, dropped connections,
throttling, 5xx answers) are retried with exponential backoff, at most ``retries``
times; anything else (missing bucket, refused credentials) fails at once. So one request
fails within about ``(retries + 1) * timeout_s`` plus the backoff, always.

:class:`DeadlineFileSystem` gives a local mount's planning calls the same wrapper, bounded
like the other file-system steps of a save (no retries: a local call that hangs is a hung
mount, not a transient failure).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional, TypeVar

from megatron_async.core.helper_threads import DeadlineExpired, run_with_deadline
from megatron_async.core.save_directories import run_coordinator_step
from megatron_async.errors import CheckpointValidationError, ObjectStoreError
from megatron_async.storage.client import STORE_ADVICE

__all__ = ["BoundedFileSystem", "DeadlineFileSystem", "RequestPolicy", "ObjectStoreTimeoutError", "call_with_deadline", "is_transient"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_CODES = frozenset({
    "RequestTimeout", "RequestTimeTooSkewed", "SlowDown", "Throttling", "ThrottlingException",
    "InternalError", "ServiceUnavailable", "503", "500", "502", "504",
})


class ObjectStoreTimeoutError(ObjectStoreError, TimeoutError):
    """An object-store request did not finish within its deadline."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestPolicy:
    """Bounds of one object-store request."""

    timeout_s: float = 120.0
    """The most one attempt may take, answer included (a 16 MiB part at 1 MB/s fits)."""

    retries: int = 3
    """Further attempts after a transient failure (0: one attempt only)."""

    backoff_s: float = 1.0
    """Wait before the first retry; doubled for each further one."""

    max_backoff_s: float = 20.0
    """The longest wait between two attempts."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise CheckpointValidationError(
                f"object request timeout_s must be a positive number of seconds, got {self.timeout_s!r}"
            )
        if not isinstance(self.retries, int) or self.retries < 0:
            raise CheckpointValidationError(f"object request retries must be an int >= 0, got {self.retries!r}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise CheckpointValidationError(
                f"object request backoff must satisfy 0 <= backoff_s <= max_backoff_s, got "
                f"{self.backoff_s!r} and {self.max_backoff_s!r}"
            )

    @property
    def bound_s(self) -> float:
        """The longest a request can take, every attempt and wait included."""
        waits = sum(min(self.backoff_s * 2**n, self.max_backoff_s) for n in range(self.retries))
        return (self.retries + 1) * self.timeout_s + waits


def is_transient(exc: BaseException) -> bool:
    """Whether a failed request may succeed when tried again."""
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    try:
        from botocore import exceptions as boto
    except ImportError:
        return False
    if isinstance(exc, (boto.ConnectionError, boto.HTTPClientError)):  # timeouts, resets, DNS
        return True
    if isinstance(exc, boto.ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return error.get("Code") in _TRANSIENT_CODES or (isinstance(status, int) and status >= 500)
    return False


def _attempt(call: Callable[[], T], timeout_s: float, what: str) -> T:
    try:
        return run_with_deadline(call, timeout_s, f"object-request: {what}")
    except DeadlineExpired as exc:
        raise ObjectStoreTimeoutError(f"no complete answer within {timeout_s:.0f}s") from exc


def call_with_deadline(
    what: str, url: str, call: Callable[[], T], policy: Optional[RequestPolicy] = None
) -> T:
    """Run one object-store request within ``policy``'s bounds.

    Args:
        what: the request, for messages (e.g. ``"uploading part 3 of"``).
        url: the object's URL, for messages.
        call: the request itself.
        policy: timeouts and retries; the defaults without one.

    Returns:
        What ``call`` returned.

    Raises:
        ObjectStoreError: the request failed for good (the last attempt's error is its
            cause); an :class:`ObjectStoreTimeoutError` when the last attempt timed out.
    """
    policy = policy or RequestPolicy()
    attempt = 0
    while True:
        try:
            return _attempt(call, policy.timeout_s, what)
        except Exception as exc:
            transient = is_transient(exc)
            if isinstance(exc, ObjectStoreError) and not transient:
                raise  # already says what failed and what to do
            if not transient or attempt >= policy.retries:
                tried = f" after {attempt + 1} attempts" if attempt else ""
                error_type = ObjectStoreTimeoutError if isinstance(exc, TimeoutError) else ObjectStoreError
                raise error_type(
                    f"{what} {url} failed{tried}: {type(exc).__name__}: {exc}; "
                    + ("the store accepts connections but does not answer in time: check its "
                       "health, or raise object_request_timeout_s for a slow link"
                       if isinstance(exc, TimeoutError) else STORE_ADVICE)
                ) from exc
            wait_s = min(policy.backoff_s * 2**attempt, policy.max_backoff_s)
            logger.warning("%s %s failed (%s: %s); attempt %d of %d in %.1fs",
                           what, url, type(exc).__name__, exc, attempt + 2, policy.retries + 1, wait_s)
            time.sleep(wait_s)
            attempt += 1


class BoundedFileSystem:
    """A DCP file system (multi-storage-client's) whose planning requests run within a
    policy's bounds (trainer, every rank).

    DCP's ``FileSystemWriter.prepare_local_plan`` creates the checkpoint's folder and looks
    for an existing ``.metadata`` through ``fs.mkdir`` and ``fs.exists``, on the training
    thread of every rank, while planning. Unbounded, a store that stops answering would
    hold that rank for good and the others until their coordination timeout. Everything
    else is the wrapped file system's.
    """

    _BOUNDED = {"mkdir": "creating the folder", "exists": "looking for"}

    def __init__(self, fs, policy: Optional[RequestPolicy] = None) -> None:
        self._fs = fs
        self._policy = policy

    def __getattr__(self, name: str):
        fs = self.__dict__.get("_fs")
        if fs is None:  # while unpickling, before the state is back
            raise AttributeError(name)
        attribute = getattr(fs, name)
        what = self._BOUNDED.get(name)
        if what is None:
            return attribute

        def bounded(path, *args, **kwargs):
            return self._bounded_call(what, str(path), lambda: attribute(path, *args, **kwargs))

        return bounded

    def _bounded_call(self, what: str, path: str, call: Callable[[], T]) -> T:
        return call_with_deadline(what, path, call, self._policy)


class DeadlineFileSystem(BoundedFileSystem):
    """DCP's local file system whose planning calls (``mkdir``, ``exists``) run within the
    bound of a save step (trainer, every rank; half the coordination timeout, no retries):
    on a hung mount they raise :class:`~megatron_async.core.save_directories.FileSystemStepTimeoutError`
    instead of holding the rank."""

    def _bounded_call(self, what: str, path: str, call: Callable[[], T]) -> T:
        return run_coordinator_step(f"{what} {path}", call)
