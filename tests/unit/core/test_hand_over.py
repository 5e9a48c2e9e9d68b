"""Which caller runs a request's preload_fn: staging that continues after the hand-over
is refused at once, naming the fix, when another library's caller runs it."""

import threading

import pytest

from megatron_async.core.hand_over import caller_hands_over, require_hand_over, run_preload
from megatron_async.errors import StagingHandOverError


def test_only_our_callers_preload_is_marked_and_the_mark_is_per_thread():
    seen = {}

    def preload():
        seen["inside"] = caller_hands_over()
        other = threading.Thread(target=lambda: seen.setdefault("other thread", caller_hands_over()))
        other.start()
        other.join()
        return run_preload(lambda: "nested")

    assert not caller_hands_over()
    assert run_preload(preload) == "nested"
    assert seen == {"inside": True, "other thread": False}
    assert not caller_hands_over()


def test_the_mark_ends_when_preload_raises():
    with pytest.raises(ZeroDivisionError):
        run_preload(lambda: 1 / 0)
    assert not caller_hands_over()


def test_outside_our_callers_the_refusal_names_the_queue_and_the_alternative():
    run_preload(lambda: require_hand_over("overlapped staging", "save without overlap_staging"))
    with pytest.raises(StagingHandOverError) as raised:
        require_hand_over("overlapped staging", "save without overlap_staging")
    message = str(raised.value)
    assert "megatron_async.AsyncCallsQueue" in message
    assert "save without overlap_staging" in message and "previous checkpoint is intact" in message
