"""The GPT example's local checkpoint flags: Megatron-LM's names, defaults and checks."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO / "examples") not in sys.path:
    sys.path.insert(0, str(REPO / "examples"))

from gpt.arguments import parse_args, validate_parallel_args  # noqa: E402

LOCAL = ["--train-iters", "4", "--save", "/tmp/p", "--save-interval", "4",
         "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/tmp/l"]

REFUSED = {
    "global type": (["--train-iters", "4", "--non-persistent-ckpt-type", "global"],
                    "--non-persistent-ckpt-type global is not implemented"),
    "local without dir": (["--train-iters", "4", "--non-persistent-ckpt-type", "local"],
                          "needs --non-persistent-local-ckpt-dir"),
    "interval without type": (["--train-iters", "4", "--save", "/tmp/p", "--save-interval", "4",
                               "--non-persistent-save-interval", "2"],
                              "needs --non-persistent-ckpt-type local"),
    "interval without save": (["--train-iters", "4", "--non-persistent-save-interval", "2",
                               "--non-persistent-ckpt-type", "local",
                               "--non-persistent-local-ckpt-dir", "/tmp/l"],
                              "--non-persistent-save-interval needs --save"),
    "replication without jump": ([*LOCAL, "--replication"], "--replication needs --replication-jump"),
    "replication without local": (["--train-iters", "4", "--replication", "--replication-jump", "2"],
                                  "--replication needs --non-persistent-ckpt-type local"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_inconsistent_flags_are_refused_with_the_rule(case, capsys):
    argv, message = REFUSED[case]
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_defaults_are_megatron_lms():
    args = parse_args([*LOCAL, "--non-persistent-save-interval", "2"])
    assert args.non_persistent_local_ckpt_algo == "fully_parallel"
    assert args.replication_factor == 2 and not args.replication


def test_a_jump_without_replication_is_dropped_with_a_warning():
    with pytest.warns(UserWarning, match="--replication-jump was given without --replication"):
        args = parse_args([*LOCAL, "--replication-jump", "2"])
    assert args.replication_jump is None


def test_the_world_size_must_split_into_cliques():
    argv = [*LOCAL, "--replication", "--replication-jump", "2", "--replication-factor", "2"]
    validate_parallel_args(parse_args(argv), 8)
    with pytest.raises(SystemExit, match="not divisible by --replication-jump 2 x --replication-factor 2"):
        validate_parallel_args(parse_args(argv), 6)
