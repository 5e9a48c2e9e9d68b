"""What the training script defines reaches the persistent worker by value.

Each test runs a small "training script" in a namespace of its own named ``__main__``
(as ``python script.py`` would), encodes a request for the worker and decodes it as the
worker does. Nothing can be found by reference there: the decoded objects are rebuilt.
"""

import dataclasses
import pickle
import socket
import threading

import pytest

from megatron_async.core.by_value_pickling import CodeCache
from megatron_async.core.request_transport import RequestSender, SegmentTable
from megatron_async.errors import UnpicklableRequestError
from tests import background_fns as fns

SCRIPT = '''
import os
COUNT = 3

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
    trainer_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    worker_end.settimeout(10)
    encoded, _ = (sender or RequestSender(trainer_end)).encode(obj)
    return SegmentTable(worker_end).apply(encoded)


def test_script_functions_run_with_their_globals_modules_defaults_and_closures():
    script = _script()
    write_marker, factorial, add, square = _round_trip(
        (script["write_marker"], script["factorial"], script["make_adder"](10), script["square"])
    )
    assert write_marker is not script["write_marker"]
    assert write_marker("dir", 2) == "dir/6" and write_marker("dir", 2, sep="|") == "dir|6"
    assert factorial(5) == 120  # finds itself in its rebuilt namespace
    assert add(1) == 15 and add.__closure__ is not None
    assert square(4) == 16
    assert write_marker.__module__ == "__main__" and write_marker.__qualname__ == "write_marker"
    # One namespace per script and request, holding only what the functions use.
    assert write_marker.__globals__ is factorial.__globals__
    assert "make_adder" not in write_marker.__globals__


def test_globals_are_the_values_at_scheduling_and_code_is_analysed_once():
    script = _script()
    trainer_end, _ = socket.socketpair()
    sender = RequestSender(trainer_end)
    first = _round_trip(script["helper"], sender)
    script["COUNT"] = 100  # the training loop changes a global after scheduling
    assert first(2) == 6
    assert _round_trip(script["helper"], sender)(2) == 200

    cache = CodeCache()
    code = script["helper"].__code__
    assert cache.get(code)[0] is cache.get(code)[0]
    assert cache.get(code)[1] == ("COUNT",)


CLASSES = '''
import abc, dataclasses, functools
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

class Lazy:
    @functools.cached_property
    def answer(self):
        return 42

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

def uses_spec(spec):
    return isinstance(spec, Spec)
'''


def test_script_classes_and_their_instances_are_rebuilt():
    script = _script(CLASSES)
    spec, writer, lazy, options, point, uses_spec = _round_trip((
        script["Spec"](7), script["MarkerWriter"]("!"), script["Lazy"](),
        script["Options"]("/ckpt"), script["Point"](1), script["uses_spec"],
    ))
    assert type(spec) is not script["Spec"]
    assert spec.describe() == "Sspec:7"  # super() and class attributes of the base
    assert (spec.static(), spec.name(), spec.next) == ("static", "Spec", 8)
    assert writer(spec) == "Sspec:7!" and writer.write() == "written!"  # callable, abstract base
    assert type(writer)("?").write() == "written?"
    assert lazy.answer == 42
    assert dataclasses.asdict(options) == {"path": "/ckpt", "tags": []}
    assert type(options)("/other").tags == []  # default_factory still recognised
    assert point == (1, 5) and type(point)(3).y == 5
    assert uses_spec(spec)  # one rebuilt class per request, shared by all that use it


def test_a_function_of_an_importable_module_goes_by_reference_or_keeps_its_module():
    offset = 4

    def local(x):
        return fns.__name__, x + offset

    decoded_local, write_text = _round_trip((local, fns.write_text))
    assert write_text is fns.write_text
    assert decoded_local(1) == ("tests.background_fns", 5)
    assert decoded_local.__globals__ is globals()  # the module's namespace, imported


def test_functions_of_a_spawned_ranks_script_go_by_value():
    script = _script(name="__mp_main__")
    assert _round_trip(script["write_marker"])("d", 1) == "d/3"


def test_an_attribute_named_like_an_unpicklable_global_is_not_sent():
    script = _script("import threading\nlock = threading.Lock()\ndef f(obj):\n    return obj.lock\n")
    holder = type("Holder", (), {"lock": 1})  # a local class: by value as well
    f, decoded_holder = _round_trip((script["f"], holder()))
    assert f(decoded_holder) == 1


def test_a_routine_capturing_something_unpicklable_is_refused_naming_it():
    lock = threading.Lock()

    def save_fn(path, staged):
        with lock:
            pass

    with pytest.raises(UnpicklableRequestError) as info:
        _round_trip((save_fn, ("path", None)))
    message = str(info.value)
    assert "save_fn" in message and "closure variable 'lock'" in message
    assert "_thread.lock" in message and "AsyncCallsQueue(persistent=False)" in message
    assert isinstance(info.value, pickle.PicklingError)

    script = _script("import threading\nLOCK = threading.Lock()\ndef g():\n    return LOCK\n")
    with pytest.raises(UnpicklableRequestError, match="function g of the training script .*global 'LOCK'"):
        _round_trip(script["g"])


def test_an_enum_of_the_script_is_refused_clearly():
    script = _script("import enum\nclass Mode(enum.Enum):\n    FULL = 1\n")
    with pytest.raises(UnpicklableRequestError, match="class Mode of the training script .* an enum"):
        _round_trip(script["Mode"].FULL)
