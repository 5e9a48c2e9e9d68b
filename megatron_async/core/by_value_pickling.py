"""Send what the training script defines to the persistent worker by value.

Pickle sends a function or a class by reference, as ``module.qualname``, for the worker
to import. What the training script defines lives in ``__main__`` (``__mp_main__`` in a
rank started by multiprocessing's spawn), which the worker never runs: a worker started
as a fresh interpreter has none of it, and a forked one has only what the script had
defined when it was forked, as it was then. So, as cloudpickle does (the convention Ray,
Dask and joblib rely on for this), what cannot be found by reference goes by value:

* a function of ``__main__``, a lambda, or a function defined inside a function: its
  code (``marshal``, for the same interpreter), closure, defaults, attributes, and the
  globals its code reads or writes, each in turn by reference or by value. A function
  of ``__main__`` gets a namespace of its own in the worker, shared by everything of
  the same script in one request and holding the values its globals had when the
  request was scheduled (the snapshot a fork would see); one of an importable module
  (a lambda in a library) uses that module's namespace, imported by the worker;
* a class of ``__main__``, or defined inside a function or by ``type()``: its metaclass,
  bases and attributes (methods, class attributes, slots); instances pickle as usual.

Functions and classes are rebuilt in two steps, an empty one first and its contents
after, so that recursion (a function that calls itself, a method whose ``super()``
refers to its class) finds the object already rebuilt. What such functions and classes
commonly hold and pickle cannot reduce is reduced here too: modules (by name),
``classmethod``, ``staticmethod``, ``property``, ``functools.cached_property``,
``mappingproxy``, and the ``dataclasses`` sentinels (by name: that module compares them
by identity). An enum of the script is refused with a clear error.

Runs on every rank when a request is scheduled (:class:`ByValueReducer`, called by the
pickler of :mod:`megatron_async.core.request_transport`); the worker rebuilds what it
sent while it unpickles the request (:mod:`megatron_async.core.by_value_rebuild`).
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import importlib
import marshal
import sys
import types
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

from megatron_async.core.by_value_rebuild import (
    fresh_namespace,
    module_namespace,
    rebuild_cached_property,
    rebuild_class,
    rebuild_function,
    rebuild_mappingproxy,
    restore_class,
    restore_function,
)
from megatron_async.errors import UnpicklableRequestError

__all__ = ["ByValueReducer", "CodeCache", "describe_unpicklable"]

_MAIN_MODULES = frozenset({"__main__", "__mp_main__"})

_GLOBAL_OPS = frozenset(
    {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "STORE_NAME", "DELETE_NAME"}
)
"""Opcodes that name a global (``*_NAME`` in the body of a class defined in a function)."""

_WHAT_TO_DO = (
    "create it inside the routine, or pass the routine a request argument that pickles "
    "instead; or move the routine into an importable module (the worker imports its "
    "globals); or use the temporal caller (AsyncCallsQueue(persistent=False)), which "
    "forks and pickles nothing"
)


def _global_names(code: types.CodeType) -> Set[str]:
    """Names that ``code`` and the code nested in it use as globals.

    Opcodes, not ``co_names``: the latter also holds attribute names, and an attribute
    ``x.queue`` must not send the script's global ``queue``.
    """
    names: Set[str] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        names.update(i.argval for i in dis.get_instructions(current) if i.opname in _GLOBAL_OPS)
        stack.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    return names


class CodeCache:
    """Marshalled code and the globals it uses, per code object (trainer side).

    Owned by one :class:`~megatron_async.core.request_transport.RequestSender` and kept
    across saves: a function's code does not change between saves, so it is analysed
    once. The values of its globals do, and are pickled afresh with every request.
    """

    def __init__(self):
        self._entries: Dict[int, Tuple["weakref.ref[types.CodeType]", bytes, Tuple[str, ...]]] = {}

    def get(self, code: types.CodeType) -> Tuple[bytes, Tuple[str, ...]]:
        """``(marshal.dumps(code), names of the globals it uses)``."""
        key = id(code)
        entry = self._entries.get(key)
        if entry is None or entry[0]() is not code:
            ref = weakref.ref(code, lambda _ref: self._entries.pop(key, None))
            entry = (ref, marshal.dumps(code), tuple(sorted(_global_names(code))))
            self._entries[key] = entry
        return entry[1], entry[2]


def _found_by_reference(obj: Any) -> bool:
    """Whether pickle's by-reference lookup (``module.qualname``) finds ``obj`` itself."""
    found = _importable_module(getattr(obj, "__module__", None))
    if found is None:
        return False
    for part in getattr(obj, "__qualname__", "<unknown>").split("."):
        found = getattr(found, part, None)
        if found is None:
            return False
    return found is obj


def _importable_module(name: Optional[str]) -> Optional[types.ModuleType]:
    """The module the worker finds by ``name`` (None for the training script's)."""
    return None if name in _MAIN_MODULES else sys.modules.get(name)


