"""wait_for_device_copies: an event on each device's current stream, polled against a deadline.

No GPU here: torch.cuda's Event and current_stream are replaced by fakes that say when
the device "ran" the copies. The real thing runs in the gpu-marked staging tests.
"""

import gc
import time
import weakref

import pytest
import torch

from megatron_async.core import device_wait
from megatron_async.core.device_wait import DeviceCopyTimeoutError, wait_for_device_copies
from megatron_async.errors import AsyncTimeoutError


@pytest.fixture(autouse=True)
def _nothing_held(monkeypatch):
    monkeypatch.setattr(device_wait, "_held", [])


class _HostMemory:
    """Stands for the host buffers a copy writes into (a weak reference tells whether the
    wait keeps them alive once the caller dropped them)."""


class _FakeDevice:
    """Streams and events of fake devices: an event is done after ``polls`` queries."""

    def __init__(self, monkeypatch, polls):
        self.recorded, self.queries, self.polls = [], 0, polls
        fake = self

        class Event:
            def record(self, stream):
                fake.recorded.append(stream)

            def query(self):
                fake.queries += 1
                return fake.polls is not None and fake.queries > fake.polls

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device: ("stream of", device))
        monkeypatch.setattr(torch.cuda, "synchronize", self._refuse)

    @staticmethod
    def _refuse(*args, **kwargs):
        raise AssertionError("a device-wide synchronize waits for every stream, unbounded")


def test_waits_on_each_devices_current_stream_until_the_event_ran(monkeypatch):
    fake = _FakeDevice(monkeypatch, polls=5)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    wait_for_device_copies(devices, timeout_s=5.0)
    assert fake.recorded == [("stream of", devices[0]), ("stream of", devices[1])]
    assert fake.queries == 7  # five "not yet" and one "done" for the first, one for the second


def test_nothing_to_wait_for_touches_no_device(monkeypatch):
    fake = _FakeDevice(monkeypatch, polls=0)
    wait_for_device_copies([])
    assert fake.recorded == [] and fake.queries == 0


def test_a_device_that_makes_no_progress_fails_within_the_bound(monkeypatch):
    _FakeDevice(monkeypatch, polls=None)  # never done
    started = time.monotonic()
    with pytest.raises(DeviceCopyTimeoutError, match="cuda:0 to host memory did not finish") as raised:
        wait_for_device_copies([torch.device("cuda", 0)], timeout_s=0.05)
    assert time.monotonic() - started < 2.0
    assert isinstance(raised.value, AsyncTimeoutError)
    assert "previous checkpoint is kept" in str(raised.value)


def test_short_copies_are_seen_without_sleeping_then_polls_back_off(monkeypatch):
    _FakeDevice(monkeypatch, polls=3)
    pauses = []
    monkeypatch.setattr(device_wait.time, "sleep", pauses.append)
    wait_for_device_copies([torch.device("cuda", 0)], timeout_s=5.0)
    assert pauses == []  # done within the first 0.1 ms of spinning
    _FakeDevice(monkeypatch, polls=12)
    monkeypatch.setattr(device_wait, "_SPIN_S", 0.0)
    wait_for_device_copies([torch.device("cuda", 0)], timeout_s=5.0)
    assert len(pauses) == 12 and pauses == sorted(pauses)
    assert pauses[0] <= 50e-6 and max(pauses) <= 1e-3  # a finished copy is seen within 1 ms


def test_an_interrupt_is_raised_only_once_the_copies_landed(monkeypatch):
    # The copies write into host memory the caller frees when the interrupt unwinds it.
    fake = _FakeDevice(monkeypatch, polls=6)
    monkeypatch.setattr(device_wait, "_SPIN_S", 0.0)
    interrupted = []

    def sleep(seconds):
        if not interrupted:
            interrupted.append(fake.queries)
            raise KeyboardInterrupt

    monkeypatch.setattr(device_wait.time, "sleep", sleep)
    with pytest.raises(KeyboardInterrupt):
        wait_for_device_copies([torch.device("cuda", 0)], timeout_s=5.0)
    assert interrupted == [1] and fake.queries == 7  # it went on polling until done


def test_with_memory_to_keep_an_interrupt_is_raised_at_once_and_the_memory_kept(monkeypatch):
    fake = _FakeDevice(monkeypatch, polls=None)  # stuck
    monkeypatch.setattr(device_wait, "_SPIN_S", 0.0)

    def sleep(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(device_wait.time, "sleep", sleep)
    memory = _HostMemory()
    kept = weakref.ref(memory)
    with pytest.raises(KeyboardInterrupt):
        wait_for_device_copies([torch.device("cuda", 0)], timeout_s=600.0, holding=memory)
    del memory
    gc.collect()
    assert fake.queries == 1 and kept() is not None


def test_an_interrupt_then_a_timeout_raises_the_timeout_from_the_interrupt(monkeypatch):
    _FakeDevice(monkeypatch, polls=None)
    monkeypatch.setattr(device_wait, "_SPIN_S", 0.0)
    clock = [0.0]
    monkeypatch.setattr(device_wait.time, "monotonic", lambda: clock[0])

    def sleep(seconds):
        clock[0] += 1.0
        if clock[0] == 1.0:
            raise KeyboardInterrupt

    monkeypatch.setattr(device_wait.time, "sleep", sleep)
    with pytest.raises(DeviceCopyTimeoutError) as raised:
        wait_for_device_copies([torch.device("cuda", 0)], timeout_s=3.0)
    assert isinstance(raised.value.__cause__, KeyboardInterrupt)


def test_memory_a_copy_may_still_write_is_kept_until_the_copy_landed(monkeypatch):
    fake = _FakeDevice(monkeypatch, polls=None)  # stuck
    memory = _HostMemory()
    kept = weakref.ref(memory)
    with pytest.raises(DeviceCopyTimeoutError):
        wait_for_device_copies([torch.device("cuda", 0)], timeout_s=0.01, holding=memory)
    del memory
    gc.collect()
    assert kept() is not None
    device_wait.release_landed()
    gc.collect()
    assert kept() is not None  # still not landed
    fake.polls = 0  # the device moves again
    device_wait.release_landed()
    gc.collect()
    assert kept() is None


def test_a_device_error_while_waiting_keeps_the_memory_and_is_raised(monkeypatch):
    _FakeDevice(monkeypatch, polls=None)

    def broken(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda.Event, "query", broken)
    memory = _HostMemory()
    kept = weakref.ref(memory)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        wait_for_device_copies([torch.device("cuda", 0)], timeout_s=5.0, holding=memory)
    del memory
    device_wait.release_landed()  # a device that errs is never known to have landed
    gc.collect()
    assert kept() is not None


def test_the_temporal_caller_waits_on_the_current_device_before_forking(monkeypatch):
    from megatron_async.core import temporal

    fake = _FakeDevice(monkeypatch, polls=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    temporal._synchronize_cuda_if_used()
    assert fake.recorded == [("stream of", torch.device("cuda", 3))] and fake.queries == 2
