"""Write one part of a holder directory, and then its record, durably (writer, recovery).

The write side of :mod:`.parts`, which names the files and reads them back. A part goes
through the library's local bucket file
(:class:`~megatron_async.buckets.direct_io.LocalBucketFile`): its bytes are gathered in
an aligned 8 MiB bounce chunk, hashed there (xxh3, while the block is in cache) and
written a chunk at a time with ``O_DIRECT`` where the file system accepts it. The whole
part is one item of that file, so the item's digest is the part's. Then, in order:

1. the dirty file ``iter_..._local.dirty.pt`` is fsynced (its size included); a part
   being replicated hands every chunk to its replication before the chunk goes to the
   disk, and its size and digest before this fsync;
2. a record an earlier save left for the same part is removed, so that no record ever
   describes other bytes, and the dirty file is renamed to the part's name;
3. the record (size, digest, the job's identity) is written atomically, which fsyncs the
   directory, and so the rename too.

A part whose write fails, at any of these steps, leaves no record and no file behind.
Runs in the background writer: this rank's part from its staged ``torch.save`` records
(:mod:`.part_writer`), the replicas it receives from its peers (:mod:`.replica_receiver`).

A part recovered from a peer (:mod:`.recover`, every rank that lacks its own) arrives in
place instead: :class:`IncomingPart` maps its dirty file, the transfer fills the mapping,
and its pages, hashed there, stay in the page cache, where ``load`` maps them again
(``torch.load(mmap=True)``); then steps 1 to 3 as above.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
from typing import Any, Iterator, Optional

from megatron_async.buckets.bucket_file import new_hasher
from megatron_async.buckets.direct_io import LocalBucketFile
from megatron_async.errors import CheckpointIntegrityError, StorageWriteError
from megatron_async.local.parts import (
    FileVersion,
    LocalIdentity,
    PartRecord,
    PathLike,
    part_name,
    record_name,
    remove_file,
)
from megatron_async.storage.local import atomic_output
from megatron_async.writer.bucket_io import BounceChunks

__all__ = ["PartFile", "open_part", "IncomingPart"]


class PartFile(LocalBucketFile):
    """The dirty file of one part being written: a stream (``write``, ``tell``) whose
    bytes are hashed on their way (background writer). ``record`` is set once the part
    is in place, after the ``with`` block of :func:`open_part`; ``write_error`` is the
    first ``OSError`` of a write, which torch's zip writer would report only as
    "unexpected pos"; ``expected_digest`` (a replica's: its owner's digest) may be set
    until the block ends. With ``replication``
    (a :class:`~megatron_async.local.part_replication.PartReplication`), every chunk is
    sent with its ``send`` before it is written, and the part's size and digest with its
    ``end`` before the fsync."""

    def __init__(self, path: str, replication: Any = None):
        super().__init__(path, hashing=True, chunks=BounceChunks.of_process())
        self.record: Optional[PartRecord] = None
        self.expected_digest: Optional[str] = None
        self._replication = replication
        self._end = sys.maxsize  # the part's size, known at finish (the last chunk is padded)
        self.start_item()  # the whole part is one item: its digest is the part's

    def finish(self, use_fsync: bool) -> None:
        self._end = self.tell()
        super().finish(use_fsync=False)
        if self._replication is not None:
            self._replication.end(self._end, self.finish_item())
        if use_fsync:
            self.fsync()

    def _write_chunk(self, length: int) -> None:
        if self._replication is not None:
            self._replication.send(self._view[: min(length, self._end - self._written)])
        super()._write_chunk(length)


@contextlib.contextmanager
def open_part(
    directory: PathLike, iteration: int, owner: int, identity: LocalIdentity, *,
    replication: Any = None,
) -> Iterator[PartFile]:
    """Write a part through a stream, then its record, durably (background writer).

    What is written to the yielded :class:`PartFile` goes to the dirty file; when the
    block ends the part is made durable, put in place and recorded (see the module). If
    the block raises, what was written of the part is removed and the error goes on (the
    stream's first write error in its place: a full disk, not the zip writer's
    "unexpected pos").

    Args:
        directory: the holder directory (created if missing).
        identity: the job's identity, recorded with the part.
        replication: this rank's part is replicated as it is written (see
            :class:`PartFile`).

    Raises:
        CheckpointIntegrityError: the bytes do not match the ``expected_digest`` the block
            set on the stream (a replica: the digest its owner computed).
        StorageWriteError: the directory or a file cannot be written (the message names
            the path).
    """
    directory = os.fspath(directory)
    dirty = os.path.join(directory, part_name(iteration, owner, dirty=True))
    written: Optional[str] = None  # the file to remove if the write fails
    stream: Optional[PartFile] = None
    try:
        os.makedirs(directory, exist_ok=True)
        stream = PartFile(dirty, replication)
        written = dirty
        try:
            yield stream
            if stream.write_error is not None:  # swallowed by the block's zip writer
                raise stream.write_error
            stream.finish(use_fsync=True)
        finally:
            stream.close()
        digest, expected_digest = stream.finish_item(), stream.expected_digest
        if expected_digest is not None and digest != expected_digest:
            raise CheckpointIntegrityError(
                f"replica of rank {owner}'s part of iteration {iteration} in {directory} hashes "
                f"to {digest}, the owner sent {expected_digest}: it was damaged on its way"
            )
        record = PartRecord(iteration, owner, stream.tell(), digest, identity)
        written = os.path.join(directory, part_name(iteration, owner))
        _put_in_place(directory, record)
        stream.record = record
    except BaseException as exc:
        if written is not None:
            remove_file(written)
        cause = exc if stream is None or stream.write_error is None else stream.write_error
        if isinstance(cause, OSError):
            raise StorageWriteError(
                f"cannot write rank {owner}'s local checkpoint part of iteration {iteration} "
                f"to {written or directory}: {cause}"
            ) from cause
        raise


def _put_in_place(directory: str, record: PartRecord) -> None:
    """Steps 2 and 3 of the module for a durable dirty file: it becomes the part, then
    its record is written. If a step fails, neither file stays (nor an older record)."""
    dirty = os.path.join(directory, part_name(record.iteration, record.owner, dirty=True))
    clean = os.path.join(directory, part_name(record.iteration, record.owner))
    record_path = os.path.join(directory, record_name(record.iteration, record.owner))
    try:
        remove_file(record_path)
        os.replace(dirty, clean)
        with atomic_output(record_path) as out:
            out.write(record.to_json().encode())
    except BaseException:
        remove_file(dirty)
        remove_file(clean)
        raise


class IncomingPart:
    """The dirty file of this rank's part, sized and mapped writable, for the part's
    bytes to arrive in place from the peer holding its replica (every rank that lacks
    its part at recovery). Its blocks are allocated at once (``posix_fallocate``), so
    that the pages written through the mapping never meet a full disk (``SIGBUS`` there,
    not an error). Then :meth:`digest`, and :meth:`commit` or :meth:`discard`.

    Args:
        directory: this rank's holder directory (created if missing).
        record: the part's record, from the holder of the replica.

    Raises:
        OSError: the file cannot be created, allocated or mapped (it is removed).
    """

    def __init__(self, directory: PathLike, record: PartRecord):
        self.record = record
        self.directory = os.fspath(directory)
        """The holder directory the part goes to."""
        self._dirty = os.path.join(
            self.directory, part_name(record.iteration, record.owner, dirty=True)
        )
        self._fd: Optional[int] = None
        self._mapping: Optional[mmap.mmap] = None
        try:
            os.makedirs(self.directory, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
            self._fd = os.open(self._dirty, flags, 0o666)
            os.posix_fallocate(self._fd, 0, record.num_bytes)
            self._mapping = mmap.mmap(self._fd, record.num_bytes, access=mmap.ACCESS_WRITE)
        except BaseException:
            self.discard()
            raise

    @property
    def buffer(self) -> mmap.mmap:
        """The part's pages, shared with its file: what arrives here is in the file."""
        assert self._mapping is not None, "discarded"
        return self._mapping

    def digest(self) -> str:
        """The digest of the part's bytes as they are in its pages now."""
        hasher = new_hasher()
        hasher.update(self.buffer)
        return hasher.hexdigest()

    def commit(self) -> FileVersion:
        """Make the part durable and put it in place with its record (steps 1 to 3).

        Returns:
            The version of the part's file in place.

        Raises:
            StorageWriteError: a step failed; neither the part nor a record stays.
        """
        assert self._fd is not None, "discarded"
        try:
            os.fsync(self._fd)  # the pages written through the mapping, and the size
            _put_in_place(self.directory, self.record)
            version = FileVersion.of(os.fstat(self._fd))  # after the rename: its ctime
        except OSError as exc:
            self.discard()
            raise StorageWriteError(
                f"cannot write rank {self.record.owner}'s local checkpoint part of iteration "
                f"{self.record.iteration} back to {self.directory}: {exc}"
            ) from exc
        self._release()
        return version

    def discard(self) -> None:
        """Remove the dirty file (best effort); the pages go once nothing maps them."""
        remove_file(self._dirty)
        self._release()

    def _release(self) -> None:
        if self._mapping is not None:
            with contextlib.suppress(BufferError):  # a tensor still wraps it: unmapped with it
                self._mapping.close()
            self._mapping = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
