"""The background part of one local save: write this rank's part, then replicate it.

:class:`LocalSaveJob` is built in the training process by
:meth:`~megatron_async.local.manager.LocalCheckpointManager.save` and travels in the
save's request (it pickles, so it reaches the persistent worker too);
:func:`write_local_part` is the request's ``async_fn`` and runs in the **background
writer** (a forked child, the persistent worker, or the calling thread of a synchronous
save), never on the training thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import List, Optional

from megatron_async.local.exchange import PeerExchange
from megatron_async.local.part_output import open_part
from megatron_async.local.part_replication import PartReplication
from megatron_async.local.parts import LocalIdentity, PartRecord, remove_iterations
from megatron_async.staging.torch_save import TorchSaveStaged
from megatron_async.writer.torch_save_file import write_torch_save_records

__all__ = ["LocalSaveJob", "write_local_part"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalSaveJob:
    """What the writer needs to keep one rank's part of one local save (pickles)."""

    directory: str
    """This rank's holder directory."""
    iteration: int
    """The training iteration the part belongs to."""
    rank: int
    """The owner of the part: this rank's global rank."""
    identity: LocalIdentity
    """The job's identity, recorded with the part and checked by every receiving peer."""
    exchange: Optional[PeerExchange]
    """Where the part is replicated to; None without replication."""
    staging_wait_s: float
    """Bound on each wait for the trainer's next staging round (state above the budget)."""
    remove_below: int = -1
    """The newest iteration kept when the save started (finalized or recovered): the
    writer first removes every older iteration from the holder directory."""


def write_local_part(job: LocalSaveJob, staged: TorchSaveStaged) -> List[PartRecord]:
    """Write this rank's part and replicate it to its clique peers as it is written,
    keeping theirs (background writer).

    First the iterations older than ``job.remove_below`` leave the holder directory.

    The staged ``torch.save`` records stream into the part's dirty file through the
    local bucket file (:func:`~megatron_async.local.part_output.open_part`: one aligned
    8 MiB chunk, hashed there, written with ``O_DIRECT`` where accepted), so the part is
    never built in memory: the writer holds the staging memory (within the budget; given
    back once the last record is written, before the fsync), the chunk and the zip
    writer's small buffers. With peers, each chunk is sent to them from the chunk before
    it goes to the disk, and each peer's part is received straight into an 8 MiB chunk
    per peer and written as a replica
    (:class:`~megatron_async.local.part_replication.PartReplication`): the part is never
    read back, and the copies are written at the same time.

    Args:
        job: the part and where it goes.
        staged: the staged records (``async_fn_args[1]``, put there by ``preload_fn``).

    Returns:
        The records of this rank's part and of the replicas it keeps.

    Raises:
        StagingRaceError: a saved tensor changed before its staging copy.
        AsyncTimeoutError: the trainer staged no next round within ``staging_wait_s``.
        StorageWriteError: the part cannot be written.
        LocalReplicationError: a peer did not acknowledge this rank's part, or did not
            send its own, within the exchange's bounds (a peer whose own part failed says
            so at once: its peers do not wait for the bound).
    """
    replicated = job.exchange is not None and bool(job.exchange.peers)
    try:
        remove_iterations(job.directory, lambda i: i < job.remove_below)
        with contextlib.ExitStack() as stack:
            replication = None
            if replicated:
                replication = stack.enter_context(
                    PartReplication(job.exchange, job.rank, job.iteration, job.identity)
                )
            try:
                with open_part(
                    job.directory, job.iteration, job.rank, job.identity,
                    replication=replication,
                ) as stream:
                    write_torch_save_records(stream, staged, job.staging_wait_s)
                    staged.gate.mark_done()  # the staging memory goes back before the fsync
            except Exception as exc:
                if replication is not None:  # its peers stop waiting for it
                    replication.fail(f"{type(exc).__name__}: {exc}")
                raise
            replicas = replication.finish() if replication is not None else []
    finally:
        staged.gate.mark_done()
    return [stream.record, *replicas]
