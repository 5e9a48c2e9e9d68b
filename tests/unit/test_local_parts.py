"""megatron_async.local.parts: a holder directory's part files and records."""

import json
import logging
import os
import socket
import threading
import time

import pytest

from megatron_async.buckets.bucket_file import CHUNK_BYTES, new_hasher
from megatron_async.buckets.direct_io import DIRECT_IO_ALIGNMENT
from megatron_async.errors import CheckpointIntegrityError, StorageWriteError
from megatron_async.local import part_output, parts, transport
from megatron_async.local.parts import (
    FORMAT,
    LocalIdentity,
    PartRecord,
    holder_dir,
    part_name,
    record_name,
    remove_iterations,
    scan,
)
from tests.local_parts_aids import read_verified, write_part

IDENTITY = LocalIdentity(world_size=4, replication_jump=2, replication_factor=2, run_id="r")
PAYLOAD = [b"header", bytearray(b"x" * 1000), memoryview(b"tail")]
DATA = b"".join(bytes(p) for p in PAYLOAD)


def _digest(data):
    hasher = new_hasher()
    hasher.update(data)
    return hasher.hexdigest()


def test_names_follow_nvidia_resiliency_ext_and_grow_past_seven_digits(tmp_path):
    assert holder_dir(tmp_path, "", 3) == os.path.join(str(tmp_path), "3")
    assert holder_dir(tmp_path, "s", 3) == os.path.join(str(tmp_path), "s", "3")
    assert part_name(42, 3) == "iter_0000042_3_local.pt"
    assert part_name(42, 3, dirty=True) == "iter_0000042_3_local.dirty.pt"
    assert record_name(42, 3) == "iter_0000042_3_local.json"
    assert part_name(123456789, 0) == "iter_123456789_0_local.pt"


def test_a_written_part_has_its_record_and_reads_back_verified(tmp_path):
    directory = tmp_path / "0"  # created by the write
    record = write_part(directory, 10, 2, PAYLOAD, IDENTITY)
    assert sorted(os.listdir(directory)) == [record_name(10, 2), part_name(10, 2)]
    assert (record.num_bytes, record.digest, record.key) == (len(DATA), _digest(DATA), (10, 2))
    stored = json.loads((directory / record_name(10, 2)).read_text())
    assert stored["format"] == FORMAT and stored["identity"]["run_id"] == "r"
    assert scan(directory) == [record]
    assert parts.verify_part(directory, record) == parts.file_version(directory / part_name(10, 2))
    assert read_verified(directory, record) == DATA


def test_a_replica_that_hashes_otherwise_than_the_owner_said_is_dropped(tmp_path):
    with pytest.raises(CheckpointIntegrityError, match="rank 1's part of iteration 5"):
        write_part(tmp_path, 5, 1, [b"damaged"], IDENTITY, expected_digest=_digest(b"sent"))
    assert os.listdir(tmp_path) == []
    assert write_part(tmp_path, 5, 1, [b"sent"], IDENTITY, expected_digest=_digest(b"sent"))


def test_rewriting_a_part_replaces_its_record(tmp_path):
    write_part(tmp_path, 5, 0, [b"old bytes"], IDENTITY)
    new = write_part(tmp_path, 5, 0, [b"new"], IDENTITY)
    assert scan(tmp_path) == [new]
    assert read_verified(tmp_path, new) == b"new"


def test_a_failed_write_leaves_no_part_behind(tmp_path):
    def failing():
        yield b"some bytes"
        raise OSError(28, "No space left on device")

    with pytest.raises(StorageWriteError, match="iteration 6 .*No space left"):
        write_part(tmp_path, 6, 0, failing(), IDENTITY)
    assert os.listdir(tmp_path) == []
    blocked = tmp_path / "a file"
    blocked.write_text("")
    with pytest.raises(StorageWriteError, match="cannot write rank 0's"):
        write_part(blocked, 6, 0, [b"x"], IDENTITY)


