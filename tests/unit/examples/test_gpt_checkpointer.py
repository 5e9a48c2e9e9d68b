"""The GPT example's checkpointing behaves as Megatron-LM's does for its flags.

Each case runs the example's own ``Checkpointer`` in a fresh one-rank process (the
example patches torch for CPU training, which must not leak into other tests).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_validation_count_script.py")


def _validated_saves(*flags):
    """Which of three saves had megatron-core validate the sharding; each must be complete."""
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["complete"] == [True, True, True]
    return result["validated"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flags", [
    ["--ckpt-assume-constant-structure"],
    ["--async-save", "--use-persistent-ckpt-worker", "--ckpt-assume-constant-structure"],
], ids=["sync", "async-persistent"])
def test_constant_structure_validates_the_sharding_on_the_first_save_only(flags):
    # Megatron-LM's --ckpt-assume-constant-structure: megatron-core's sharding validation
    # (an all-gather of every rank's shards) runs once, not on every warm save.
    assert _validated_saves(*flags) == [True, False, False]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flags", [
    [], ["--async-save"], ["--async-save", "--ckpt-staging-memory-limit", "256K"],
], ids=["sync", "async-temporal", "async-staging-in-rounds"])
def test_without_constant_structure_every_save_validates_the_sharding(flags):
    assert _validated_saves(*flags) == [True, True, True]


def test_staging_memory_limit_flag_takes_sizes_and_fractions():
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
    from gpt.arguments import _staging_limit

    assert _staging_limit("256K") == 256 * 2**10
    assert _staging_limit("1.5GiB") == int(1.5 * 2**30)
    assert _staging_limit("1000") == 1000
    assert _staging_limit("0.1") == 0.1
    with pytest.raises(Exception, match="give bytes"):
        _staging_limit("lots")
