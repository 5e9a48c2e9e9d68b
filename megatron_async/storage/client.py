"""The multi-storage-client URL scheme, its import and URL resolution (any process).

Imports multi-storage-client only on first use: anything may import it.
MSC is an optional dependency: everything that needs it calls :func:`import_msc`,
which raises :class:`~megatron_async.errors.ObjectStoreUnavailableError` naming the
extra to install. Storage clients come from MSC's own per-profile cache, which MSC
rebuilds after a fork, so a forked writer never shares the trainer's connections.
"""

from __future__ import annotations

import os
from typing import Any, Tuple, Union

from megatron_async.errors import CheckpointValidationError, ObjectStoreUnavailableError

__all__ = [
    "MSC_EXTRA_HINT",
    "MSC_URL_PREFIX",
    "import_msc",
    "is_object_url",
    "msc_available",
    "msc_filesystem",
    "normalize_checkpoint_path",
    "resolve",
]

PathLike = Union[str, "os.PathLike[str]"]

MSC_URL_PREFIX = "msc://"
"""multi-storage-client's URL scheme: ``msc://PROFILE/PREFIX``."""

MSC_EXTRA_HINT = "pip install megatron-async[msc]"
"""What to run when object storage is asked for without multi-storage-client."""


def is_object_url(path: PathLike) -> bool:
    """Whether ``path`` is an ``msc://`` URL (a ``pathlib.Path`` of one reads ``msc:/...``)."""
    text = os.fspath(path)
    return isinstance(text, str) and text.startswith("msc:/")


def normalize_checkpoint_path(path: PathLike) -> str:
    """Return the one spelling of a checkpoint path that every rank and process uses.

    A local path becomes absolute; an ``msc://`` URL keeps its profile and prefix, without
    a trailing slash (``Path("msc://p/x")`` prints ``msc:/p/x``: both name one place).
    """
    text = os.fspath(path)
    if not is_object_url(text):
        return os.path.abspath(text)
    rest = text[len("msc:/"):].lstrip("/")
    return MSC_URL_PREFIX + rest.rstrip("/")


def import_msc() -> Any:
    """Return the ``multistorageclient`` module.

    Raises:
        ObjectStoreUnavailableError: it is not installed; the message names the extra.
    """
    try:
        import multistorageclient
    except ImportError as exc:
        raise ObjectStoreUnavailableError(
            "object storage (use_msc=True or an msc:// path) needs NVIDIA's "
            f"multi-storage-client: {MSC_EXTRA_HINT} ({exc})"
        ) from exc
    return multistorageclient


def msc_available() -> bool:
    """Whether multi-storage-client can be imported."""
    try:
        import_msc()
    except ObjectStoreUnavailableError:
        return False
    return True


def resolve(url: str) -> Tuple[Any, str]:
    """Return ``(storage_client, path_in_profile)`` of an ``msc://`` URL.

    Raises:
        ObjectStoreUnavailableError: multi-storage-client is not installed.
        ValueError: ``url`` is not an ``msc://`` URL.
    """
    normalized = normalize_checkpoint_path(url)
    if not normalized.startswith(MSC_URL_PREFIX):
        raise ValueError(f"{url!r} is not an msc:// URL")
    msc = import_msc()
    return msc.resolve_storage_client(normalized)


def msc_filesystem(checkpoint_url: str) -> Tuple[Any, Any]:
    """DCP's multi-storage-client filesystem and the resolved path of ``checkpoint_url``
    (trainer, every rank): DCP's own planning steps (mkdir, the existing-checkpoint check)
    go through it.

    Raises:
        CheckpointValidationError: MSC cannot resolve the URL (an unknown profile, a
            malformed URL).
    """
    from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystem

    fs = MultiStorageFileSystem()
    try:
        return fs, fs.init_path(checkpoint_url)
    except ValueError as exc:
        raise CheckpointValidationError(
            f"{checkpoint_url}: multi-storage-client cannot resolve it ({exc}); "
            "define the profile in MSC's configuration (MSC_CONFIG or ~/.msc_config.yaml)"
        ) from exc
