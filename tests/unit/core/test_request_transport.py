"""Requests travel to the persistent worker with tensors as shared-memory references."""

import gc
import socket

import pytest
import torch

from megatron_async.core import shared_memory
from megatron_async.core.request_transport import RequestSender, SegmentTable
from megatron_async.errors import UnpicklableRequestError


def _pair():
    """A sender and a table joined by a descriptor socket, as trainer and worker are."""
    trainer_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    worker_end.settimeout(10)
    return RequestSender(trainer_end), SegmentTable(worker_end)


def _segment_views(num_tensors: int, numel: int, reusable: bool = True):
    segment = shared_memory.allocate_segment(num_tensors * numel * 4, reusable)
    views = [
        shared_memory.segment_view(segment, i * numel * 4, (numel,), torch.float32)
        for i in range(num_tensors)
    ]
    return segment, views


def test_staged_tensors_go_as_references_and_each_segment_is_sent_once():
    segment, views = _segment_views(1000, 16)
    for i, view in enumerate(views):
        view.fill_(i)
    sender, table = _pair()
    encoded, arena = sender.encode({"tensors": views})
    assert arena == [] and encoded.call_segments == ()
    assert len(encoded.new_segments) == 1  # one segment, not 1,000 tensors
    decoded = table.apply(encoded)["tensors"]
    assert all(torch.equal(t, torch.full((16,), float(i))) for i, t in enumerate(decoded))
    # The decoded tensors map the same memory: they see what is staged into it later.
    views[3].fill_(-1.0)
    assert torch.equal(decoded[3], torch.full((16,), -1.0))

    again, _ = sender.encode({"tensors": views})
    assert again.new_segments == ()  # already mapped by the worker
    assert len(again.payload) < 64 * 1000  # references, not data


def test_other_cpu_tensors_are_copied_so_later_updates_do_not_leak():
    trainer_tensor = torch.arange(10.0)
    empty_view = trainer_tensor[:0]
    sender, table = _pair()
    encoded, arena = sender.encode((trainer_tensor, trainer_tensor[::2], empty_view))
    trainer_tensor.add_(100.0)  # the trainer's next step, right after scheduling
    full, strided, empty = table.apply(encoded)
    assert torch.equal(full, torch.arange(10.0))
    assert torch.equal(strided, torch.arange(0.0, 10.0, 2.0))
    assert empty.numel() == 0
    assert not trainer_tensor.is_shared()  # the trainer's memory stays where it was
    assert len(arena) == 1 and len(encoded.call_segments) == 1
    SegmentTable.drop(encoded.call_segments)
    assert encoded.call_segments[0] not in SegmentTable.mapped_ids()


def test_a_segment_freed_by_the_trainer_is_forgotten_by_the_worker():
    segment, views = _segment_views(2, 4)
    sender, table = _pair()
    encoded, _ = sender.encode(views)
    table.apply(encoded)
    ((segment_id, _),) = encoded.new_segments
    assert segment_id in SegmentTable.mapped_ids()
    del segment, views, encoded
    gc.collect()
    assert not shared_memory.segment_is_alive(segment_id)
    nothing, _ = sender.encode([])
    assert nothing.forget == (segment_id,)
    table.apply(nothing)
    assert segment_id not in SegmentTable.mapped_ids()


def test_segment_ids_are_never_reused():
    first = shared_memory.allocate_segment(128)
    first_id = shared_memory.find_segment(first).segment_id
    del first
    gc.collect()
    second = shared_memory.allocate_segment(128)
    assert shared_memory.find_segment(second).segment_id != first_id
    assert shared_memory.find_segment(torch.zeros(4)) is None


def test_a_one_call_segment_is_dropped_by_the_worker_after_the_call():
    segment, views = _segment_views(4, 8, reusable=False)
    sender, table = _pair()
    encoded, _ = sender.encode(views)
    assert encoded.call_segments == tuple(sid for sid, _ in encoded.new_segments)
    assert len(encoded.call_segments) == 1
    table.apply(encoded)
    SegmentTable.drop(encoded.call_segments)
    assert encoded.call_segments[0] not in SegmentTable.mapped_ids()


