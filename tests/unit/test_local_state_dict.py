"""megatron_async.local.state_dict: the tensor-aware state dict base and the basic one."""

import dataclasses
import importlib
import io
import sys
import types

import pytest
import torch

from megatron_async.errors import CheckpointValidationError
from megatron_async.local import state_dict as tasd_module
from megatron_async.local.state_dict import (
    BasicTensorAwareStateDict,
    TensorAwareStateDict,
    TensorPlaceholder,
    dict_list_map_inplace,
    nested_values,
)

_MCORE_TASD = "megatron.core.dist_checkpointing.tensor_aware_state_dict"
_SERVED_BASE = "nvidia_resiliency_ext.checkpointing.local.base_state_dict"


def _nested():
    return {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": [torch.ones(2, dtype=torch.int64), "text", {"c": torch.zeros(0)}],
        "n": 7,
    }


def _assert_equal(left, right):
    for x, y in zip(nested_values(left), nested_values(right), strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y) and x.dtype == y.dtype and x.device == y.device
        else:
            assert x == y


def test_the_abstract_set_is_the_seven_members_megatron_core_implements():
    assert TensorAwareStateDict.__abstractmethods__ == {
        "pop_tensors", "tensors", "is_hollow", "insert_tensors", "init_tensors",
        "copy_tensors_to_cpu", "restore_tensor_device",
    }
    assert "__init__" not in vars(TensorAwareStateDict)


@dataclasses.dataclass
class _ListStateDict(TensorAwareStateDict):
    """A dataclass over one list of tensors, shaped like megatron-core's (fields, a default,
    the seven members and nothing else)."""

    data: list
    _is_hollow: bool = False

    def pop_tensors(self):
        popped, self.data, self._is_hollow = self.data, [], True
        return popped

    @property
    def tensors(self):
        return iter(self.data)

    @property
    def is_hollow(self):
        return self._is_hollow

    def insert_tensors(self, tensor_data):
        self.data, self._is_hollow = list(tensor_data), False

    def init_tensors(self):
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking=False):
        self.data = [t.cpu() for t in self.data]

    def restore_tensor_device(self, non_blocking=True):
        pass


def test_a_dataclass_implementing_the_seven_members_is_instantiable():
    sd = _ListStateDict(data=[torch.ones(2)])
    sd.insert_tensors(sd.pop_tensors())
    assert not sd.is_hollow and len(list(sd.tensors)) == 1
    assert list(sd.values())[1] is False  # vars(self).values()


def test_megatron_core_tensor_aware_state_dict_derives_from_our_base(monkeypatch):
    mcore = pytest.importorskip("megatron.core.dist_checkpointing.mapping")
    names = ["nvidia_resiliency_ext", "nvidia_resiliency_ext.checkpointing",
             "nvidia_resiliency_ext.checkpointing.local"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, _SERVED_BASE, tasd_module)
    monkeypatch.delitem(sys.modules, _MCORE_TASD, raising=False)
    parent = importlib.import_module("megatron.core.dist_checkpointing")
    monkeypatch.setattr(parent, "tensor_aware_state_dict", None, raising=False)
    fresh = importlib.import_module(_MCORE_TASD)

    assert fresh.HAVE_NVRX and issubclass(fresh.MCoreTensorAwareStateDict, TensorAwareStateDict)
    weight = torch.arange(4.0)
    sharded = {"w": mcore.ShardedTensor.from_rank_offsets("w", weight, replica_id=0)}
    sd = fresh.MCoreTensorAwareStateDict(common={"iteration": 3}, sharded_state_dict=sharded)
    (popped,) = sd.pop_tensors()
    assert sd.is_hollow and popped is weight
    sd.insert_tensors([popped])
    sd.copy_tensors_to_cpu()
    assert next(iter(sd.tensors)) is not weight and torch.equal(next(iter(sd.tensors)), weight)


def test_nested_values_and_map_visit_every_leaf_in_order():
    nested = {"x": [1, {"y": 2}], "z": 3}
    assert list(nested_values(nested)) == [1, 2, 3]
    assert dict_list_map_inplace(lambda v: v * 10, nested) is nested
    assert nested == {"x": [10, {"y": 20}], "z": 30}
    assert dict_list_map_inplace(lambda v: v + 1, 4) == 5


def test_pop_then_insert_gives_the_same_state_dict():
    original = _nested()
    sd = BasicTensorAwareStateDict(_nested())
    tensors = sd.pop_tensors()
    assert sd.is_hollow and len(tensors) == 3
    assert all(not isinstance(v, torch.Tensor) for v in nested_values(sd.state_dict))
    with pytest.raises(CheckpointValidationError, match="hollow"):
        sd.tensors
    sd.insert_tensors(tensors)
    assert not sd.is_hollow
    _assert_equal(sd.state_dict, original)


def test_insert_needs_as_many_tensors_as_were_popped():
    sd = BasicTensorAwareStateDict(_nested())
    tensors = sd.pop_tensors()
    with pytest.raises(CheckpointValidationError, match="2 tensor.*3 placeholder"):
        sd.insert_tensors(tensors[:2])
    with pytest.raises(CheckpointValidationError, match="not hollow"):
        BasicTensorAwareStateDict(_nested()).insert_tensors([])


def test_a_hollow_state_dict_travels_apart_from_its_tensors():
    """The pickled hollow state dict and the tensor data meet again on the other side."""
    sd = BasicTensorAwareStateDict(_nested())
    tensors = sd.pop_tensors()
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    received = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert received.is_hollow
    received.init_tensors()
    for empty, sent in zip(received.tensors, tensors, strict=True):
        assert empty.shape == sent.shape and empty.dtype == sent.dtype
        empty.copy_(sent)
    _assert_equal(received.state_dict, _nested())


def test_cpu_copies_are_snapshots_and_restore_keeps_them_on_the_cpu():
    live = _nested()
    sd = BasicTensorAwareStateDict(dict(live))
    sd.copy_tensors_to_cpu()
    live["a"].add_(100)  # the training loop goes on
    assert torch.equal(sd.state_dict["a"], torch.arange(6.0).reshape(2, 3))
    sd.restore_tensor_device()
    assert sd.state_dict["a"].device.type == "cpu"


def test_placeholder_records_shape_dtype_and_device():
    placeholder = TensorPlaceholder(torch.zeros(2, 5, dtype=torch.bfloat16))
    made = placeholder.init_tensor()
    assert (made.shape, made.dtype, made.device.type) == ((2, 5), torch.bfloat16, "cpu")
    with pytest.raises(CheckpointValidationError, match="dict or a list"):
        BasicTensorAwareStateDict(torch.ones(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tensors_return_to_their_recorded_device_after_a_pickled_round_trip():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    sd = BasicTensorAwareStateDict({"g": torch.arange(3.0, device=device), "c": torch.ones(2)})
    sd.copy_tensors_to_cpu(non_blocking=True)
    torch.cuda.synchronize()
    assert all(t.device.type == "cpu" for t in sd.tensors)
    tensors = sd.pop_tensors()
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    received = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    received.insert_tensors(tensors)
    received.restore_tensor_device(non_blocking=False)
    assert received.state_dict["g"].device == device
    assert received.state_dict["c"].device.type == "cpu"
    assert torch.equal(received.state_dict["g"].cpu(), torch.arange(3.0))
