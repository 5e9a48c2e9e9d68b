"""The GPT example's own ``Checkpointer`` as a save method (every rank).

Sync, or async with our callers, as ``examples/pretrain_gpt.py`` runs it with the flags
of :data:`~..config.EXAMPLE_FLAGS`: its queue is created before the model
(:meth:`ExampleCheckpointerSave.start_early`, as the example and Megatron-LM do), and it
saves the trainer's model and optimizer under the example's ``--save`` folder, named by
iteration (the ``directory`` a loop passes is not used); with ``local``, a local checkpoint
(``--non-persistent-ckpt-type local``) under ``--non-persistent-local-ckpt-dir`` instead.
"""

from __future__ import annotations

from ..gpt_example import ExampleTrainer
from .base import SaveMethod, now

__all__ = ["ExampleCheckpointerSave"]


class ExampleCheckpointerSave(SaveMethod):
    """The example's ``Checkpointer`` on the example's queue."""

    def __init__(self, name: str, trainer: ExampleTrainer, local: bool = False):
        super().__init__(name)
        self._trainer = trainer
        self._local = local
        self._pending = False
        self._queue = None
        self._checkpointer = None

    def start_early(self) -> None:
        from gpt.save_strategy import create_checkpoint_queue

        self._queue = create_checkpoint_queue(self._trainer.args)

    def setup(self) -> None:
        from gpt.checkpointing import Checkpointer

        trainer = self._trainer
        self._checkpointer = Checkpointer(trainer.args, trainer.model, trainer.optimizer,
                                          self._queue)

    def save(self, directory: str, index: int) -> None:
        trainer = self._trainer
        t0 = self._begin()
        record = self._checkpointer.save(trainer.iteration, trainer.consumed, local=self._local)
        self._pending = record.is_async
        t2 = now()
        self.timings.update(build_s=0.0, t_start=t0, t_stall_end=t2)
        if not self._pending:
            self.timings["t_end"] = t2

    def poll(self) -> bool:
        if self._pending and self._checkpointer.maybe_finalize(blocking=False):
            self._pending = False
            self.timings["t_end"] = now()
        return not self._pending

    def wait(self) -> None:
        self._checkpointer.maybe_finalize(blocking=True)
        if self._pending:
            self.timings["t_end"] = now()
        self._pending = False

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
        elif self._queue is not None:  # set-up never ran: the early queue is closed alone
            self._queue.close()
