"""The benchmarks' DCP method: where torch cannot reuse a ``DefaultStager``, one per save."""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tools.bench.methods import dcp as dcp_method


class _OneTensor:
    def __init__(self):
        self.tensor = torch.arange(64, dtype=torch.float32)

    def dcp_state_dict(self):
        return {"weights": self.tensor}


def test_a_stager_that_cannot_be_reused_is_rebuilt_for_every_save(tmp_path, monkeypatch):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dcp_method, "default_stager_survives_reuse", lambda: False)
        source = _OneTensor()
        method = dcp_method.DcpSave("dcp_thread", source, dcp_method.DcpOptions(
            executor="thread", thread_count=1, reuse_stager=True))
        method.setup()
        stagers = []
        for index in range(3):
            source.tensor.add_(1.0)
            expected = source.tensor.clone()
            method.save(str(tmp_path / f"save{index}"), index)
            stagers.append(method._stager)
            method.wait()
            loaded = {"weights": torch.zeros(64)}
            dcp.load(loaded, checkpoint_id=str(tmp_path / f"save{index}"))
            assert torch.equal(loaded["weights"], expected)
        assert len({id(s) for s in stagers}) == 3
        assert any("a new DefaultStager per save" in note for note in method.notes)
        method.close()
    finally:
        dist.destroy_process_group()
