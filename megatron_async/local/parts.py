"""The files of one holder directory of local checkpoints: parts and their records.

Every rank has a holder directory ``root/<session_id>/<rank>/`` on node-local storage.
It holds, per iteration, the rank's own part and the replicas of its peers' parts:

* ``iter_{iteration:07d}_{owner}_local.pt``: the part's bytes, exactly as the owner
  serialized them (nvidia-resiliency-ext's name; iterations past 10**7 take more digits).
  It is written as ``iter_..._local.dirty.pt``, fsynced, then renamed.
* ``iter_{iteration:07d}_{owner}_local.json``: its record (:class:`PartRecord`: size,
  xxh3 digest, the job's :class:`LocalIdentity`), written atomically after the part.

A part counts only with its record, and only when its bytes hash to the record's digest;
:func:`verify_part` checks that before a byte is handed on, and tells the file's
:class:`FileVersion` as it was hashed, so that a later use can tell whether the file
changed since. :func:`scan`, :func:`verify_part` and :func:`map_part` run on every rank
when it looks for a checkpoint to recover; :func:`remove_iterations` on every rank when a
save is finalized or failed. Writing a part runs in the background writer
(:mod:`.part_output`). This module is the only place that knows these names.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Union

from megatron_async.buckets.bucket_file import ALGORITHM, new_hasher
from megatron_async.storage.local import fsync_path

__all__ = [
    "FORMAT", "LocalIdentity", "PartRecord", "FileVersion", "holder_dir", "part_name",
    "record_name", "scan", "file_version", "verify_part", "map_part",
    "remove_iterations", "remove_file",
]

logger = logging.getLogger(__name__)

FORMAT = "megatron_async.local.part/1"
"""The ``format`` of a part record; a record of another format is ignored."""

PathLike = Union[str, "os.PathLike[str]"]

_READ_BYTES = 8 << 20
_NAME = re.compile(r"\.?iter_(\d+)_(\d+)_local(\.pt|\.dirty\.pt|\.json|\.json\.tmp-.*)")
"""Every file this module writes (the last form: a record's unfinished atomic write)."""


@dataclasses.dataclass(frozen=True)
class LocalIdentity:
    """The job a local checkpoint belongs to; a part of another job is never recovered.

    Attributes:
        world_size: the number of ranks (and of parts per iteration).
        replication_jump: ranks per node of the replication cliques; None without
            replication.
        replication_factor: copies of each part (1 without replication).
        run_id: the job's name (the ``run_id=`` argument or ``MEGATRON_ASYNC_RUN_ID``).
        algo: ``"fully_parallel"`` or ``"atomic"`` when known, else None (not compared).
    """

    world_size: int
    replication_jump: Optional[int] = None
    replication_factor: int = 1
    run_id: str = ""
    algo: Optional[str] = None

    def differences(self, other: "LocalIdentity") -> List[str]:
        """What differs from ``other``, as ``"field: mine != theirs"``; empty if they match.
        ``algo`` is compared only when both know it."""
        found = []
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if field.name == "algo" and None in (mine, theirs):
                continue
            if mine != theirs:
                found.append(f"{field.name}: {mine!r} != {theirs!r}")
        return found


@dataclasses.dataclass(frozen=True)
class PartRecord:
    """What a holder knows about one part it keeps (its record file's content)."""

    iteration: int
    owner: int
    num_bytes: int
    digest: str
    identity: LocalIdentity
    algorithm: str = ALGORITHM
    format: str = FORMAT

    @property
    def key(self) -> tuple:
        """``(iteration, owner)``: the part, whoever holds it."""
        return (self.iteration, self.owner)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: Union[str, bytes]) -> "PartRecord":
        fields: Dict[str, Any] = json.loads(text)
        fields["identity"] = LocalIdentity(**fields["identity"])
        return cls(**fields)


def holder_dir(root: PathLike, session_id: str, rank: int) -> str:
    """The holder directory of ``rank``: ``root/<session_id>/<rank>`` (``root/<rank>``
    for the default session ``''``)."""
    return os.path.join(os.fspath(root), session_id, str(rank))


def part_name(iteration: int, owner: int, dirty: bool = False) -> str:
    """The file name of the part of ``owner`` at ``iteration`` (being written if dirty)."""
    return f"iter_{iteration:07d}_{owner}_local{'.dirty' if dirty else ''}.pt"


def record_name(iteration: int, owner: int) -> str:
    """The file name of the record of that part."""
    return f"iter_{iteration:07d}_{owner}_local.json"


def scan(directory: PathLike) -> List[PartRecord]:
    """The records of the parts a holder directory keeps, by iteration and owner (any rank).

    Cheap: it reads the small record files and checks each part's size, without hashing.
    A record that cannot be read, of another format, whose name disagrees with its
    content, or whose part is missing or of another size is left out with a log line;
    parts without a record (an interrupted write, or nvidia-resiliency-ext's files,
    which have no checksum) are left out too. A missing directory holds nothing.
    """
    directory = os.fspath(directory)
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as exc:  # the others still agree, and recover from replicas
        logger.warning("%s: cannot list local checkpoint parts, none used: %s", directory, exc)
        return []
    records, unrecorded = [], []
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or name.startswith("."):
            continue
        iteration, owner, suffix = int(match[1]), int(match[2]), match[3]
        if suffix == ".pt" and record_name(iteration, owner) not in names:
            unrecorded.append(name)
        if suffix == ".json":
            record = _read_record(directory, name, iteration, owner)
            if record is not None:
                records.append(record)
    if unrecorded:
        logger.warning(
            "%s: %d local checkpoint part(s) without a record are ignored (an interrupted "
            "write, or files without checksums): %s",
            directory, len(unrecorded), ", ".join(unrecorded[:4]),
        )
    return sorted(records, key=lambda r: r.key)


