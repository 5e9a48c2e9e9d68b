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
@pytest.mark.parametrize("flags", [[], ["--async-save"]], ids=["sync", "async-temporal"])
def test_without_constant_structure_every_save_validates_the_sharding(flags):
    assert _validated_saves(*flags) == [True, True, True]
