"""``nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async``: the storage writer.

``_results_queue`` is, as there, the process's write-results queue once
:func:`get_write_results_queue` created it, else None.
"""

from typing import Any

from megatron_async.writer import results as _results
from megatron_async.writer.filesystem import FileSystemWriterAsync, get_write_results_queue

__all__ = ["FileSystemWriterAsync", "get_write_results_queue"]


def __getattr__(name: str) -> Any:
    if name == "_results_queue":
        return _results._results_queue
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