def _globals_by_reference(func: types.FunctionType) -> bool:
    """Whether ``func``'s globals are an importable module's namespace (not sent)."""
    module = _importable_module(func.__globals__.get("__name__"))
    return module is not None and module.__dict__ is func.__globals__


_HEAP_TYPE_FLAG = 1 << 9
"""``Py_TPFLAGS_HEAPTYPE``: a class created by a class statement or ``type()``, not a
built-in type (``NoneType`` is not found by its name either, and pickle knows it)."""


def _class_by_value(cls: type) -> bool:
    return bool(cls.__flags__ & _HEAP_TYPE_FLAG) and not _found_by_reference(cls)


def _describe(obj: Any) -> str:
    """How an error names a function or class sent by value."""
    kind = "class" if isinstance(obj, type) else "function"
    module = getattr(obj, "__module__", None)
    if module in _MAIN_MODULES:
        return f"{kind} {obj.__qualname__} of the training script ({module})"
    return f"{kind} {obj.__qualname__} (a lambda or a local {kind}) of module {module}"


class _Namespace:
    """Stands for a function's globals in one request: the worker's copy of a module's
    namespace (importable module) or a fresh one (``__main__``)."""

    def __init__(self, name: Optional[str], importable: bool):
        self.name = name
        self.importable = importable

    def __reduce__(self):
        return (module_namespace if self.importable else fresh_namespace), (self.name,)


class ByValueReducer:
    """Reduces what cannot be pickled by reference (trainer side, one per request).

    Args:
        code_cache: the sender's :class:`CodeCache`.
    """

    def __init__(self, code_cache: CodeCache):
        self._code_cache = code_cache
        self._namespaces: Dict[int, _Namespace] = {}  # id(globals dict) -> its stand-in
        self.sent: List[Any] = []
        """The functions and classes sent by value, in order (to explain a failure)."""

    def reduce(self, obj: Any) -> Any:
        """A reduce tuple for ``obj``, or ``NotImplemented`` to pickle it as usual.

        Raises:
            UnpicklableRequestError: an enum class defined in the training script.
        """
        kind = type(obj)
        if kind is types.FunctionType:
            return NotImplemented if _found_by_reference(obj) else self._reduce_function(obj)
        special = _SPECIAL_REDUCERS.get(kind)
        if special is not None:
            return special(obj)
        if isinstance(obj, type):
            return self._reduce_class(obj) if _class_by_value(obj) else NotImplemented
        return NotImplemented

    def _namespace_of(self, func: types.FunctionType) -> _Namespace:
        namespace = self._namespaces.get(id(func.__globals__))
        if namespace is None:
            namespace = _Namespace(func.__globals__.get("__name__"), _globals_by_reference(func))
            self._namespaces[id(func.__globals__)] = namespace
        return namespace

    def _reduce_function(self, func: types.FunctionType):
        code_bytes, names = self._code_cache.get(func.__code__)
        namespace = self._namespace_of(func)
        self.sent.append(func)
        state = {
            "globals": {} if namespace.importable else _used_globals(func, names),
            "closure": dict(_closure_values(func)),
            "defaults": func.__defaults__,
            "kwdefaults": func.__kwdefaults__,
            "dict": func.__dict__,
            "qualname": func.__qualname__,
            "module": func.__module__,
            "doc": func.__doc__,
        }
        args = (code_bytes, namespace, func.__name__, len(func.__closure__ or ()))
        return rebuild_function, args, state, None, None, restore_function

    def _reduce_class(self, cls: type):
        if isinstance(cls, enum.EnumMeta):
            raise UnpicklableRequestError(
                f"the request refers to {_describe(cls)}, an enum, which cannot be rebuilt in "
                "the persistent worker: move it into an importable module, or use the temporal "
                "caller (AsyncCallsQueue(persistent=False))"
            )
        self.sent.append(cls)
        seed = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        if "__slots__" in cls.__dict__:
            seed["__slots__"] = cls.__dict__["__slots__"]
        args = (type(cls), cls.__name__, cls.__bases__, seed)
        return rebuild_class, args, _class_attributes(cls), None, None, restore_class


def _used_globals(func: types.FunctionType, names: Tuple[str, ...]) -> Dict[str, Any]:
    namespace = func.__globals__
    return {name: namespace[name] for name in names if name in namespace}


def _closure_values(func: types.FunctionType) -> Iterator[Tuple[int, Any]]:
    """``(index, value)`` of the function's filled closure cells."""
    for index, cell in enumerate(func.__closure__ or ()):
        try:
            yield index, cell.cell_contents
        except ValueError:  # an empty cell (a variable not assigned yet)
            continue


