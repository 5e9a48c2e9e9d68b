"""Rebuild on the worker what the trainer sent by value (worker side).

The reduce tuples that :class:`~megatron_async.core.by_value_pickling.ByValueReducer`
makes on every rank name these functions; the persistent worker calls them while it
unpickles a request. Functions and classes are rebuilt in two steps, an empty one first
(``rebuild_*``) and its contents after (``restore_*``), so that recursion (a function
that calls itself, a method whose ``super()`` refers to its class) finds the object
already rebuilt.
"""

from __future__ import annotations

import abc
import builtins
import functools
import importlib
import marshal
import types
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = [
    "fresh_namespace",
    "module_namespace",
    "rebuild_cached_property",
    "rebuild_class",
    "rebuild_function",
    "rebuild_mappingproxy",
    "restore_class",
    "restore_function",
]


def fresh_namespace(name: Optional[str]) -> Dict[str, Any]:
    """The worker's namespace for the globals of ``__main__`` functions in one request."""
    return {"__name__": name, "__builtins__": builtins}


def module_namespace(name: str) -> Dict[str, Any]:
    """The worker's namespace of an importable module (imported if need be)."""
    return importlib.import_module(name).__dict__


def rebuild_function(code_bytes: bytes, namespace: Dict[str, Any], name: str, closure_size: int):
    """An empty function: code, namespace and empty closure cells (worker side)."""
    closure = tuple(types.CellType() for _ in range(closure_size)) if closure_size else None
    return types.FunctionType(marshal.loads(code_bytes), namespace, name, None, closure)


def restore_function(func: types.FunctionType, state: Dict[str, Any]) -> None:
    """Fill a function rebuilt by :func:`rebuild_function` (worker side)."""
    func.__globals__.update(state["globals"])
    for index, value in state["closure"].items():
        func.__closure__[index].cell_contents = value
    func.__defaults__ = state["defaults"]
    func.__kwdefaults__ = state["kwdefaults"]
    func.__dict__.update(state["dict"])
    func.__qualname__ = state["qualname"]
    func.__module__ = state["module"]
    func.__doc__ = state["doc"]


def rebuild_class(metaclass: type, name: str, bases: Tuple[type, ...], seed: Dict[str, Any]) -> type:
    """An empty class with the original's metaclass, bases and slots (worker side)."""
    return types.new_class(name, bases, {"metaclass": metaclass}, lambda ns: ns.update(seed))


def restore_class(cls: type, attributes: Dict[str, Any]) -> None:
    """Give a class rebuilt by :func:`rebuild_class` its attributes (worker side)."""
    for key, value in attributes.items():
        setattr(cls, key, value)
    if isinstance(cls, abc.ABCMeta):  # its abstract methods were computed without them
        abc.update_abstractmethods(cls)


def rebuild_cached_property(func: Callable, attrname: Optional[str], doc: Optional[str]):
    """A ``functools.cached_property`` of a class sent by value (worker side)."""
    prop = functools.cached_property(func)
    prop.attrname, prop.__doc__ = attrname, doc
    return prop


def rebuild_mappingproxy(mapping: Dict[Any, Any]) -> types.MappingProxyType:
    """A read-only view of ``mapping`` (worker side)."""
    return types.MappingProxyType(mapping)  # the type is not found by its name, mappingproxy
