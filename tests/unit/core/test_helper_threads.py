"""Bounded calls run on helper threads that outlive them (megatron_async.core.helper_threads).

Scenario: a save's bounded file-system steps are followed at once by a fork (the temporal
caller's writer, a replacement persistent worker). A thread that ends at that moment can
deadlock the forked child (CPython gh-112275), which then hangs the save until its timeout.
"""

import os
import threading
import time

import pytest

from megatron_async.core.helper_threads import DeadlineExpired, HelperThreads

pytestmark = pytest.mark.timeout(60)


def test_calls_one_after_another_reuse_one_thread_that_never_ends():
    pool = HelperThreads()
    idents = set()
    for value in range(20):
        assert pool.run(lambda v=value: (threading.get_ident(), v), 5, "step")[1] == value
        idents.add(pool.run(threading.get_ident, 5, "step"))
    assert len(idents) == 1
    thread = next(t for t in threading.enumerate() if t.ident in idents)
    assert thread.is_alive() and thread.daemon


def test_a_call_that_hangs_keeps_its_thread_and_the_next_call_gets_another():
    pool = HelperThreads()
    mount_answers = threading.Event()
    hung = []

    def hung_call():
        hung.append(threading.get_ident())
        mount_answers.wait()

    with pytest.raises(DeadlineExpired, match="no answer within 0s"):
        pool.run(hung_call, 0.2, "save step: .metadata")
    second = pool.run(threading.get_ident, 5, "next step")
    assert second != hung[0]
    mount_answers.set()  # the hung call returns late: its thread serves again
    deadline = time.monotonic() + 5
    while len(pool._idle) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    first = threading.Event()
    both_running = threading.Barrier(3)
    results = []

    def blocked_call():
        both_running.wait(5)
        first.wait(5)
        return threading.get_ident()

    callers = [threading.Thread(target=lambda: results.append(pool.run(blocked_call, 5, "c")))
               for _ in range(2)]
    for caller in callers:
        caller.start()
    both_running.wait(5)
    first.set()
    for caller in callers:
        caller.join(5)
    assert set(results) == {hung[0], second}  # two at once, no third thread


def test_an_error_is_raised_to_the_caller_and_the_thread_serves_on():
    pool = HelperThreads()
    failed_on = []

    def failing_call():
        failed_on.append(threading.get_ident())
        return {}["mine"]

    with pytest.raises(KeyError, match="mine"):
        pool.run(failing_call, 5, "t")
    assert pool.run(threading.get_ident, 5, "t") == failed_on[0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_starts_with_no_helper_threads_and_can_run_bounded_calls():
    HelperThreads.of_process().run(lambda: None, 5, "parent's step")  # the parent has an idle helper
    pid = os.fork()
    if pid == 0:  # the child: the parent's helper thread does not exist here
        try:
            ok = HelperThreads.of_process().run(lambda: 42, 2, "child's step") == 42
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the child's bounded call did not return")


def test_a_started_job_returns_its_thread_to_the_pool_and_its_error_is_logged(caplog):
    """The persistent worker's sender runs as a started job: when its worker is replaced
    the thread serves the next one instead of ending just before the replacement's fork."""
    pool = HelperThreads()
    senders = []
    first = pool.start(lambda: senders.append(threading.get_ident()), "sender of worker 1")
    assert first.wait(5)

    def failing_sender():
        senders.append(threading.get_ident())
        raise OSError("the worker's socket is gone")

    with caplog.at_level("ERROR"):
        assert pool.start(failing_sender, "sender of worker 2").wait(5)
    assert "sender of worker 2 failed" in caplog.text and "socket is gone" in caplog.text
    assert pool.run(threading.get_ident, 5, "a bounded step") == senders[0] == senders[1]


def test_each_call_gets_a_fresh_context_and_an_idle_thread_says_it_is_idle():
    """As on a fresh thread per call: no context variable set by one call reaches the next,
    and a stack dump of a later hang does not show an idle helper under an old step's name."""
    import contextvars

    pool = HelperThreads()
    seen = contextvars.ContextVar("seen", default="unset")

    def first_call():
        seen.set("left by the first call")
        return threading.get_ident()

    first = pool.run(first_call, 5, "first step")
    second = pool.run(lambda: (seen.get(), threading.get_ident()), 5, "second step")
    assert second == ("unset", first)  # the same thread, a fresh context
    idle = [t.name for t in threading.enumerate() if t.name.startswith("megatron-async-helper")]
    assert "megatron-async-helper (idle)" in idle
