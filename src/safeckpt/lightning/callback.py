"""ManagedCheckpoint: a Lightning callback that checkpoints through :class:`~safeckpt.CheckpointManager`.

What it saves: the model (``trainer.strategy.model``, so DDP and FSDP wrappers
give canonical, and under FSDP sharded, state through DCP), every optimizer, and
the trainer's own state (epoch, global step, loops, callbacks, LR schedulers,
precision plugin, datamodule) in the train-state file, without pickle. Each save
is a ``step_<N>`` directory with ``N = trainer.global_step``.

Relation to ``ModelCheckpoint``: both are Lightning ``Checkpoint`` callbacks, so
with this one in ``callbacks`` the Trainer adds no default ``ModelCheckpoint``
(and ``enable_checkpointing=False`` is refused, as for any checkpoint callback).
This one writes no ``.ckpt`` files: it owns the run's resumable checkpoints
(retention, records, registrar, auto-resume). Add a ``ModelCheckpoint`` (with
``SafeCheckpointIO``) only to export ``.ckpt`` files as well.

Call rules: every rank runs the hooks (the manager's calls are collective). The
manager is created in ``setup("fit")`` and closed in ``teardown``/``on_exception``.

Resumed from an epoch-end save, a run ends as the uninterrupted one would have, RNG draws
included. The checkpoint, RNG states too, is restored in ``on_fit_start``; Lightning's data
setup then makes the train data iterator, drawing from the RNGs. From a save at validation
end the loops replay that epoch's end and the next epoch makes an iterator of its own, so
the setup's draws are ones the uninterrupted run never made: ``on_train_start`` sets the
RNGs back to what the restore left. From a save at training-epoch end the next epoch takes
the setup's iterator, made where the uninterrupted run made its own: nothing to undo. A save
at a batch's end (``every_n_train_steps``) resumes as Lightning replays it, which is not
always draw for draw.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn

from .._manager.manager import CheckpointManager
from .._policy.retention import Retention
from .._registration.registrar import Registrar
from .._state.train_state import capture_rng, restore_rng
from .._util import torch_private
from ..errors import ConfigError, UnsupportedStateError

logger = logging.getLogger(__name__)

__all__ = ["ManagedCheckpoint"]

TRAINER_KEY = "lightning"
"""The state entry that holds the trainer's own state (the checkpoint dict minus weights)."""