def test_a_part_whose_record_cannot_be_written_is_removed(tmp_path, monkeypatch):
    def no_record(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(part_output, "atomic_output", no_record)
    with pytest.raises(StorageWriteError, match="Input/output error"):
        write_part(tmp_path, 6, 0, [b"x"], IDENTITY)
    assert os.listdir(tmp_path) == []


def test_a_flipped_byte_is_found_before_the_part_is_used(tmp_path, caplog):
    record = write_part(tmp_path, 7, 0, PAYLOAD, IDENTITY)
    path = tmp_path / part_name(7, 0)
    raw = bytearray(path.read_bytes())
    raw[500] ^= 0x01
    path.write_bytes(raw)
    assert scan(tmp_path) == [record]  # same size: only hashing finds it
    with caplog.at_level(logging.WARNING):
        assert read_verified(tmp_path, record) is None
    assert "damaged" in caplog.text


def test_a_part_of_another_size_or_missing_is_not_listed_nor_read(tmp_path, caplog):
    record = write_part(tmp_path, 8, 0, PAYLOAD, IDENTITY)
    path = tmp_path / part_name(8, 0)
    path.write_bytes(DATA[:-1])
    with caplog.at_level(logging.WARNING):
        assert scan(tmp_path) == []
        assert read_verified(tmp_path, record) is None
    assert "the record says" in caplog.text and "size" in caplog.text
    path.write_bytes(DATA + b"!")
    assert read_verified(tmp_path, record) is None
    path.unlink()
    assert scan(tmp_path) == [] and read_verified(tmp_path, record) is None


def test_scan_ignores_records_it_cannot_trust_and_parts_without_records(tmp_path, caplog):
    good = write_part(tmp_path, 9, 1, [b"abc"], IDENTITY)
    (tmp_path / record_name(9, 2)).write_text("{not json")
    (tmp_path / part_name(9, 2)).write_bytes(b"abc")
    (tmp_path / part_name(9, 3)).write_bytes(b"no record: written by nvidia-resiliency-ext")
    other = PartRecord(9, 5, 3, good.digest, IDENTITY, format="someone else/9")
    (tmp_path / record_name(9, 5)).write_text(other.to_json())
    (tmp_path / part_name(9, 5)).write_bytes(b"abc")
    moved = PartRecord(9, 6, 3, good.digest, IDENTITY)  # says owner 6, named owner 7
    (tmp_path / record_name(9, 7)).write_text(moved.to_json())
    (tmp_path / part_name(9, 7)).write_bytes(b"abc")
    (tmp_path / "unrelated.txt").write_text("")
    with caplog.at_level(logging.WARNING):
        assert scan(tmp_path) == [good]
    assert "unreadable" in caplog.text and "without a record" in caplog.text
    assert "someone else/9" in caplog.text and "owner 6" in caplog.text
    assert scan(tmp_path / "lost node") == []


def test_remove_iterations_takes_every_file_of_the_chosen_iterations(tmp_path):
    for iteration in (1, 2, 3):
        write_part(tmp_path, iteration, 0, [b"p"], IDENTITY)
    (tmp_path / part_name(2, 1, dirty=True)).write_bytes(b"interrupted")
    (tmp_path / f".{record_name(2, 1)}.tmp-1-abcd").write_text("")
    (tmp_path / "keep.txt").write_text("")
    removed = remove_iterations(tmp_path, lambda iteration: iteration < 3)
    assert removed[:2] == [record_name(1, 0), record_name(2, 0)]  # records before parts
    unfinished = [part_name(2, 1, dirty=True), f".{record_name(2, 1)}.tmp-1-abcd"]
    assert sorted(removed[2:]) == sorted([part_name(1, 0), part_name(2, 0)] + unfinished)
    assert sorted(os.listdir(tmp_path)) == sorted(["keep.txt", record_name(3, 0), part_name(3, 0)])
    assert remove_iterations(tmp_path / "missing", lambda i: True) == []


def test_identities_differ_by_field_and_algo_counts_only_when_both_know_it():
    assert IDENTITY.differences(IDENTITY) == []
    other = LocalIdentity(world_size=8, replication_jump=2, replication_factor=2, run_id="r")
    assert IDENTITY.differences(other) == ["world_size: 4 != 8"]
    atomic = LocalIdentity(4, 2, 2, "r", algo="atomic")
    assert IDENTITY.differences(atomic) == []
    assert atomic.differences(LocalIdentity(4, 2, 2, "r", algo="fully_parallel")) == [
        "algo: 'atomic' != 'fully_parallel'"
    ]
    record = PartRecord(1, 0, 3, "d", atomic)
    assert PartRecord.from_json(record.to_json()) == record


def test_a_full_disk_under_torch_save_is_a_storage_error_naming_the_file(tmp_path):
    """torch's zip writer reports a failing stream as "unexpected pos"; the stream keeps
    the real error, which open_part raises (ENOSPC from /dev/full behind the dirty name)."""
    import torch

    os.makedirs(tmp_path / "h")
    dirty = tmp_path / "h" / part_name(5, 1, dirty=True)
    os.symlink("/dev/full", dirty)
    with pytest.raises(StorageWriteError) as caught:
        with part_output.open_part(tmp_path / "h", 5, 1, IDENTITY) as stream:
            torch.save({"w": torch.zeros(1 << 16)}, stream)
    assert "No space left on device" in str(caught.value), str(caught.value)
    assert str(dirty) in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError)
    assert scan(tmp_path / "h") == []


