"""Object-store requests with a deadline: a store that stops answering fails the save.

Runs wherever the object-store path talks to the network: the background writer
(each part of a bucket's upload, its rank's checksum record) and the coordinator (small
objects: ``.metadata``, listings). The boto3 client's own timeouts bound each socket
operation, not a request: an endpoint that accepts the connection and then answers one
byte at a time never trips them. Here every request runs on a helper thread and the
caller waits at most ``timeout_s`` for it; a request that has not finished by then is
abandoned (its thread ends when the client's socket timeout fires) and fails.

Retrying transient failures (dropped connections, throttling, 5xx answers) is the
client's job, configured in the multi-storage-client profile (the S3 provider's botocore
``retries``, ``mode: standard`` by default, and the profile's ``retry``): the deadline
covers those attempts too, so one request fails within ``timeout_s``, always.

:class:`BoundedFileSystem` gives DCP's planning calls the same bound; on a local mount
(no ``timeout_s``) the bound of the other file-system steps of a save instead (a local
call that hangs is a hung mount, not a slow store).
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

from megatron_async.core.helper_threads import DeadlineExpired, HelperThreads
from megatron_async.core.save_directories import SaveDirectories
from megatron_async.errors import ObjectStoreError

__all__ = ["BoundedFileSystem", "ObjectStoreTimeoutError", "REQUEST_TIMEOUT_S", "call_with_deadline"]

T = TypeVar("T")

STORE_ADVICE = (
    "check the MSC profile (MSC_CONFIG): its endpoint must be reachable, its credentials "
    "accepted and its bucket must exist"
)
"""What an :class:`~megatron_async.errors.ObjectStoreError` message tells the user to check."""

REQUEST_TIMEOUT_S = 120.0
"""The most one request may take, answer and the client's retries included (a 16 MiB
part at 1 MB/s fits)."""


class ObjectStoreTimeoutError(ObjectStoreError, TimeoutError):
    """An object-store request did not finish within its deadline."""


def call_with_deadline(what: str, url: str, call: Callable[[], T], timeout_s: float = REQUEST_TIMEOUT_S) -> T:
    """Run one object-store request, waiting at most ``timeout_s`` for it.

    Args:
        what: the request, for messages (e.g. ``"uploading part 3 of"``).
        url: the object's URL, for messages.

    Raises:
        FileNotFoundError: the object does not exist (the caller's answer, not a failure).
        ObjectStoreError: the request failed (its error is the cause); an
            :class:`ObjectStoreTimeoutError` when it did not finish in time.
    """
    try:
        return HelperThreads.of_process().run(call, timeout_s, f"object-request: {what}")
    except FileNotFoundError:
        raise
    except DeadlineExpired as exc:
        raise ObjectStoreTimeoutError(
            f"{what} {url} failed: no complete answer within {timeout_s:.0f}s; the store accepts "
            "connections but does not answer in time: check its health, or raise "
            "object_request_timeout_s for a slow link"
        ) from exc
    except Exception as exc:
        raise ObjectStoreError(f"{what} {url} failed: {type(exc).__name__}: {exc}; {STORE_ADVICE}") from exc


class BoundedFileSystem:
    """A DCP file system whose planning calls (``mkdir``, ``exists``) run within a bound
    (trainer, every rank).

    DCP's ``FileSystemWriter.prepare_local_plan`` creates the checkpoint's folder and looks
    for an existing ``.metadata`` through ``fs.mkdir`` and ``fs.exists``, on the training
    thread of every rank, while planning. Unbounded, a store that stops answering or a
    hung mount would hold that rank for good and the others until their coordination
    timeout. Everything else is the wrapped file system's.

    Args:
        fs: multi-storage-client's file system, or DCP's local one.
        timeout_s: the deadline of one object-store request; None for a local file
            system, whose calls raise
            :class:`~megatron_async.core.save_directories.FileSystemStepTimeoutError`
            after the bound of a save step (half the coordination timeout).
    """

    _BOUNDED = {"mkdir": "creating the folder", "exists": "looking for"}

    def __init__(self, fs, timeout_s: Optional[float] = None) -> None:
        self._fs = fs
        self._timeout_s = timeout_s

    def __getattr__(self, name: str):
        fs = self.__dict__.get("_fs")
        if fs is None:  # while unpickling, before the state is back
            raise AttributeError(name)
        attribute = getattr(fs, name)
        what = self._BOUNDED.get(name)
        if what is None:
            return attribute

        def bounded(path, *args, **kwargs):
            def call():
                return attribute(path, *args, **kwargs)

            if self._timeout_s is None:
                return SaveDirectories.of_process().run_bounded(f"{what} {path}", call)
            return call_with_deadline(what, str(path), call, self._timeout_s)

        return bounded