_SKIPPED_CLASS_ATTRIBUTES = frozenset(
    {"__module__", "__qualname__", "__slots__", "_abc_impl", "__abstractmethods__"}
)
"""Given to the rebuilt class at creation, or recomputed by its metaclass."""


def _class_attributes(cls: type) -> Dict[str, Any]:
    """What a rebuilt class gets after creation: its own attributes, less those the
    class machinery creates (``__dict__`` and slot descriptors, ABC bookkeeping)."""
    return {
        key: value
        for key, value in cls.__dict__.items()
        if key not in _SKIPPED_CLASS_ATTRIBUTES
        and not (
            isinstance(value, (types.MemberDescriptorType, types.GetSetDescriptorType))
            and value.__objclass__ is cls
        )
    }


def _reduce_module(module: types.ModuleType):
    name = module.__name__
    if name in _MAIN_MODULES or sys.modules.get(name) is not module:
        return NotImplemented  # pickle's own error: "cannot pickle 'module' object"
    return importlib.import_module, (name,)


_SPECIAL_REDUCERS: Dict[type, Callable[[Any], Any]] = {
    types.ModuleType: _reduce_module,
    classmethod: lambda method: (classmethod, (method.__func__,)),
    staticmethod: lambda method: (staticmethod, (method.__func__,)),
    property: lambda prop: (property, (prop.fget, prop.fset, prop.fdel, prop.__doc__)),
    functools.cached_property: lambda prop: (
        rebuild_cached_property, (prop.func, prop.attrname, prop.__doc__)
    ),
    types.MappingProxyType: lambda proxy: (rebuild_mappingproxy, (dict(proxy),)),
}
"""Types that a class sent by value commonly holds and pickle cannot reduce itself."""

_DATACLASS_SENTINELS: Dict[int, str] = {
    id(value): name
    for name in ("MISSING", "KW_ONLY", "_HAS_DEFAULT_FACTORY", "_FIELD", "_FIELD_CLASSVAR", "_FIELD_INITVAR")
    for value in [getattr(dataclasses, name, None)]
    if value is not None and not isinstance(value, type)
}
"""Singletons that ``dataclasses`` compares by identity (by ``id``; they live as long as
the process): sent by name, so that a rebuilt dataclass's fields are recognised."""


def _reduce_dataclass_sentinel(obj: Any):
    name = _DATACLASS_SENTINELS.get(id(obj))
    return NotImplemented if name is None else (getattr, (dataclasses, name))


_SPECIAL_REDUCERS.update(
    {type(getattr(dataclasses, name)): _reduce_dataclass_sentinel for name in _DATACLASS_SENTINELS.values()}
)


# -- explaining a failure (trainer side) ------------------------------------------------


def _captured(obj: Any, code_cache: CodeCache) -> Iterator[Tuple[str, Any]]:
    """``(label, value)`` of what a function or class sent by value carries along."""
    if isinstance(obj, type):
        for key, value in _class_attributes(obj).items():
            yield f"attribute {key!r}", value
        return
    code = obj.__code__
    if not _globals_by_reference(obj):
        for name, value in _used_globals(obj, code_cache.get(code)[1]).items():
            yield f"global {name!r}", value
    for index, value in _closure_values(obj):
        yield f"closure variable {code.co_freevars[index]!r}", value
    for value in obj.__defaults__ or ():
        yield "default argument value", value
    for name, value in (obj.__kwdefaults__ or {}).items():
        yield f"default of {name!r}", value
    for name, value in obj.__dict__.items():
        yield f"attribute {name!r}", value


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


class _ProbePickler(ForkingPickler):
    """Pickles into nothing, tensors as placeholders: does a value pickle at all?"""

    def __init__(self, code_cache: CodeCache):
        super().__init__(_Discard(), -1)
        self._by_value = ByValueReducer(code_cache)

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return int, ()
        return self._by_value.reduce(obj)


def describe_unpicklable(reducer: ByValueReducer, code_cache: CodeCache, exc: BaseException) -> str:
    """Say what in a request failed to pickle and what to do (trainer side, after a failure).

    Looks through what went by value, innermost first, for the value that does not
    pickle on its own, so that the message names the routine and its global, closure
    variable, default or attribute rather than only the type pickle complained about.
    """
    for owner in reversed(reducer.sent):
        for label, value in _captured(owner, code_cache):
            try:
                _ProbePickler(code_cache).dump(value)
            except Exception as item_exc:
                return (
                    f"{_describe(owner)} goes to the persistent worker by value, with the "
                    f"globals, closure variables and defaults it uses; its {label} cannot be "
                    f"pickled ({type(item_exc).__name__}: {item_exc}): {_WHAT_TO_DO}"
                )
    return (
        f"the request cannot be pickled for the persistent worker ({type(exc).__name__}: "
        f"{exc}): make async_fn and its arguments picklable, or use the temporal caller "
        "(AsyncCallsQueue(persistent=False)), which forks and pickles nothing"
    )
