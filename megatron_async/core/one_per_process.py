"""Classes with one instance per process: :class:`OnePerProcess` (any side).

Some state is a fact of the process, not of one save: the threads of ours that run
bounded calls or copies, the staging memory budget shared by every save of a rank, the
directories its saves are writing. Such a class derives from :class:`OnePerProcess`, and
whoever has no owner to receive it from asks :meth:`OnePerProcess.of_process`.

A forked child (a writer, the persistent worker) inherits the parent's instances. Threads
do not survive a fork, so a class whose instance owns threads sets
``fresh_in_forked_child`` and the child gets a new one at its first ask. The lock that
guards creation is replaced in the child, since a parent thread may have held it at the
fork.
"""

from __future__ import annotations

import os
import threading
from typing import Optional, Type, TypeVar

__all__ = ["OnePerProcess"]

Self = TypeVar("Self", bound="OnePerProcess")


class OnePerProcess:
    """Base of a class whose instance for the whole process is :meth:`of_process`."""

    fresh_in_forked_child = False
    """Whether a forked child gets its own instance instead of the parent's (set it for
    instances that own threads)."""

    _process: Optional["OnePerProcess"] = None
    _process_pid = 0
    _process_lock: threading.Lock

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._process = None
        cls._process_lock = threading.Lock()
        os.register_at_fork(after_in_child=cls._new_lock_in_child)

    @classmethod
    def _new_lock_in_child(cls) -> None:
        cls._process_lock = threading.Lock()

    @classmethod
    def of_process(cls: Type[Self]) -> Self:
        """This process's instance (created at the first ask)."""
        with cls._process_lock:
            stale = cls.fresh_in_forked_child and cls._process_pid != os.getpid()
            if cls._process is None or stale:
                cls._process, cls._process_pid = cls(), os.getpid()
            return cls._process
