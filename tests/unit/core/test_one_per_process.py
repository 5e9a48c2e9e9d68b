"""One instance per process (megatron_async.core.one_per_process): the staging budget and
the directories being written are the parent's in a forked writer; thread pools are new."""

import os
import time

import pytest

from megatron_async.core.one_per_process import OnePerProcess

pytestmark = pytest.mark.timeout(60)


class _Record(OnePerProcess):
    pass


class _Pool(OnePerProcess):
    fresh_in_forked_child = True


def _in_child(check) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if check() else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    return -9


def test_each_class_has_its_own_instance():
    record, pool = _Record.of_process(), _Pool.of_process()
    assert _Record.of_process() is record and _Pool.of_process() is pool
    assert not isinstance(pool, _Record)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_keeps_the_parents_record_and_gets_a_new_pool():
    record, pool = _Record.of_process(), _Pool.of_process()
    assert _in_child(lambda: _Record.of_process() is record) == 0
    assert _in_child(lambda: _Pool.of_process() is not pool) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_child_forked_while_the_lock_was_held_can_still_ask():
    with _Pool._process_lock:  # as if another thread were creating the instance
        code = _in_child(lambda: _Pool.of_process() is not None)
    assert code == 0
