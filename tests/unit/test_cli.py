"""The inspect / verify / list command line on small single-process checkpoints."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_async import cli
from megatron_async.checkpoint_dirs import write_tracker

pytestmark = pytest.mark.timeout(60)


def _make_checkpoint(path) -> str:
    os.makedirs(path, exist_ok=True)
    state = {"embedding.weight": torch.randn(16, 8), "step": torch.tensor(7, dtype=torch.int64)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    return str(path)


def _data_file(path) -> str:
    return next(os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".distcp"))


def test_inspect_json_reports_tensors_and_completeness(tmp_path, capsys):
    ckpt = _make_checkpoint(tmp_path / "iter_0000042")
    assert cli.main(["inspect", ckpt, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "torch_dist" and report["iteration"] == 42 and report["complete"]
    tensors = {t["name"]: t for t in report["tensors"]}
    assert tensors["embedding.weight"]["global_shape"] == [16, 8]
    assert tensors["embedding.weight"]["num_bytes"] == 16 * 8 * 4
    assert report["total_bytes"] == sum(f["num_bytes"] for f in report["files"])


def test_verify_passes_on_intact_and_fails_on_truncated_file(tmp_path, capsys):
    ckpt = _make_checkpoint(tmp_path / "ckpt")
    assert cli.main(["verify", ckpt]) == 0
    data = _data_file(ckpt)
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    assert cli.main(["verify", ckpt]) == 1
    assert "truncated" in capsys.readouterr().out


def test_verify_fails_without_completion_marker(tmp_path, capsys):
    ckpt = _make_checkpoint(tmp_path / "ckpt")
    os.remove(os.path.join(ckpt, "metadata.json"))
    assert cli.main(["verify", ckpt]) == 1
    assert "metadata.json is missing" in capsys.readouterr().out


def test_list_marks_complete_incomplete_and_tracked(tmp_path, capsys):
    _make_checkpoint(tmp_path / "iter_0000010")
    _make_checkpoint(tmp_path / "iter_0000020")
    os.makedirs(tmp_path / "iter_0000030")  # a save that never finished
    write_tracker(str(tmp_path), 20)
    assert cli.main(["list", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    by_iter = {c["iteration"]: c for c in listing["checkpoints"]}
    assert listing["tracker_iteration"] == 20
    assert by_iter[20]["tracked"] and by_iter[20]["complete"]
    assert by_iter[10]["complete"] and not by_iter[10]["tracked"]
    assert not by_iter[30]["complete"]


def _run_command_line(*args, **popen_kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], stderr=subprocess.PIPE, text=True, timeout=60,
                          **popen_kwargs)


def test_inspect_into_a_closed_pipe_ends_quietly_as_a_unix_tool(tmp_path):
    # ``inspect CKPT | head``: the reader is gone before the command writes. The read end
    # is closed before the child starts, so every write meets a closed pipe.
    ckpt = _make_checkpoint(tmp_path / "iter_0000042")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = _run_command_line("-m", "megatron_async", "inspect", ckpt, stdout=write_end)
    finally:
        os.close(write_end)
    assert proc.returncode == cli.EXIT_CLOSED_PIPE == 128 + signal.SIGPIPE
    assert proc.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored" line


def test_a_broken_connection_is_not_taken_for_a_closed_stdout(tmp_path, monkeypatch):
    def broken_connection(args):
        raise BrokenPipeError("the object store closed the connection")

    monkeypatch.setattr(cli, "_cmd_list", broken_connection)
    with open(tmp_path / "out.txt", "w") as stdout:  # a file: its reader never goes away
        monkeypatch.setattr(sys, "stdout", stdout)
        with pytest.raises(BrokenPipeError, match="object store"):
            cli.main(["list", str(tmp_path)])