def test_plan_items_are_sent_once_and_then_by_token():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    items = [WriteItem(index=MetadataIndex(f"t{i}"), type=WriteItemType.TENSOR) for i in range(1100)]
    sender, table = _pair()
    first, _ = sender.encode(items)
    assert table.apply(first) == items
    second, _ = sender.encode(items)
    assert len(second.new_objects) < 64 and len(second.payload) < len(first.new_objects) / 5
    decoded = table.apply(second)
    assert decoded == items and decoded[0] is not items[0]  # the worker's own copies

    # Items a later structure no longer uses are dropped on both sides once there are many.
    others = [WriteItem(index=MetadataIndex(f"u{i}"), type=WriteItemType.TENSOR) for i in range(10)]
    third, _ = sender.encode(others)
    assert len(third.forget_objects) == 1100
    assert table.apply(third) == others


def test_a_request_that_refers_to_the_training_script_goes_by_value():
    """The worker never runs ``__main__``: what is defined there is sent by value
    (tests/unit/core/test_by_value_pickling.py has the details)."""

    def save_fn(path, staged):
        return f"saved {path}"

    save_fn.__module__ = "__main__"  # as if defined in the training script
    sender, table = _pair()
    decoded_fn, args = table.apply(sender.encode((save_fn, ("path", None)))[0])
    assert decoded_fn is not save_fn and decoded_fn(*args) == "saved path"


def _pairs(count, numel=4, prefix="t"):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    segment, views = _segment_views(count, numel)
    items = [WriteItem(index=MetadataIndex(f"{prefix}{i}"), type=WriteItemType.TENSOR) for i in range(count)]
    return segment, shared_memory.ReusedTensorPairs(zip(items, views))


def test_reused_pairs_are_encoded_once_and_decode_to_the_staged_values():
    segment, pairs = _pairs(300)
    sender, table = _pair()
    first, _ = sender.encode({"bucket": pairs, "path": "iter_1"})
    for i, (_, view) in enumerate(pairs):
        view.fill_(float(i))
    decoded = table.apply(first)["bucket"]
    assert [item for item, _ in decoded] == [item for item, _ in pairs]
    assert all(torch.equal(t, torch.full((4,), float(i))) for i, (_, t) in enumerate(decoded))

    # The next save stages new values into the same buffers and sends the same pairs.
    for i, (_, view) in enumerate(pairs):
        view.fill_(float(-i))
    second, _ = sender.encode({"bucket": pairs, "path": "iter_2"})
    assert second.new_segments == () and len(second.new_objects) < 64
    decoded = table.apply(second)
    assert decoded["path"] == "iter_2"
    assert all(torch.equal(t, torch.full((4,), float(-i))) for i, (_, t) in enumerate(decoded["bucket"]))
    assert sender._pairs[id(pairs)].payload in second.payload  # the bytes of the first encoding


def test_a_new_pairs_object_is_encoded_anew_and_a_dropped_one_is_forgotten():
    segment, pairs = _pairs(5)
    sender, table = _pair()
    table.apply(sender.encode(pairs)[0])
    key = id(pairs)
    assert key in sender._pairs
    # Another structure (other items, other buffers) is never served the old bytes.
    other_segment, others = _pairs(3, numel=2)
    decoded = table.apply(sender.encode(others)[0])
    assert len(decoded) == 3 and all(t.shape == (2,) for _, t in decoded)
    del pairs
    gc.collect()
    assert key not in sender._pairs  # the encoding went with the pairs


def test_reused_pairs_survive_a_request_that_was_never_sent():
    """A failed encode forgets the items it introduced: the cached bytes must not name them."""
    segment, pairs = _pairs(4, prefix="never_sent")
    sender, table = _pair()

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this")

    with pytest.raises(UnpicklableRequestError):
        sender.encode((pairs, Unpicklable()))
    decoded = table.apply(sender.encode(pairs)[0])
    assert [item for item, _ in decoded] == [item for item, _ in pairs]