def test_a_directory_that_cannot_be_listed_holds_nothing_usable(tmp_path, caplog):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_bytes(b"x")
    with caplog.at_level(logging.WARNING):
        assert scan(not_a_directory) == []
    assert "cannot list local checkpoint parts" in caplog.text


def test_verifying_a_part_streams_it_and_tells_the_version_it_hashed(tmp_path, caplog):
    record = write_part(tmp_path, 3, 0, PAYLOAD, IDENTITY)
    path = tmp_path / part_name(3, 0)
    version = parts.verify_part(tmp_path, record)
    assert version == parts.file_version(path) and version.num_bytes == len(DATA)
    data = bytearray(path.read_bytes())
    data[5] ^= 1
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert parts.verify_part(tmp_path, record) is None
    assert "damaged" in caplog.text
    assert parts.file_version(tmp_path / "missing") is None


def test_a_replica_is_mapped_to_send_only_at_its_records_size(tmp_path):
    record = write_part(tmp_path, 3, 1, PAYLOAD, IDENTITY)
    mapping = parts.map_part(tmp_path, record)
    assert bytes(mapping) == DATA
    mapping[0] = 0  # private: the file is not changed
    assert (tmp_path / part_name(3, 1)).read_bytes() == DATA
    mapping.close()
    with open(tmp_path / part_name(3, 1), "ab") as stream:
        stream.write(b"more")
    with pytest.raises(OSError, match="its record says"):
        parts.map_part(tmp_path, record)


def test_an_incoming_part_arrives_in_its_file_and_is_put_in_place_with_its_record(tmp_path):
    directory = tmp_path / "1"  # created for it
    record = PartRecord(7, 1, len(DATA), _digest(DATA), IDENTITY)
    incoming = part_output.IncomingPart(directory, record)
    incoming.buffer[:] = DATA  # what a receive does
    assert incoming.digest() == record.digest
    version = incoming.commit()
    assert version == parts.file_version(directory / part_name(7, 1))
    assert sorted(os.listdir(directory)) == [record_name(7, 1), part_name(7, 1)]
    assert scan(directory) == [record] and read_verified(directory, record) == DATA

    discarded = part_output.IncomingPart(directory, PartRecord(8, 1, 10, "0", IDENTITY))
    assert part_name(8, 1, dirty=True) in os.listdir(directory)
    discarded.discard()
    assert sorted(os.listdir(directory)) == [record_name(7, 1), part_name(7, 1)]


def test_a_part_of_unaligned_size_over_several_chunks_records_the_digest_of_its_bytes(tmp_path):
    """A part streams through the local bucket file: 8 MiB chunks, hashed there, written
    with O_DIRECT where the file system accepts it, the last one padded to the block size
    and cut off. The record describes exactly the bytes read back."""
    data = os.urandom(2 * CHUNK_BYTES + DIRECT_IO_ALIGNMENT + 1)
    with part_output.open_part(tmp_path, 4, 0, IDENTITY) as stream:
        for start in range(0, len(data), 3 << 20):  # pieces that straddle the chunks
            stream.write(memoryview(data)[start : start + (3 << 20)])
        direct = stream.writes_direct
    stored = (tmp_path / part_name(4, 0)).read_bytes()
    assert stored == data
    assert (stream.record.num_bytes, stream.record.digest) == (len(data), _digest(stored))
    assert scan(tmp_path) == [stream.record] and read_verified(tmp_path, stream.record) == data
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        return  # a file system without direct I/O: written buffered, as checked above
    assert direct, "the part was not written with O_DIRECT where the file system accepts it"


def test_a_replica_received_straight_into_the_chunk_records_the_digest_of_its_bytes(tmp_path):
    """A peer's part arrives from its socket directly into the bucket file's chunk (no
    receive buffer): unaligned, over several chunks, in whatever pieces the socket gives."""
    data = os.urandom(2 * CHUNK_BYTES + DIRECT_IO_ALIGNMENT + 1)
    receiver, sender = socket.socketpair()
    feeder = threading.Thread(target=lambda: (sender.sendall(data), sender.close()))
    feeder.start()
    with part_output.open_part(tmp_path, 5, 1, IDENTITY) as stream:
        transport.recv_into_stream(receiver, len(data), time.monotonic() + 30, stream.free_space,
                                   stream.commit)
        stream.expected_digest = _digest(data)  # the owner's, sent after the bytes
    feeder.join()
    receiver.close()
    assert (tmp_path / part_name(5, 1)).read_bytes() == data
    assert (stream.record.num_bytes, stream.record.digest) == (len(data), _digest(data))