def _read_record(directory: str, name: str, iteration: int, owner: int) -> Optional[PartRecord]:
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as stream:
            record = PartRecord.from_json(stream.read())
    except (OSError, ValueError, TypeError, KeyError) as exc:
        logger.warning("%s: unreadable local checkpoint record, ignored: %s", path, exc)
        return None
    problem = None
    if record.format != FORMAT or record.algorithm != ALGORITHM:
        problem = (
            f"format {record.format!r} / {record.algorithm!r}, not {FORMAT!r} / {ALGORITHM!r}"
        )
    elif record.key != (iteration, owner):
        problem = f"it describes iteration {record.iteration}, owner {record.owner}"
    else:
        try:
            size = os.stat(os.path.join(directory, part_name(iteration, owner))).st_size
        except OSError:
            size = None
        if size != record.num_bytes:
            found = "missing" if size is None else f"{size} bytes"
            problem = f"its part is {found}, the record says {record.num_bytes} bytes"
    if problem is not None:
        logger.warning("%s: local checkpoint record ignored: %s", path, problem)
        return None
    return record


class FileVersion(NamedTuple):
    """A file's identity and change stamps: a write, a truncation or a file put in its
    place changes at least one of them (the times within the file system's clock tick:
    a second write in the same tick as the one before is not told apart; nothing writes
    a part while it is recovered)."""

    device: int
    inode: int
    num_bytes: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, stat: os.stat_result) -> "FileVersion":
        return cls(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def file_version(path: PathLike) -> Optional[FileVersion]:
    """The :class:`FileVersion` of the file at ``path`` now; None when it cannot be
    found (any rank)."""
    try:
        return FileVersion.of(os.stat(path))
    except OSError:
        return None


def verify_part(directory: PathLike, record: PartRecord) -> Optional[FileVersion]:
    """Whether the part ``record`` describes hashes to its digest (any rank): the
    version of its file as it was when hashed, or None (with a log line saying why) when
    the part is missing, unreadable, of another size or damaged.

    Streams the part with ``read`` through one 8 MiB buffer: nothing of it is kept, and
    an unreadable sector is an error here, not a ``SIGBUS`` as in a mapping. The pages
    read stay in the page cache, where :func:`map_part` and ``torch.load(mmap=True)``
    find them.
    """
    path = os.path.join(os.fspath(directory), part_name(record.iteration, record.owner))
    view = memoryview(bytearray(min(record.num_bytes, _READ_BYTES)))
    hasher, filled = new_hasher(), 0
    try:
        with open(path, "rb", buffering=0) as stream:
            version = FileVersion.of(os.fstat(stream.fileno()))  # before the bytes hashed
            while filled < record.num_bytes:
                count = stream.readinto(view[: min(_READ_BYTES, record.num_bytes - filled)])
                if not count:
                    break
                hasher.update(view[:count])
                filled += count
            extra = stream.read(1)
    except OSError as exc:
        logger.warning("%s: cannot read local checkpoint part: %s", path, exc)
        return None
    if filled != record.num_bytes or extra:
        logger.warning(
            "%s: local checkpoint part is not of its record's size (%d bytes): not used",
            path, record.num_bytes,
        )
        return None
    digest = hasher.hexdigest()
    if digest != record.digest:
        logger.warning(
            "%s: local checkpoint part hashes to %s, its record says %s (damaged): not used",
            path, digest, record.digest,
        )
        return None
    return version


def map_part(directory: PathLike, record: PartRecord) -> mmap.mmap:
    """A private (copy-on-write) mapping of the part ``record`` describes, of exactly its
    size, to send it to a peer without copying it into this process (every rank holding a
    replica that a peer lacks, at recovery). The bytes are not hashed again here: the
    receiver checks them against the digest.

    Raises:
        OSError: the file is missing, unreadable or of another size than its record.
    """
    path = os.path.join(os.fspath(directory), part_name(record.iteration, record.owner))
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        if size != record.num_bytes:
            raise OSError(f"{path}: {size} bytes, its record says {record.num_bytes}")
        return mmap.mmap(stream.fileno(), size, access=mmap.ACCESS_COPY)


def remove_iterations(directory: PathLike, predicate: Callable[[int], bool]) -> List[str]:
    """Remove every file of the iterations for which ``predicate`` is true (the holder).

    Records go before their parts, so an interruption leaves parts without records, which
    nothing uses; dirty parts and unfinished record writes go too. The directory is
    fsynced once after (best effort).

    Returns:
        The names removed.
    """
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:  # best effort, like each removal: a failing disk is told, not raised
        logger.warning("cannot list %s to remove old local checkpoint files: %s", directory, exc)
        return []
    doomed = [n for n in names if (m := _NAME.fullmatch(n)) and predicate(int(m[1]))]
    doomed.sort(key=lambda n: (not n.endswith(".json"), n))  # records first
    removed = [n for n in doomed if remove_file(os.path.join(directory, n))]
    if removed:
        fsync_path(directory, best_effort=True)
    return removed


def remove_file(path: str) -> bool:
    """Remove a file if it exists (best effort: a failure is logged, not raised)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.warning("cannot remove %s: %s", path, exc)
        return False
    return True
