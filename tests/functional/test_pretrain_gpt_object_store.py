"""examples/pretrain_gpt.py with ``--save``/``--load`` on object storage (``msc://``).

The store is moto's S3 server on 127.0.0.1 (tests/object_store.py), started for this
module and stopped afterwards; the job gets the MSC profile through ``--msc-config``.
Same shape as test_pretrain_gpt.py's exact-resume test: a straight run of 2N iterations
saving at N and 2N, then a new job resuming from N, whose losses must be bit-identical.
"""

from __future__ import annotations

import pytest

from megatron_async import cli
from megatron_async.checkpoint_dirs import list_checkpoints, read_tracker
from tests.functional.test_pretrain_gpt import LAUNCH_TIMEOUT_S, N, events, losses, run_pretrain
from tests.object_store import LoopbackS3Server, object_store_skip_reason, s3_client, write_msc_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(object_store_skip_reason() is not None, reason=str(object_store_skip_reason())),
]

BUCKET = "gpt"


@pytest.fixture(scope="module")
def msc_config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_store")
    server = LoopbackS3Server(str(tmp / "moto.log")).start()
    try:
        s3_client(server.endpoint).create_bucket(Bucket=BUCKET)
        yield write_msc_config(str(tmp / "msc.json"), {"store": {"endpoint": server.endpoint, "bucket": BUCKET}})
    finally:
        server.stop()


CASES = {
    # One job shape: both callers' uploads run end to end in scenarios_object_store.py.
    "async-persistent-tp2-distopt": ["--async-save", "--use-persistent-ckpt-worker",
                                     "--tensor-model-parallel-size", "2",
                                     "--use-distributed-optimizer"],
}


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_from_object_storage_reproduces_the_losses(tmp_path, msc_config, monkeypatch, case):
    """Save to ``msc://store/<case>/a`` at N and 2N; a new job resumes from N there (its
    checksums verified first) and saves to ``.../b``: the resumed losses equal the
    uninterrupted run's, and the tracker and listing of the store are right."""
    monkeypatch.setenv("MSC_CONFIG", msc_config)  # this process reads the store too
    flags = [*CASES[case], "--msc-config", msc_config, "--train-iters", str(2 * N),
             "--save-interval", str(N)]
    first, second = f"msc://store/{case}/a", f"msc://store/{case}/b"
    straight = run_pretrain([*flags, "--save", first], tmp_path / "straight.jsonl")
    assert [e["iteration"] for e in events(straight, "save")] == [N, 2 * N]
    assert all(e["path"].startswith(first) and e["num_bytes"] > 0 for e in events(straight, "save"))
    assert read_tracker(first) == 2 * N
    assert [(c.iteration, c.complete) for c in list_checkpoints(first)] == [(N, True), (2 * N, True)]

    resumed = run_pretrain(
        [*flags, "--load", first, "--ckpt-step", str(N), "--ckpt-verify-on-load", "--save", second],
        tmp_path / "resumed.jsonl",
    )
    assert [e["iteration"] for e in events(resumed, "resume")] == [N]
    assert events(resumed, "resume")[0]["path"] == f"{first}/iter_{N:07d}"
    expected = {i: loss for i, loss in losses(straight).items() if i > N}
    assert losses(resumed) == expected
    assert read_tracker(second) == 2 * N
    assert cli.main(["verify", f"{second}/iter_{2 * N:07d}"]) == 0
