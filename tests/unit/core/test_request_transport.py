"""Requests travel to the persistent worker with tensors as shared-memory references, and
what the training script defines goes by value (cloudpickle).

The by-value tests run a small "training script" in a namespace of its own named
``__main__`` (as ``python script.py`` would), encode a request for the worker and decode
it as the worker does: the decoded functions are rebuilt, not found by reference (a class
sent by value is rebuilt too, but cloudpickle maps it back to the original class within
one process; tests/functional/test_script_routines.py sends them to a worker forked
before the script defined them).
"""

import dataclasses
import gc
import os
import pickle
import sys
import threading
import types

import cloudpickle
import pytest
import torch

from megatron_async.core import shared_memory
from megatron_async.core.request_transport import RequestSender
from megatron_async.core.worker_loop import SegmentTable
from megatron_async.errors import CoordinationError, UnpicklableRequestError
from tests import background_fns as fns


def _pair():
    """A sender and a table that opens this process's descriptors, as the worker opens its
    trainer's."""
    return RequestSender(), SegmentTable(os.getpid())


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
    table.drop(encoded.call_segments)
    assert encoded.call_segments[0] not in table._segments


def test_a_segment_freed_by_the_trainer_is_forgotten_by_the_worker():
    segment, views = _segment_views(2, 4)
    sender, table = _pair()
    encoded, _ = sender.encode(views)
    table.apply(encoded)
    ((segment_id, _, _),) = encoded.new_segments
    assert segment_id in table._segments
    del segment, views, encoded
    gc.collect()
    nothing, _ = sender.encode([])
    assert nothing.forget == (segment_id,)
    table.apply(nothing)
    assert segment_id not in table._segments


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
    assert encoded.call_segments == tuple(sid for sid, _, _ in encoded.new_segments)
    assert len(encoded.call_segments) == 1
    table.apply(encoded)
    table.drop(encoded.call_segments)
    assert encoded.call_segments[0] not in table._segments


def _pairs(count, numel=4, prefix="t"):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    segment, views = _segment_views(count, numel)
    items = [WriteItem(index=MetadataIndex(f"{prefix}{i}"), type=WriteItemType.TENSOR) for i in range(count)]
    return segment, shared_memory.ReusedTensorPairs(zip(items, views))


def test_reused_pairs_are_sent_once_and_decode_to_the_staged_values():
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
    assert second.new_segments == () and len(second.payload) < 200  # a token, not 300 pairs
    decoded_again = table.apply(second)
    assert decoded_again["path"] == "iter_2"
    assert decoded_again["bucket"] is decoded  # the worker's copy, kept
    assert all(torch.equal(t, torch.full((4,), float(-i))) for i, (_, t) in enumerate(decoded))


def test_a_new_pairs_object_is_sent_anew_and_a_dropped_one_is_forgotten():
    segment, pairs = _pairs(5)
    sender, table = _pair()
    first = table.apply(sender.encode(pairs)[0])
    # Another structure (other items, other buffers) is never served the old pairs.
    other_segment, others = _pairs(3, numel=2)
    decoded = table.apply(sender.encode(others)[0])
    assert len(decoded) == 3 and all(t.shape == (2,) for _, t in decoded)
    assert table.apply(sender.encode(pairs)[0]) is first
    del pairs, first
    gc.collect()
    later, _ = sender.encode(others)
    assert len(later.forget_pairs) == 1  # the worker drops its copy (and the views it holds)
    assert table.apply(later) is decoded


def test_reused_pairs_survive_a_request_that_was_never_sent():
    """A failed encode forgets the pairs it introduced: a later request sends them in full."""
    segment, pairs = _pairs(4, prefix="never_sent")
    sender, table = _pair()

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this")

    with pytest.raises(UnpicklableRequestError):
        sender.encode((pairs, Unpicklable()))
    decoded = table.apply(sender.encode(pairs)[0])
    assert [item for item, _ in decoded] == [item for item, _ in pairs]


# -- what the training script defines goes by value --------------------------------------

SCRIPT = '''
import os
COUNT = 3
UNUSED = "not sent"

def helper(x):
    return x * COUNT

def write_marker(path, staged, *, sep=os.sep):
    return f"{path}{sep}{helper(staged)}"

def factorial(n):
    return 1 if n <= 1 else n * factorial(n - 1)

def make_adder(k):
    def add(x, y=2):
        return helper(x) + k + y
    return add

square = lambda v: v * v
'''


def _script(source: str = SCRIPT, name: str = "__main__") -> dict:
    """Run ``source`` as a training script would run (its own ``__main__`` namespace)."""
    namespace = {"__name__": name}
    exec(compile(source, "<training script>", "exec"), namespace)
    return namespace


def _round_trip(obj, sender=None):
    """Encode ``obj`` on the trainer's side and decode it on the worker's."""
    encoded, _ = (sender or RequestSender()).encode(obj)
    return SegmentTable(os.getpid()).apply(encoded)


def test_script_functions_run_with_their_globals_modules_defaults_and_closures():
    script = _script()
    write_marker, factorial, add, square = _round_trip(
        (script["write_marker"], script["factorial"], script["make_adder"](10), script["square"])
    )
    assert write_marker is not script["write_marker"]
    assert write_marker("dir", 2) == "dir/6" and write_marker("dir", 2, sep="|") == "dir|6"
    assert factorial(5) == 120  # finds itself
    assert add(1) == 15 and square(4) == 16
    assert write_marker.__module__ == "__main__" and write_marker.__qualname__ == "write_marker"
    assert "UNUSED" not in write_marker.__globals__  # only the globals the code uses travel


