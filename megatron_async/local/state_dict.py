"""State dicts that know their tensors: the interface a local checkpoint saves through.

Runs on every rank, in the training process: the manager stages a state dict with
:meth:`TensorAwareStateDict.copy_tensors_to_cpu` before it hands the save to the
background writer, and a recovery moves the loaded tensors back with
:meth:`TensorAwareStateDict.restore_tensor_device`.

* :class:`TensorAwareStateDict` is the abstract base that megatron-core's
  ``MCoreTensorAwareStateDict`` (a dataclass) derives from when this module is served as
  ``nvidia_resiliency_ext.checkpointing.local.base_state_dict``. Its abstract set is
  exactly the seven members megatron-core implements; one more would make megatron-core's
  class impossible to instantiate.
* :class:`BasicTensorAwareStateDict` wraps a plain nested dict or list whose leaves may
  be CPU or CUDA tensors, and restores each tensor to the device it was recorded on.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence

import torch

from megatron_async.errors import CheckpointValidationError

__all__ = [
    "TensorAwareStateDict",
    "BasicTensorAwareStateDict",
    "TensorPlaceholder",
    "nested_values",
    "dict_list_map_inplace",
]

Nested = Any
"""Nested dicts and lists (or, at the bottom, a leaf)."""


class TensorAwareStateDict(abc.ABC):
    """A state dict whose tensors can be taken out, put back and moved as one sequence.

    The tensors come and go in one fixed order (the order of :attr:`tensors`), so a
    caller can ship the rest of the state dict (small, pickled) apart from the tensor
    data and put the two together again. A state dict whose tensors were taken out is
    *hollow*. The class defines no ``__init__`` and no fields, so a dataclass may derive
    from it.
    """

    @abc.abstractmethod
    def pop_tensors(self) -> Sequence[torch.Tensor]:
        """Take the tensors out, leaving placeholders that describe them; the state dict is
        hollow afterwards."""

    @property
    @abc.abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensors, in the order :meth:`pop_tensors` returns them (not hollow only)."""

    @property
    @abc.abstractmethod
    def is_hollow(self) -> bool:
        """Whether the tensors were taken out and not put back."""

    @abc.abstractmethod
    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put tensors back where :meth:`pop_tensors` took them from (the inverse)."""

    @abc.abstractmethod
    def init_tensors(self) -> None:
        """Allocate uninitialized tensors as the placeholders describe; no longer hollow."""

    @abc.abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by CPU copies, remembering where each came from."""

    @abc.abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move every tensor back to the device remembered by :meth:`copy_tensors_to_cpu`."""

    def values(self) -> Iterable[Any]:
        """The instance's attribute values (``vars(self).values()``)."""
        return vars(self).values()


def nested_values(x: Nested) -> Iterator[Any]:
    """Yield the leaves of nested dicts and lists, depth first, in insertion order."""
    if isinstance(x, dict):
        for value in x.values():
            yield from nested_values(value)
    elif isinstance(x, list):
        for value in x:
            yield from nested_values(value)
    else:
        yield x


def dict_list_map_inplace(f: Callable[[Any], Any], x: Nested) -> Nested:
    """Replace every leaf of nested dicts and lists by ``f(leaf)``, in place.

    Returns:
        ``x`` itself, or ``f(x)`` when ``x`` is a leaf.
    """
    if isinstance(x, dict):
        for key, value in x.items():
            x[key] = dict_list_map_inplace(f, value)
    elif isinstance(x, list):
        for index, value in enumerate(x):
            x[index] = dict_list_map_inplace(f, value)
    else:
        return f(x)
    return x


class TensorPlaceholder:
    """What a taken-out tensor was: its shape, dtype and device, without its data."""

    def __init__(self, tensor: torch.Tensor):
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.device = tensor.device

    def init_tensor(self) -> torch.Tensor:
        """An uninitialized tensor of the recorded shape, dtype and device."""
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def __repr__(self) -> str:
        return f"TensorPlaceholder(shape={self.shape}, dtype={self.dtype}, device={self.device})"


