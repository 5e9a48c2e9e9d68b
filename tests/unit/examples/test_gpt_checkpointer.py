"""The GPT example's checkpointing behaves as Megatron-LM's does for its flags.

The cases run the example's own ``Checkpointer`` in one fresh one-rank process (the
example patches torch for CPU training, which must not leak into other tests).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_validation_count_script.py")


CONSTANT_STRUCTURE = {
    "sync": ["--ckpt-assume-constant-structure"],
    "async-persistent": ["--async-save", "--use-persistent-ckpt-worker",
                         "--ckpt-assume-constant-structure"],
}
EVERY_SAVE = {
    "sync": [],
    "async-temporal": ["--async-save"],
    "async-staging-in-rounds": ["--async-save", "--ckpt-staging-memory-limit", "256K"],
}
CASES = {**{f"constant-{k}": v for k, v in CONSTANT_STRUCTURE.items()},
         **{f"every-{k}": v for k, v in EVERY_SAVE.items()}}


@pytest.fixture(scope="module")
def validated_saves():
    """``{case: which of three saves had megatron-core validate the sharding}``, all cases
    run in one fresh process; each save must be complete."""
    proc = subprocess.run([sys.executable, str(SCRIPT), json.dumps(list(CASES.values()))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = dict(zip(CASES, json.loads(proc.stdout.strip().splitlines()[-1])))
    for case, result in results.items():
        assert result["complete"] == [True, True, True], (case, result)
    return {case: result["validated"] for case, result in results.items()}


@pytest.mark.timeout(330)
@pytest.mark.parametrize("case", sorted(CONSTANT_STRUCTURE))
def test_constant_structure_validates_the_sharding_on_the_first_save_only(validated_saves, case):
    # Megatron-LM's --ckpt-assume-constant-structure: megatron-core's sharding validation
    # (an all-gather of every rank's shards) runs once, not on every warm save.
    assert validated_saves[f"constant-{case}"] == [True, False, False]


@pytest.mark.timeout(330)
@pytest.mark.parametrize("case", sorted(EVERY_SAVE))
def test_without_constant_structure_every_save_validates_the_sharding(validated_saves, case):
    assert validated_saves[f"every-{case}"] == [True, True, True]


def test_staging_memory_limit_flag_takes_sizes_and_fractions():
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
    from gpt.arguments import _staging_limit

    assert _staging_limit("256K") == 256 * 2**10
    assert _staging_limit("1.5GiB") == int(1.5 * 2**30)
    assert _staging_limit("1000") == 1000
    assert _staging_limit("0.1") == 0.1
    with pytest.raises(Exception, match="give bytes"):
        _staging_limit("lots")