def test_globals_are_the_values_at_scheduling():
    script = _script()
    sender = RequestSender()
    first = _round_trip(script["helper"], sender)
    script["COUNT"] = 100  # the training loop changes a global after scheduling
    assert first(2) == 6
    assert _round_trip(script["helper"], sender)(2) == 200


CLASSES = '''
import abc, dataclasses, enum
from typing import NamedTuple

class Base:
    kind = "base"
    def describe(self):
        return f"{self.kind}:{self.value}"

class Spec(Base):
    kind = "spec"
    __slots__ = ("value", "__hidden")
    def __init__(self, value):
        self.value = value
    def describe(self):
        return "S" + super().describe()
    @staticmethod
    def static():
        return "static"
    @classmethod
    def name(cls):
        return cls.__name__
    @property
    def next(self):
        return self.value + 1

@dataclasses.dataclass
class Options:
    path: str
    tags: list = dataclasses.field(default_factory=list)

class Writer(abc.ABC):
    @abc.abstractmethod
    def write(self): ...

class MarkerWriter(Writer):
    def __init__(self, suffix):
        self.suffix = suffix
    def write(self):
        return "written" + self.suffix
    def __call__(self, spec):
        return f"{spec.describe()}{self.suffix}"

class Point(NamedTuple):
    x: int
    y: int = 5

class Mode(enum.Enum):
    FULL = 1
    DELTA = 2

def uses_spec(spec):
    return isinstance(spec, Spec)
'''


def test_script_classes_and_their_instances_are_rebuilt():
    script = _script(CLASSES)
    spec, writer, options, point, mode, uses_spec = _round_trip((
        script["Spec"](7), script["MarkerWriter"]("!"), script["Options"]("/ckpt"), script["Point"](1), script["Mode"].DELTA, script["uses_spec"],
    ))
    assert spec.describe() == "Sspec:7"  # super() and class attributes of the base
    assert (spec.static(), spec.name(), spec.next) == ("static", "Spec", 8)
    assert writer(spec) == "Sspec:7!" and writer.write() == "written!"  # callable, abstract base
    assert type(writer)("?").write() == "written?"
    assert dataclasses.asdict(options) == {"path": "/ckpt", "tags": []}
    assert type(options)("/other").tags == []  # default_factory still recognised
    assert point == (1, 5) and type(point)(3).y == 5
    assert mode.name == "DELTA" and mode is type(mode)(2)  # an enum of the script, too
    assert uses_spec(spec)  # one rebuilt class, shared by all that use it


def test_a_function_of_an_importable_module_goes_by_reference_or_keeps_working():
    offset = 4

    def local(x):
        return fns.__name__, x + offset

    decoded_local, write_text = _round_trip((local, fns.write_text))
    assert write_text is fns.write_text
    assert decoded_local is not local and decoded_local(1) == ("tests.background_fns", 5)


def test_functions_of_a_spawned_ranks_script_go_by_value(monkeypatch):
    """Under multiprocessing's spawn the script is the module ``__mp_main__``, which a
    fresh worker cannot import: it goes by value as ``__main__`` does."""
    module = types.ModuleType("__mp_main__")
    exec(compile(SCRIPT, "<training script>", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "__mp_main__", module)
    decoded = _round_trip(module.write_marker)
    assert decoded is not module.write_marker and decoded("d", 1) == "d/3"


def test_a_module_registered_by_value_goes_by_value(monkeypatch):
    """A module of the script that the worker cannot import (loaded from a file path,
    say) reaches it once registered with cloudpickle."""
    module = types.ModuleType("script_helpers_not_importable")
    exec(compile(SCRIPT, "<script helpers>", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert _round_trip(module.helper) is module.helper  # by reference until registered
    cloudpickle.register_pickle_by_value(module)
    try:
        decoded = _round_trip(module.helper)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    assert decoded is not module.helper and decoded(2) == 6


def test_an_attribute_named_like_an_unpicklable_global_is_not_sent():
    script = _script("import threading\nlock = threading.Lock()\ndef f(obj):\n    return obj.lock\n")
    holder = type("Holder", (), {"lock": 1})  # a local class: by value as well
    f, decoded_holder = _round_trip((script["f"], holder()))
    assert f(decoded_holder) == 1


def test_a_routine_capturing_something_unpicklable_is_refused_saying_what_to_do():
    lock = threading.Lock()

    def save_fn(path, staged):
        with lock:
            pass

    with pytest.raises(UnpicklableRequestError) as info:
        _round_trip((save_fn, ("path", None)))
    message = str(info.value)
    assert "_thread.lock" in message and "closure variables" in message
    assert "AsyncCallsQueue(persistent=False)" in message
    assert isinstance(info.value, pickle.PicklingError)


def test_a_segment_the_worker_cannot_open_fails_the_request_saying_what_to_do():
    segment = shared_memory.allocate_segment(4096)
    tensor = shared_memory.segment_view(segment, 0, (4,), torch.float32)
    encoded, _ = RequestSender().encode(tensor)
    no_such_trainer = 2**22 + 1  # above any pid_max: /proc has no such process
    with pytest.raises(CoordinationError, match=r"cannot open the trainer's staging segment .*temporal caller"):
        SegmentTable(no_such_trainer).apply(encoded)
