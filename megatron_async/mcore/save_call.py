"""megatron-core's ``dist_checkpointing.save``, as our strategy sees it (every rank).

``save()`` runs steps before it calls the sharded strategy, and hands them neither the
strategy nor its options: rank 0 lists the checkpoint directory (every generation),
megatron-core validates the sharding (rank 0 raises what it finds), and up to 0.18 rank
0 writes ``common.pt``. A failure there is raised on one rank, while the others walk on
into the strategy's first collective and wait for it until the coordination timeout: a
user sees only a timeout, or a broken connection, on every rank but one.

:func:`guard_save_functions` wraps ``save()`` so that those steps know the call
(:class:`SaveCall`, in a context variable for the call's duration; no stack frames are
read). With our strategy, rank 0 creates a missing local directory before megatron-core
lists it (:func:`_create_on_coordinator`), megatron-core's sharding validation is agreed
on every rank (:func:`_agree_on_validation`), and a rank whose ``save()`` fails before
any agreed step joins the strategy's first collective with its error
(:func:`~megatron_async.mcore.plan_cache.fail_first_collective`), so every rank raises
the same error naming that rank's cause, at once. That last one only where our strategy
is ``save()``'s own argument: a wrapper such as megatron-core's fully parallel one runs
collectives of its own first.

It also guards megatron-core's ``common.pt`` write (0.16-0.18), which comes before the
sharded strategy, so a strategy alone comes too late: a second save into a directory an
async save is still writing would replace that save's ``common.pt``, and overwriting a
complete checkpoint would put a new ``common.pt`` next to the old completion markers (a
crash right then leaves a mixed checkpoint that looks complete). What the guard refuses,
and how its failures reach every rank, is in docs/design.md ("Overwriting a complete
checkpoint"). Where that write is (:func:`~megatron_async.mcore.generation.common_writes`)
is generation glue.

Last, ``save(..., async_sharded_save=True)`` appends finalize steps to the request that
run rank 0's part and then wait in a barrier on the *default* process group:
``metadata.json`` and, with ``verify_integrity=True`` (0.18+), a SHA-256 manifest. A
failure on rank 0 would leave the other ranks in that barrier until the default group's
timeout (10-30 minutes), where a training collective of rank 0 may even pair with it.
Each is replaced by one that runs rank 0's part bounded and agrees on the outcome over
the gloo coordination group (:func:`write_megatron_config`,
:func:`write_integrity_manifest`). Our requests carry a :class:`FinalizeFnList`, which
swaps a step as megatron-core appends it (so the swap holds on megatron-core's own queue
too); requests that megatron-core's stock strategy built get the same swap when our
queue schedules them (:data:`~megatron_async.core.request.finalize_step_adapter`).
Both steps are recognized by where megatron-core defines them (``save``'s local
functions).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib
import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

from megatron_async.core import coordination
from megatron_async.core.coordination import agreed_step
from megatron_async.core import request
from megatron_async.core.save_directories import SaveDirectories
from megatron_async.format import MEGATRON_METADATA_FILE
from megatron_async.mcore import generation
from megatron_async.mcore.plan_cache import fail_first_collective
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.mcore.target import check_save_target, unmark_or_refuse
from megatron_async.storage.backend import normalize_checkpoint_path, storage_for

__all__ = [
    "SaveCall",
    "current_save_call",
    "guard_save_functions",
    "FinalizeFnList",
    "write_megatron_config",
    "write_integrity_manifest",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SaveCall:
    """One megatron-core ``save()`` call (every rank).

    Attributes:
        config: our strategy's options, or None for another strategy.
        direct: our strategy is ``save()``'s argument itself, not wrapped.
        agreed: this rank reached a step whose failures every rank agrees on (our
            strategy's target check, or the agreed sharding validation).
        failure: rank 0's ``common.pt`` step failed for our strategy: its agreed target
            check raises this on every rank.
    """

    config: Optional[TorchDistSaveConfig]
    direct: bool = False
    agreed: bool = False
    failure: Optional[BaseException] = None


_save_call: contextvars.ContextVar[Optional[SaveCall]] = contextvars.ContextVar(
    "megatron_async_save_call", default=None
)


def current_save_call() -> Optional[SaveCall]:
    """The ``save()`` call this code runs in (every rank), or None."""
    return _save_call.get()


def guard_save_functions() -> None:
    """Wrap megatron-core's ``dist_checkpointing.save`` under both its import paths, and its
    ``common.pt`` write where it has one (every generation; idempotent; see the module
    docstring)."""
    for path in ("megatron.core.dist_checkpointing.serialization", "megatron.core.dist_checkpointing"):
        _wrap_once(importlib.import_module(path), "save", _record_save_call)  # each its own reference
    preprocessing = importlib.import_module("megatron.core.dist_checkpointing.state_dict_utils")
    if callable(getattr(preprocessing, "validate_sharding_integrity", None)):
        _wrap_once(preprocessing, "validate_sharding_integrity", _agree_on_validation)
    for owner in generation.common_writes():
        _wrap_once(owner, "save_common", _guard_common_write)


def _wrap_once(owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.<name>`` with ``wrap(original)``, unless it is wrapped already."""
    original = getattr(owner, name)
    if getattr(original, "__megatron_async_guarded__", False):
        return
    wrapped = functools.wraps(original)(wrap(original))
    wrapped.__megatron_async_guarded__ = True
    setattr(owner, name, wrapped)


def _agree_on_validation(original: Callable[..., Any]) -> Callable[..., Any]:
    """Make megatron-core's sharding validation in ``save()`` (``validate_sharding_integrity``,
    whose verdict rank 0 alone raises) agreed on every rank within our strategy's saves
    (one all-reduce, only for a save that validates: Megatron-LM's first save with
    ``--ckpt-assume-constant-structure``), also under the fully parallel wrapper."""

    def agreed_validation(*args, **kwargs):
        call = current_save_call()
        if call is None or call.config is None:  # another strategy: as megatron-core
            return original(*args, **kwargs)
        call.agreed = True
        agreed_step("megatron-core's sharding validation", lambda: original(*args, **kwargs))

    return agreed_validation


def _record_save_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap megatron-core's ``save`` so that its steps before the strategy know the call
    (:class:`SaveCall`)."""
    signature = inspect.signature(original)

    def save_with_call_recorded(*args, **kwargs):
        arguments = signature.bind_partial(*args, **kwargs).arguments
        strategy = generation.resolve_strategy(arguments.get("sharded_strategy"))
        call = SaveCall(_our_config(strategy), direct=hasattr(strategy, "directories"))
        checkpoint_dir = arguments.get("checkpoint_dir")
        token = _save_call.set(call)
        try:
            if call.config is not None and checkpoint_dir is not None:
                _create_on_coordinator(checkpoint_dir, call.config, agreed=not call.direct)
            return original(*args, **kwargs)
        except Exception as exc:
            if call.direct and not call.agreed and isinstance(checkpoint_dir, (str, os.PathLike)):
                fail_first_collective(exc, normalize_checkpoint_path(checkpoint_dir))
            raise
        finally:
            _save_call.reset(token)

    return save_with_call_recorded


def _create_on_coordinator(
    checkpoint_dir: Union[str, Path], config: TorchDistSaveConfig, agreed: bool
) -> None:
    """Rank 0: create a missing local checkpoint directory before megatron-core's ``save()``
    lists it there (:func:`~megatron_async.mcore.target.check_save_target`, bounded); every
    rank then checks it again in the strategy's agreed target check.

    A failure on rank 0 reaches the other ranks at our strategy's first collective. Under
    a wrapper (megatron-core's fully parallel one), whose own collectives come first, the
    outcome is agreed here instead (``agreed``: every rank, one small all-reduce), so
    that no rank waits in the wrapper's collectives for a rank 0 that already raised.
    """
    directory = normalize_checkpoint_path(checkpoint_dir)

    def create() -> None:
        if coordination.get_rank() == 0:  # a process whose saves are stopped, ...: raised as it is
            SaveDirectories.of_process().run_bounded(
                f"creating {directory}", lambda: check_save_target(directory, config, is_coordinator=False)
            )

    if agreed:
        agreed_step("creating the checkpoint directory", create)
    else:
        create()


def _our_config(strategy: Any) -> Optional[TorchDistSaveConfig]:
    """The options of our strategy, or of the one a fully parallel wrapper holds; None
    for another strategy."""
    while strategy is not None and not hasattr(strategy, "directories"):
        strategy = getattr(strategy, "base_strategy", None)
    config = getattr(strategy, "config", None)
    return config if isinstance(config, TorchDistSaveConfig) else None


def _guard_common_write(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap megatron-core's ``common.pt`` write (``save_common``: a function of a module,
    or a method of a class) so that it runs behind the checks against the process's
    record (every rank).

    The wrapper raises CheckpointInProgressError when an unfinalized async save of this
    process still writes the directory (every rank alike; nothing was written), or, with
    another strategy, when the process's saves stopped (rank 0).
    """
    signature = inspect.signature(original)

    def guarded_save_common(*args, **kwargs):
        checkpoint_dir = signature.bind_partial(*args, **kwargs).arguments["checkpoint_dir"]
        write = functools.partial(original, *args, **kwargs)
        call = current_save_call()
        ours = call is not None and call.config is not None
        directories = SaveDirectories.of_process()
        directory = normalize_checkpoint_path(checkpoint_dir)
        directories.refuse_if_claimed(directory)
        if coordination.get_rank() != 0:  # megatron-core writes on rank 0 only
            return write()
        if ours and directories.stuck is not None:  # our strategy's agreed check refuses the save
            logger.warning("leaving common.pt of %s untouched: %s", checkpoint_dir, directories.stuck)
            return None
        directories.refuse_if_stuck()
        try:
            directories.run_bounded(
                f"unmarking {directory}",
                lambda: unmark_or_refuse(
                    directory, call.config.overwrite if ours else None, storage_for(directory)
                ),
            )
            return directories.run_bounded(f"writing common.pt of {directory}", write)
        except Exception as exc:
            if not ours:
                raise  # another strategy: as megatron-core would
            logger.error(
                "rank 0: leaving common.pt of %s for the save to fail on every rank: %s", checkpoint_dir, exc
            )
            call.failure = exc
            return None

    return guarded_save_common


_SAVE_MODULE = "megatron.core.dist_checkpointing.serialization"
_CONFIG_STEP = "save.<locals>.metadata_finalize_fn"
_MANIFEST_STEP = "save.<locals>.integrity_finalize_fn"


def write_megatron_config(checkpoint_dir: str, backend: str, version: int) -> None:
    """Write megatron-core's ``metadata.json`` on rank 0; raise any failure on every rank."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig

    final_path = os.path.join(checkpoint_dir, MEGATRON_METADATA_FILE)
    config = json.dumps(dataclasses.asdict(CheckpointingConfig(backend, version)))
    coordination.run_on_coordinator(
        "finalize",
        lambda: SaveDirectories.of_process().run_bounded(
            f"writing {final_path}",
            lambda: storage_for(checkpoint_dir).write_atomically(final_path, config),
        ),
        checkpoint_dir,
    )


MANIFEST_STEP_SHARE = 0.9
"""The share of the coordination timeout that megatron-core's manifest step, which reads
and hashes every file, may take on rank 0 (never less than the other steps' half). It
keeps :data:`MANIFEST_STEP_MARGIN_S` for rank 0 to report a step that did not return
before the other ranks, waiting for it, time out themselves."""

MANIFEST_STEP_MARGIN_S = 10.0


def manifest_step_timeout_s() -> float:
    """How long megatron-core's manifest step may take on rank 0 (see :data:`MANIFEST_STEP_SHARE`)."""
    timeout_s = coordination.coordination_timeout_s()
    share_s = min(MANIFEST_STEP_SHARE * timeout_s, timeout_s - MANIFEST_STEP_MARGIN_S)
    return max(share_s, timeout_s / 2)


def write_integrity_manifest(checkpoint_dir: str, write_manifest: Callable[[str], None]) -> None:
    """Run megatron-core's manifest writer on rank 0; raise any failure on every rank."""
    coordination.run_on_coordinator(
        "finalize",
        lambda: SaveDirectories.of_process().run_bounded(
            f"writing the integrity manifest of {checkpoint_dir}",
            lambda: write_manifest(checkpoint_dir),
            timeout_s=manifest_step_timeout_s(),
            hint="it reads and hashes every file of the checkpoint: if the mount is "
            "fine, the checkpoint is too large to hash in time; raise "
            "coordination_timeout_s or save without verify_integrity, then restart the job",
        ),
        checkpoint_dir,
    )


def _replacement_for(fn: Callable[[], None]) -> Optional[Callable[[], None]]:
    """Our equivalent of one of megatron-core's finalize steps, or None for other functions."""
    if getattr(fn, "__module__", None) != _SAVE_MODULE:
        return None
    step = getattr(fn, "__qualname__", None)
    if step not in (_CONFIG_STEP, _MANIFEST_STEP):
        return None
    try:
        captured = inspect.getclosurevars(fn)
        checkpoint_dir = os.fspath(captured.nonlocals["checkpoint_dir"])
        if step == _CONFIG_STEP:
            strategy = captured.nonlocals["sharded_strategy"]
            return functools.partial(
                write_megatron_config, checkpoint_dir, strategy.backend, strategy.version
            )
        write_manifest = captured.globals["save_integrity_manifest"]
        return functools.partial(write_integrity_manifest, checkpoint_dir, write_manifest)
    except (KeyError, AttributeError, TypeError, ValueError) as exc:  # another megatron-core layout
        logger.warning("keeping megatron-core's own finalize step %s (%s)", step, exc)
        return None


request.finalize_step_adapter = _replacement_for


class FinalizeFnList(list):
    """Finalize functions of a request; swaps in the gloo-safe megatron-core steps as
    megatron-core appends them."""

    def append(self, fn: Callable[[], Any]) -> None:
        super().append(_replacement_for(fn) or fn)
