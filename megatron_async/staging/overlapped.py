"""Overlapped staging: a save's host copy runs while the next forward/backward runs.

Opt-in (``TorchDistSaveConfig(overlap_staging=True)``). Without it, scheduling a save
returns once every saved tensor is copied to host memory. With it, scheduling only
borrows the host buffers and records each saved tensor's version counter; once the
request is with its writer, the copy thread of the trainer copies the tensors
(:mod:`.copy_job`) while training goes on, and the writer waits for each item's copy
(the save's :class:`~.gate.StagingGate`). Above the staging budget the same happens in
rounds (:mod:`.rounds`).

Nothing may change a saved tensor before it is copied:

* :func:`wait_for_staging` blocks until every copy of this process is done. A global
  ``torch.optim`` step pre-hook, installed with the first overlapped save, calls it:
  the step of every torch optimizer waits, which includes the optimizers inside
  megatron-core's plain and distributed optimizers, so a megatron-core training loop
  needs nothing more. A loop that changes saved tensors in another way calls
  :func:`wait_for_staging` first;
* megatron-core's ``overlap_param_gather`` writes model parameters during the next
  forward, before any optimizer step: :func:`refuse_overlap_param_gather` refuses that
  combination (call it once with the model chunks or the optimizer);
* a saved tensor whose version counter moved before its copy finished fails that save,
  on every rank, with :class:`~megatron_async.errors.StagingRaceError` naming the tensor
  and the fix, instead of writing a torn checkpoint. (Writes that bypass autograd's
  version counter, e.g. through ``tensor.data``, cannot be detected.)

Runs in the trainer; the gate's waiting side runs in the background writer
(:meth:`~.gate.StagingGate.writer_view`).
"""

from __future__ import annotations

from typing import Any, Iterable

from megatron_async.errors import CheckpointValidationError
from megatron_async.staging.copy_job import CopyThread
from megatron_async.core.config import STAGING_WAIT_S

__all__ = [
    "wait_for_staging",
    "refuse_overlap_param_gather",
]


def wait_for_staging(timeout_s: float = STAGING_WAIT_S) -> None:
    """Block until every overlapped staging copy of this process is done (trainer).

    The optimizer step calls it automatically (see the module docstring); a custom loop
    calls it before changing saved tensors in any other way. Returns at once when no
    copy is running. A detected race is not raised here: it fails the save itself, on
    every rank, at finalization.

    Raises:
        AsyncTimeoutError: a copy made no progress for ``timeout_s`` (a copy in one go:
            did not finish within it).
    """
    CopyThread.of_process().wait_for_copies(timeout_s)


def refuse_overlap_param_gather(objects: Iterable[Any]) -> None:
    """Raise if any of ``objects`` (model chunks, optimizers) gathers parameters during
    the next forward (megatron-core's ``overlap_param_gather``) (trainer, every rank).

    Those writes happen before the next optimizer step, so the automatic wait cannot
    protect the copy from them.

    Raises:
        CheckpointValidationError: ``overlap_param_gather`` is on.
    """
    for obj in objects:
        for holder in (obj, getattr(obj, "ddp_config", None), getattr(obj, "config", None)):
            if holder is not None and getattr(holder, "overlap_param_gather", False) is True:
                raise CheckpointValidationError(
                    f"overlapped checkpoint staging cannot be combined with overlap_param_gather "
                    f"({type(obj).__name__}): the parameter all-gather of the next forward would "
                    "change saved parameters before they are copied. Turn off overlap_staging "
                    "(--ckpt-overlap-staging) or overlap_param_gather"
                )
