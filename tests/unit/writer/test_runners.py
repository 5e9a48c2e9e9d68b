"""write_with_threads: write_timeout_s bounds the whole write, counted from its start."""

import time

from megatron_async.writer import runners
from megatron_async.writer.layout import WriteBucket
from megatron_async.writer.results import WriteOutcome


def test_the_write_timeout_counts_from_the_start_not_from_the_last_bucket(monkeypatch):
    # The calling thread writes the last bucket; here it "takes" 10 s of a fake clock, so
    # a 5 s bound has passed once it is done and the first bucket, still running, fails.
    clock = [0.0]
    monkeypatch.setattr(runners.time, "monotonic", lambda: clock[0])

    def write_one(idx, bucket):
        if idx == 0:
            time.sleep(1.0)  # real time: still running when the last bucket is done
        else:
            clock[0] += 10.0
        return []

    buckets = [WriteBucket(f"/unused/{i}", f"{i}.distcp", ([], [])) for i in range(2)]
    outcome = WriteOutcome(rank=0)
    runners.write_with_threads(write_one, 5.0, buckets, outcome)
    assert sorted(outcome.failures) == [0] and sorted(outcome.results) == [1]
    assert outcome.failures[0].phase == "timeout"
    assert "0.distcp did not finish within 5s" in outcome.failures[0].message
