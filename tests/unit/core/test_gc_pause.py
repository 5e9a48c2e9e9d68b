"""The cyclic collector pause: nested and overlapping uses restore what the first found."""

import gc
import threading

import pytest

from megatron_async.core.gc_pause import paused_gc


@pytest.fixture(autouse=True)
def _collector_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_nested_pauses_resume_only_after_the_outermost():
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled():
    gc.disable()
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_threads_keep_it_paused_until_the_last_leaves():
    entered, release_other = threading.Event(), threading.Event()
    seen = {}

    def other():
        with paused_gc():
            entered.set()
            release_other.wait(10)
            seen["other_inside_after_first_left"] = gc.isenabled()

    thread = threading.Thread(target=other)
    with paused_gc():
        thread.start()
        assert entered.wait(10)
    # The first user left while the other thread is still inside: still paused.
    assert not gc.isenabled()
    release_other.set()
    thread.join(10)
    assert seen["other_inside_after_first_left"] is False
    assert gc.isenabled()


def test_an_exception_inside_still_resumes():
    with pytest.raises(RuntimeError):
        with paused_gc():
            raise RuntimeError("boom")
    assert gc.isenabled()