class _TrainerState:
    """The parts of Lightning's checkpoint dict that are not weights, as one stateful entry."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        state: dict[str, Any] = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "pytorch-lightning_version": pl.__version__,
            "loops": torch_private.loops_state_dict(trainer),
            "callbacks": torch_private.callbacks_state_dict(trainer),
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        }
        precision = trainer.precision_plugin
        precision_state = precision.state_dict()
        if precision_state:
            state[type(precision).__qualname__] = precision_state
        datamodule = getattr(trainer, "datamodule", None)  # a property Lightning's types leave out
        if datamodule is not None:
            datamodule_state = torch_private.datamodule_state_dict(trainer)
            if datamodule_state:
                state[type(datamodule).__qualname__] = datamodule_state
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = dict(state)


class ManagedCheckpoint(Checkpoint):
    """Checkpoint a ``Trainer`` run into ``dirpath`` with safeckpt's layout, and resume from it.

    Args:
        dirpath: the checkpoint root (``step_<N>`` directories, ``latest``, records).
        retention: which checkpoints to keep (a :class:`~safeckpt.Retention`); None
            keeps all. ``Retention(keep_last=1, keep_best=2, metric="val_loss")``
            is ``ModelCheckpoint(save_top_k=2, monitor="val_loss", save_last=True)``.
        every_n_train_steps: also save every N optimizer steps (None: only per epoch).
        every_n_epochs: save at the end of every N-th epoch (after validation when
            it runs, else at the end of the training epoch); 0 or None: never.
        save_on_train_end: save the final state when ``fit`` ends (again if its step was saved
            at validation end: the loops then record the epoch as complete).
        resume: on ``fit`` without ``ckpt_path``, load the newest complete
            checkpoint (``latest``, else the newest that loads), like
            ``ckpt_path="last"`` with a fallback past a broken newest. An
            explicit ``ckpt_path`` wins.
        registrar: told about each commit (rank 0), off the commit path.
        manager_options: passed to :class:`~safeckpt.CheckpointManager`
            (``async_save``, ``queue_depth``, ``drain_timeout``, ``file_ops``...).

    Every scalar in ``trainer.callback_metrics`` goes into the record's metrics,
    so a ``Retention(keep_best=..., metric=...)`` ranks by any logged metric.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        *,
        retention: Retention | Any | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = 1,
        save_on_train_end: bool = True,
        resume: bool = True,
        registrar: Registrar | None = None,
        **manager_options: Any,
    ) -> None:
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"ManagedCheckpoint({name}={value!r}): use a non-negative integer or None.")
        self.dirpath = os.fspath(dirpath)
        self.retention = retention
        self.every_n_train_steps = every_n_train_steps or None
        self.every_n_epochs = every_n_epochs or None
        self.save_on_train_end = save_on_train_end
        self.resume = resume
        self.registrar = registrar
        self.manager_options = manager_options
        self.manager: CheckpointManager | None = None
        self.restored_step: int | None = None
        """The step ``fit`` resumed from (None: it started fresh or from an explicit ``ckpt_path``)."""
        self.saved_steps: list[int] = []
        """Steps this callback handed to the manager during the current ``fit``."""
        self._rng: dict[str, Any] | None = None  # the RNG states a resume left, until on_train_start

    @property
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self.dirpath)

    @property
    def latest_step(self) -> int | None:
        """The newest committed step (rank 0's view), or None."""
        return None if self.manager is None else self.manager.latest_step

    # --- the run's life ----------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.manager is not None:
            return
        options: dict[str, Any] = dict(self.manager_options)
        if self.retention is not None:
            options["retention"] = self.retention
        if self.registrar is not None:
            options["registrar"] = self.registrar
        self.manager = CheckpointManager(self.dirpath, **options)
        self.saved_steps = []
        others = [c for c in trainer.checkpoint_callbacks if c is not self]
        if others and trainer.is_global_zero:
            logger.info(
                "safeckpt: a ModelCheckpoint runs next to ManagedCheckpoint and writes its own .ckpt "
                "files; drop it if you only want %s",
                self.dirpath,
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resume (after the strategy wrapped the model and built the optimizers)."""
        self.restored_step = None
        self._rng = None
        if not self.resume or trainer.ckpt_path is not None or self.manager is None:
            return
        holder = _TrainerState(trainer)
        # Not strict: the trainer's own state may differ in callbacks (one added since the save)
        # and that is fine; the weights and optimizer states must match, as Lightning requires.
        restored = self.manager.restore(self._state(trainer, holder), strict=False)
        rng = capture_rng()  # as the restore left them: the checkpoint's, which it sets last
        mismatch = [
            p
            for p in (*restored.missing, *restored.unexpected)
            if p != TRAINER_KEY and not p.startswith(TRAINER_KEY + ".")
        ]
        if mismatch:
            raise UnsupportedStateError(
                f"the checkpoint of step {restored.step} in {self.dirpath} does not match this model "
                f"and its optimizers: {', '.join(mismatch[:5])}{' ...' if len(mismatch) > 5 else ''}. "
                "Resume with the model and configure_optimizers() it was saved with, or pass "
                "ManagedCheckpoint(resume=False) to start fresh.",
                step=restored.step,
                path=self.dirpath,
            )
        step = restored.step
        if step is None or holder.loaded is None:
            return
        # What Trainer.fit(ckpt_path=...) does after the weights: callbacks, precision, loops,
        # schedulers. The weights and optimizers are loaded already (through DCP).
        torch_private.restore_trainer_state(trainer, holder.loaded)
        self.restored_step = int(step)
        self._rng = rng
        logger.info("safeckpt: resumed at global_step %d from %s", trainer.global_step, self.dirpath)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rng, self._rng = self._rng, None
        if rng is not None and _replays_epoch_end(trainer):
            restore_rng(rng)  # undo the draws of a data iterator the next epoch replaces (module doc)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        n = self.every_n_train_steps
        if n and trainer.global_step % n == 0:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epoch_due(trainer) and not _runs_validation(trainer):
            self._save(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and self._epoch_due(trainer):
            self._save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_on_train_end:
            # Again even if this step was saved at validation end: the loops now say the epoch
            # is complete, so a resume starts the next epoch instead of replaying this one's end.
            self._save(trainer, again=True)
        if self.manager is not None:
            self.manager.wait()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            self._close()
        except Exception:
            logger.exception("safeckpt: closing the checkpoint manager failed while handling another error")

    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": self.dirpath}

    # --- pieces ------------------------------------------------------------------------

    def _close(self) -> None:
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.close()

    def _epoch_due(self, trainer: pl.Trainer) -> bool:
        n = self.every_n_epochs
        return n is not None and n > 0 and (trainer.current_epoch + 1) % n == 0

    def _state(self, trainer: pl.Trainer, holder: _TrainerState) -> dict[str, Any]:
        state: dict[str, Any] = {"model": trainer.strategy.model}
        for i, optimizer in enumerate(trainer.optimizers):
            state[f"optimizer_{i}"] = optimizer
        state[TRAINER_KEY] = holder
        return state

    def _save(self, trainer: pl.Trainer, *, again: bool = False) -> None:
        if self.manager is None or trainer.sanity_checking or getattr(trainer, "fast_dev_run", False):
            return
        step = trainer.global_step
        if step == self.restored_step or (step in self.saved_steps[-1:] and not again):
            return  # this step is saved already (or is the one we resumed from)
        metrics = _scalar_metrics(trainer.callback_metrics)
        # overwrite=True: after a resume from an older step, later steps are saved again.
        self.manager.save(step, self._state(trainer, _TrainerState(trainer)), metrics=metrics, overwrite=True)
        if step not in self.saved_steps[-1:]:
            self.saved_steps.append(step)


def _replays_epoch_end(trainer: pl.Trainer) -> bool:
    """Whether the fit loop resumes an epoch whose batches had all ended but which was not over yet
    (a save at validation end): Lightning replays the epoch's end, and the next epoch makes a train
    data iterator of its own, so the one the data setup made never yields a batch."""
    loop = trainer.fit_loop
    batches = loop.epoch_loop.batch_progress
    all_ended = batches.is_last_batch and batches.current.completed == batches.current.ready
    return bool(loop.restarting and all_ended)


def _runs_validation(trainer: pl.Trainer) -> bool:
    """Whether validation runs at the end of this epoch (then the save waits for its metrics)."""
    if not trainer.enable_validation:
        return False
    every = trainer.check_val_every_n_epoch
    return every is not None and (trainer.current_epoch + 1) % every == 0


def _scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in metrics.items():
        try:
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if not math.isnan(number):
            out[name] = number
    return out