class BasicTensorAwareStateDict(TensorAwareStateDict):
    """A :class:`TensorAwareStateDict` over plain nested dicts and lists (every rank).

    Every ``torch.Tensor`` leaf counts, on the CPU or a GPU; other leaves are kept as
    they are. :meth:`copy_tensors_to_cpu` records each tensor's device (``cuda:1``, not
    just ``cuda``) and :meth:`restore_tensor_device` moves it back there, also after the
    state dict was hollowed, pickled and filled again.

    Args:
        state_dict: the nested dicts and lists; it is wrapped, not copied, and stays
            available as :attr:`state_dict`.
    """

    def __init__(self, state_dict: Nested):
        if not isinstance(state_dict, (dict, list)):
            raise CheckpointValidationError(
                f"BasicTensorAwareStateDict wraps a dict or a list, not {type(state_dict).__name__}"
            )
        self.state_dict = state_dict
        self._is_hollow = False
        self._origins: Optional[List[torch.device]] = None

    # -- the tensors -------------------------------------------------------------------

    @property
    def tensors(self) -> List[torch.Tensor]:
        self._require_hollow(False, "read the tensors of")
        return [v for v in nested_values(self.state_dict) if isinstance(v, torch.Tensor)]

    @property
    def is_hollow(self) -> bool:
        return self._is_hollow

    def pop_tensors(self) -> List[torch.Tensor]:
        self._require_hollow(False, "pop the tensors of")
        popped: List[torch.Tensor] = []

        def take(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            popped.append(leaf)
            return TensorPlaceholder(leaf)

        dict_list_map_inplace(take, self.state_dict)
        self._is_hollow = True
        return popped

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        self._require_hollow(True, "insert tensors into")
        tensors = list(tensor_data)
        slots = sum(isinstance(v, TensorPlaceholder) for v in nested_values(self.state_dict))
        if len(tensors) != slots:
            raise CheckpointValidationError(
                f"insert_tensors got {len(tensors)} tensor(s) for {slots} placeholder(s); "
                "pass exactly the tensors pop_tensors returned, in the same order"
            )
        given = iter(tensors)
        self._fill(lambda placeholder: next(given))

    def init_tensors(self) -> None:
        self._require_hollow(True, "initialize the tensors of")
        self._fill(TensorPlaceholder.init_tensor)

    # -- devices -----------------------------------------------------------------------

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace every tensor by a CPU copy (a clone for CPU tensors too, so later changes
        by the training loop do not reach the copy); a second call copies nothing."""
        self._require_hollow(False, "copy the tensors of")
        if self._origins is not None:
            return
        origins: List[torch.device] = []

        def copy(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            origins.append(leaf.device)
            if leaf.device.type == "cpu":
                return leaf.detach().clone()
            return leaf.detach().to("cpu", non_blocking=non_blocking)

        dict_list_map_inplace(copy, self.state_dict)
        self._origins = origins

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move every tensor to the device it had before :meth:`copy_tensors_to_cpu`
        (nothing to do without that call)."""
        self._require_hollow(False, "restore the devices of")
        if self._origins is None:
            return
        origins = iter(self._origins)

        def restore(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            return leaf.to(next(origins), non_blocking=non_blocking)

        dict_list_map_inplace(restore, self.state_dict)
        self._origins = None

    # -- helpers -----------------------------------------------------------------------

    def _fill(self, make: Callable[[TensorPlaceholder], torch.Tensor]) -> None:
        dict_list_map_inplace(
            lambda leaf: make(leaf) if isinstance(leaf, TensorPlaceholder) else leaf,
            self.state_dict,
        )
        self._is_hollow = False

    def _require_hollow(self, hollow: bool, action: str) -> None:
        if self._is_hollow != hollow:
            state = "hollow (its tensors were popped)" if self._is_hollow else "not hollow"
            raise CheckpointValidationError(f"cannot {action} a state dict that is {state}")
