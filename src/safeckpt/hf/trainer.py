"""``attach(trainer, root)``: a Hugging Face ``Trainer`` saves and resumes through a CheckpointManager.

How it fits the Trainer (each internal named in :mod:`safeckpt._util.hf_private`):

* **Saving.** The loop calls ``_save_checkpoint`` when a save is due (the user's ``save_strategy``,
  after evaluation and the best-metric decision). For an attached Trainer that call hands the
  model, the optimizer, the LR scheduler, the grad scaler and the ``TrainerState`` to
  ``manager.save(global_step, ...)``: async by default, one commit, checksums. The eval metrics
  logged at that step go into the record, so retention ranks by them.
* **Resuming** takes two reads of one checkpoint. ``train()`` first reads only the Trainer's state
  of the checkpoint auto-resume chooses (or the step/path asked for) and hands the Trainer a
  marker directory holding just that ``trainer_state.json``: the Trainer's own code then sets
  the global step, epoch, callbacks and the data position from it, as for its own checkpoints.
  Once ``accelerator.prepare`` has built the optimizer, the call that would load HF's optimizer
  file restores everything (model, optimizer, scheduler, scaler, every rank's RNG states)
  with the manager's checks. If that finds damage the first read could not see (a flipped byte
  in a weight), the manager falls back to the commit before and moves the damaged one aside;
  ``train()`` then starts over from the older checkpoint, with a warning.
* **The data position.** The Trainer skips the batches of the resumed epoch with Accelerate's
  ``skip_first_batches``: for a map-style dataset it draws the sampler's indices and drops them,
  never loading a sample; an iterable dataset's batches are read and dropped (docs/huggingface.md).
  The RNG states are set where the Trainer sets its own: at an epoch's start, or once the skipped
  indices are drawn, so the run goes on draw for draw.
* **Preemption.** SIGTERM (by default) sets a flag; at the next step's end the Trainer saves that
  step and stops; ``train()`` waits until the save is durable and exits with ``128 + signal``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from .._manager.manager import CheckpointManager
from .._ops.export import HF_CONFIG
from .._state.train_state import capture_rng, restore_rng
from .._util.hf_private import check_trainer, route_trainer
from ..errors import CheckpointNotFoundError, ConfigError
from .retention import trainer_retention
from .trainer_state import TRAINER_KEY, TrainerStateEntry, write_marker

logger = logging.getLogger(__name__)

__all__ = ["attach", "manager_of"]

_bindings: weakref.WeakKeyDictionary[Any, _Binding] = weakref.WeakKeyDictionary()

RESTARTS = 3
"""How many times ``train()`` starts over after the full restore fell back past damage."""


def attach(trainer: Any, root: str | os.PathLike[str], **manager_options: Any) -> CheckpointManager:
    """Make ``trainer`` save into, and resume from, a :class:`~safeckpt.CheckpointManager` on ``root``.

    Call it once, after building the ``Trainer`` (or a subclass: TRL's ``SFTTrainer``, your own),
    on every rank. The Trainer's arguments still decide when to save (``save_strategy``,
    ``save_steps``), what to keep (``save_total_limit``, ``metric_for_best_model``,
    ``greater_is_better``) and ``load_best_model_at_end``; ``manager_options`` go to the manager and
    win: ``retention=`` (the Trainer's best step is kept on top of it), ``schedule=`` (a
    :class:`~safeckpt.SaveSchedule`: extra saves), ``local_dir=``, ``overlap_staging=``,
    ``async_save=``, ``storage_options=``, ``preemption_signals=`` (default: SIGTERM)...

    ``root`` is a directory or an ``s3://bucket/prefix`` URL. Returns the manager; it stays open
    across ``train()`` calls (close it, or let the interpreter's exit wait for its saves).
    """
    check_trainer(type(trainer))
    if trainer in _bindings:
        raise ConfigError(
            f"this Trainer is attached already (to {_bindings[trainer].manager.root}); "
            "call attach() once per Trainer."
        )
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ConfigError(
            "safeckpt.hf.attach() does not take a DeepSpeed Trainer (DeepSpeed saves its own engine "
            "state); use FSDP or DDP, or the Trainer's own checkpoints."
        )
    binding = _Binding(trainer)
    options = dict(manager_options)
    options["retention"] = trainer_retention(trainer.args, options.get("retention"), binding.best_step)
    if "preemption_signals" not in options and threading.current_thread() is threading.main_thread():
        options["preemption_signals"] = (signal.SIGTERM,)
    binding.asks_each_step = bool(options.get("schedule") or options.get("preemption_signals"))
    if trainer.args.save_strategy == "no" and not options.get("schedule"):
        logger.warning(
            "safeckpt: save_strategy='no': the Trainer never asks for a save, so only a preemption "
            "signal (or attach(..., schedule=SaveSchedule(...))) saves into %s",
            root,
        )
    if trainer.args.save_only_model:
        logger.warning(
            "safeckpt: save_only_model=True is ignored: every checkpoint holds the whole state "
            "(optimizer, scheduler, RNG), so any of them resumes exactly."
        )
    binding.manager = CheckpointManager(root, **options)
    route_trainer(_bindings.get)
    _bindings[trainer] = binding
    from .callback import SafeckptCallback

    trainer.add_callback(SafeckptCallback(binding))
    return binding.manager


def manager_of(trainer: Any) -> CheckpointManager | None:
    """The manager :func:`attach` gave ``trainer``, or None."""
    binding = _bindings.get(trainer)
    return None if binding is None else binding.manager


class _ChoseOlder(Exception):
    """Control flow inside ``train()``, never seen outside: start over from an older step."""

    def __init__(self, step: int | None) -> None:
        super().__init__(step)
        self.step = step


class _Binding:
    """An attached Trainer's answers to the internals :mod:`safeckpt._util.hf_private` routes."""

    manager: CheckpointManager

    def __init__(self, trainer: Any) -> None:
        self._trainer = weakref.ref(trainer)
        self.asks_each_step = False
        self.imported_from: str | None = None
        self.restored_step: int | None = None
        """The step the last ``train()`` resumed from (None: it started fresh or from an HF folder)."""
        self._marker: str | None = None
        self._request: dict[str, Any] = {}
        self._chosen: int | None = None
        self._best_checkpoint: str | None = None
        self._rng: dict[str, Any] | None = None
        self._saved: set[int] = set()
        self._push_warned = False

    @property
    def trainer(self) -> Any:
        trainer = self._trainer()
        assert trainer is not None
        return trainer

    def best_step(self) -> int | None:
        trainer = self._trainer()
        return None if trainer is None else trainer.state.best_global_step

    # --- train() -----------------------------------------------------------------------

    def train(self, original: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        request, must_exist, hf_folder = self._resume_request(resume_from_checkpoint)
        self.restored_step = None
        output = None
        for attempt in range(RESTARTS + 1):
            start = hf_folder
            if request is not None:
                marker = self._choose(request, must_exist=must_exist, hf_folder=hf_folder)
                start = marker if marker is not None else hf_folder
            if start is hf_folder:
                self.imported_from = os.path.abspath(hf_folder) if hf_folder else self.imported_from
            try:
                output = original(start, *args, **kwargs)
                break
            except _ChoseOlder as older:
                if attempt == RESTARTS:
                    raise
                logger.warning(
                    "safeckpt: the checkpoint of step %s in %s was damaged; starting the run again from "
                    "step %s, the newest that verifies",
                    self._chosen,
                    self.manager.root,
                    older.step,
                )
                request = {}
            finally:
                self._drop_marker()
        if self.manager.preempted:
            self._exit_preempted()
        return output

    def _resume_request(self, value: Any) -> tuple[dict[str, Any] | None, bool, str | None]:
        """(what to ask the manager for, or None: nothing; whether it must find one; an HF folder)."""
        from transformers.trainer import TRAINER_STATE_NAME

        if value is None:
            return {}, False, None
        if value is False:
            return None, False, None
        if value is True:
            return {}, True, None
        if isinstance(value, int):
            return {"step": value}, True, None
        if isinstance(value, (str, os.PathLike)):
            path = os.fspath(value)
            if os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
                return {}, False, path  # an HF checkpoint-N folder: imported unless done already
            return {"path": path}, True, None
        raise ConfigError(
            f"train(resume_from_checkpoint={value!r}): pass None (resume from the newest checkpoint), "
            "False (start fresh), a step number, a checkpoint path, or an HF checkpoint-N folder."
        )

    def _choose(self, request: dict[str, Any], *, must_exist: bool, hf_folder: str | None) -> str | None:
        """The first read: the Trainer's state of the checkpoint to resume; a marker holding it."""
        entry = TrainerStateEntry(self.trainer)
        restored = self.manager.restore({TRAINER_KEY: entry}, include=[TRAINER_KEY], strict=False, **request)
        if not restored:
            if must_exist:
                raise CheckpointNotFoundError(
                    f"train(resume_from_checkpoint=True): {self.manager.root} holds no checkpoint to "
                    "resume from. Pass None to start fresh when there is none."
                )
            return None
        if entry.loaded is None:
            raise ConfigError(
                f"the checkpoint of step {restored.step} in {self.manager.root} was not saved by "
                "safeckpt.hf.attach() (it has no Trainer state); attach to a root of its own, or "
                "pass resume_from_checkpoint=False to start fresh."
            )
        imported = entry.loaded.get("imported_from")
        if hf_folder is not None and imported != os.path.abspath(hf_folder):
            return None  # this folder was never imported here: the Trainer loads it (an import)
        if hf_folder is not None:
            logger.info(
                "safeckpt: %s was imported already; resuming from step %s in %s",
                hf_folder,
                restored.step,
                self.manager.root,
            )
        trainer_state = entry.loaded_state()
        self.imported_from = imported
        self._best_checkpoint = trainer_state.get("best_model_checkpoint")
        self._chosen = restored.step
        self._request = request
        self._marker = write_marker(trainer_state)
        return self._marker

    def _drop_marker(self) -> None:
        marker, self._marker = self._marker, None
        if marker is not None:
            shutil.rmtree(marker, ignore_errors=True)

    def _exit_preempted(self) -> None:
        manager = self.manager
        number = manager.preemption_signal or signal.SIGTERM
        manager.wait(durable=True)
        manager.close()
        logger.warning(
            "safeckpt: preempted by signal %d; step %s is saved in %s; exiting with %d",
            number,
            self.trainer.state.global_step,
            manager.root,
            128 + number,
        )
        raise SystemExit(128 + number)

    # --- the internals the Trainer calls ------------------------------------------------

    def load_from_checkpoint(self, original: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if self._is_marker(path):
            return None  # the weights come with the full restore (load_optimizer_and_scheduler)
        return original(path, *args, **kwargs)

    def load_optimizer_and_scheduler(self, original: Any, checkpoint: str | None) -> Any:
        if not self._is_marker(checkpoint):
            return original(checkpoint)
        trainer = self.trainer
        restored = self.manager.restore(self._state(TrainerStateEntry(trainer)), **self._request)
        if restored.step != self._chosen:
            raise _ChoseOlder(restored.step)  # damage found: the Trainer's state read first is not this one's
        self._rng = capture_rng()  # as the restore left them: the checkpoint's (set again by load_rng_state)
        trainer.state.best_model_checkpoint = self._best_checkpoint
        self.restored_step = restored.step
        self._saved = set()
        logger.info("safeckpt: resumed at global_step %s from %s", restored.step, restored.path)
        return None

    def load_scaler(self, original: Any, checkpoint: str | None) -> Any:
        return None if self._is_marker(checkpoint) else original(checkpoint)

    def load_rng_state(self, original: Any, checkpoint: str | None) -> Any:
        if not self._is_marker(checkpoint):
            return original(checkpoint)
        if self._rng is not None:
            restore_rng(self._rng)
        return None

    def save_checkpoint(self, original: Any, model: Any, trial: Any) -> Any:
        trainer = self.trainer
        if trial is not None:
            return original(model, trial)  # a hyperparameter-search trial: the Trainer's own folders
        trainer.store_flos()
        state = trainer.state
        step = state.global_step
        best = state.best_global_step
        if best and (best == step or best in self._saved):
            state.best_model_checkpoint = self.location(best)
        _record_callback_states(trainer)
        metrics = _step_metrics(state.log_history, step)
        entry = TrainerStateEntry(trainer, self.imported_from)
        # overwrite=True: after a fallback to an older step, later steps are saved again
        self.manager.save(step, self._state(entry), metrics=metrics, extra=self._extra(), overwrite=True)
        self._saved.add(step)
        if trainer.args.push_to_hub and not self._push_warned:
            self._push_warned = True
            logger.warning("safeckpt: push_to_hub of checkpoints is not done for an attached Trainer")
        return None

    def load_best_model(self, original: Any) -> Any:
        step = self.step_of(self.trainer.state.best_model_checkpoint)
        if step is None:
            return original()
        self.manager.wait()  # the best may be the save still in flight
        try:
            self.manager.restore({"model": self.trainer.model}, step=step, include=["model"], strict=False)
        except CheckpointNotFoundError as e:
            logger.warning(
                "safeckpt: the best checkpoint (step %d) is gone; keeping the last weights: %s", step, e
            )
            return None
        logger.info("safeckpt: loaded the best model, step %d, from %s", step, self.manager.root)
        return None

    # --- pieces ------------------------------------------------------------------------

    def location(self, step: int) -> str:
        return f"{str(self.manager.root).rstrip('/')}/step_{step}"

    def step_of(self, where: str | None) -> int | None:
        """The step of one of this root's checkpoints named by :meth:`location`, else None."""
        prefix = f"{str(self.manager.root).rstrip('/')}/step_"
        if not where or not where.startswith(prefix) or not where[len(prefix) :].isdigit():
            return None
        return int(where[len(prefix) :])

    def _extra(self) -> dict[str, Any]:
        """The model's config (``safeckpt export --format hf`` writes it as ``config.json``)."""
        model = self.trainer.model
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            return {}
        data = config.to_dict()
        data["architectures"] = [type(model).__name__]
        try:
            json.dumps(data)
        except (TypeError, ValueError):
            return {}  # a config with values JSON cannot hold: exported without config.json
        return {HF_CONFIG: data}

    def _is_marker(self, path: Any) -> bool:
        return self._marker is not None and path is not None and os.fspath(path) == self._marker

    def _state(self, entry: TrainerStateEntry) -> dict[str, Any]:
        trainer = self.trainer
        state: dict[str, Any] = {"model": trainer.model}
        optimizer = trainer.optimizer
        if optimizer is not None:
            state["optimizer"] = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds it
        if trainer.lr_scheduler is not None:
            state["scheduler"] = trainer.lr_scheduler
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        state[TRAINER_KEY] = entry
        return state


def _record_callback_states(trainer: Any) -> None:
    """What ``_save_checkpoint`` does before writing ``trainer_state.json``: the stateful callbacks'
    and ``TrainerControl``'s state into ``TrainerState.stateful_callbacks``."""
    from transformers.trainer_callback import ExportableState

    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if not isinstance(callback, ExportableState):
            continue
        name = type(callback).__name__
        saved = trainer.state.stateful_callbacks.get(name)
        if isinstance(saved, list):
            saved.append(callback.state())
        else:
            trainer.state.stateful_callbacks[name] = callback.state()


def _step_metrics(log_history: list[Mapping[str, Any]], step: int) -> dict[str, float]:
    """The numbers logged at ``step`` (train loss, eval metrics), for the record and retention."""
    metrics: dict[str, float] = {}
    for entry in log_history:
        if entry.get("step") != step:
            continue
        for name, value in entry.items():
            if name in ("step", "epoch") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                metrics[name] = float(value)
    return metrics
