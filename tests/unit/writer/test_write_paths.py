"""write_with_threads: write_timeout_s bounds the whole write, counted from its start."""

import threading

from megatron_async.writer import write_paths
from megatron_async.buckets.layout import WriteBucket
from megatron_async.writer.results import WriteOutcome


def test_the_write_timeout_counts_from_the_start_not_from_the_last_bucket(monkeypatch):
    # The calling thread writes the last bucket; here it "takes" 10 s of a fake clock, so
    # a 5 s bound has passed once it is done: the first bucket's thread gets no more time.
    clock, joins, release = [0.0], [], threading.Event()
    monkeypatch.setattr(write_paths.time, "monotonic", lambda: clock[0])

    class RecordingThread(threading.Thread):
        def join(self, timeout=None):
            joins.append(timeout)
            super().join(0.0)

    monkeypatch.setattr(write_paths.threading, "Thread", RecordingThread)

    def write_one(idx, bucket):
        if idx == 0:
            release.wait(30)  # still running when the last bucket is done
        else:
            clock[0] += 10.0
        return []

    buckets = [WriteBucket(f"/unused/{i}", f"{i}.distcp", ([], [])) for i in range(2)]
    outcome = WriteOutcome(rank=0)
    try:
        write_paths.write_with_threads(write_one, 5.0, buckets, outcome)
    finally:
        release.set()
    assert joins == [0.0]  # the bound had passed (it was 5 s more from the last bucket's end)
    assert sorted(outcome.failures) == [0] and sorted(outcome.results) == [1]
    assert outcome.failures[0].phase == "timeout"
    assert "0.distcp did not finish within 5s" in outcome.failures[0].message
