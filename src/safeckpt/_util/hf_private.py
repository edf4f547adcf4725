"""The one door to the Hugging Face ``Trainer``'s and Accelerate's internals that :mod:`safeckpt.hf`
relies on: each is named here, checked here, and reached only from here.

Unlike torch's private symbols (:mod:`safeckpt._util.torch_private`), these have no public
fallback: a Trainer saves only through ``_save_checkpoint`` and resumes only from what its
``resume_from_checkpoint`` path holds, and no public hook comes late enough (after evaluation and
the best-metric decision) or early enough (before the loop computes where in the data it stands).
So instead of falling back, :func:`check_trainer` refuses a Trainer class whose internals are not
the ones this module was written against (missing, or taking other parameters) with
:class:`TrainerInternalsError`, naming each difference, before anything is saved or loaded; and
``tests/test_hf.py::test_trainer_internals_are_as_written`` fails on a ``transformers`` upgrade
that changes one. Checked against transformers 5.25 and accelerate 1.16 (``constraints/ci.txt``).

The ``transformers.Trainer`` internals, and what safeckpt.hf does with each:

* ``train(resume_from_checkpoint, trial, ignore_keys_for_eval)`` (public): chooses the checkpoint
  to resume (the newest that verifies) and hands the Trainer a resume marker, a local directory
  holding only that checkpoint's ``trainer_state.json``.
* ``_save_checkpoint(model, trial)``: to the manager. The one call the loop makes when a save is
  due, after evaluation and ``_determine_best_metric``.
* ``_load_from_checkpoint(resume_from_checkpoint, model)``: skipped for the marker (the weights
  come with the optimizer, below); the Trainer's own for any other path (an import).
* ``_load_optimizer_and_scheduler(checkpoint)``: for the marker, the whole restore (model,
  optimizer, scheduler, scaler) where the Trainer loads its optimizer file: after
  ``accelerator.prepare``, before the first step.
* ``_load_scaler(checkpoint)``: skipped for the marker (restored above).
* ``_load_rng_state(checkpoint)``: for the marker, sets the restored RNG states where the loop
  would: at an epoch's start, or once the skipped batches' indices were drawn.
* ``_load_best_model()``: ``load_best_model_at_end`` from the manager when the best checkpoint is
  safeckpt's.

Behaviour relied on, not a symbol (caught by the bit-exact resume tests): ``_inner_training_loop``
runs ``_init_training_state`` (which reads ``trainer_state.json`` from the resume path with
``TrainerState.load_from_json`` and restores the stateful callbacks) before
``_prepare_for_training`` (which calls ``_load_optimizer_and_scheduler`` once the model and
optimizer are prepared), then ``on_train_begin``, then ``_run_epoch`` (``get_resumed_dataloader``,
whose default, Accelerate's ``skip_first_batches``, skips a map-style dataset's batches by their
indices without loading them; then ``_load_rng_state``).

Accelerate (for :func:`safeckpt.hf.accelerator_state`): the lists ``Accelerator._models``,
``_optimizers``, ``_schedulers``, ``_dataloaders`` and ``_custom_objects``, which
``Accelerator.save_state`` iterates; there is no public way to list what was prepared.

The routing is installed once per process, on ``transformers.Trainer`` itself (so ``super()`` in a
subclass reaches it), and changes nothing for a Trainer that was not attached. Nothing here imports
transformers or accelerate until :mod:`safeckpt.hf` calls in.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError

__all__ = [
    "ACCELERATOR_LISTS",
    "TRAINER_INTERNALS",
    "TrainerInternalsError",
    "accelerator_objects",
    "check_trainer",
    "route_trainer",
]

TRAINER_INTERNALS: dict[str, tuple[str, ...]] = {
    "train": ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),
    "_load_rng_state": ("self", "checkpoint"),
    "_load_best_model": ("self",),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    "_load_scaler": ("self", "checkpoint"),
}
"""Each Trainer internal safeckpt.hf relies on, with the parameters it was written against."""

ROUTED = tuple(TRAINER_INTERNALS)
"""The internals :func:`route_trainer` sends to an attached Trainer's binding."""

ACCELERATOR_LISTS = ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects")
"""What ``Accelerator.save_state`` iterates: the objects ``prepare`` and
``register_for_checkpointing`` took."""


class TrainerInternalsError(ConfigError):
    """The installed transformers (or accelerate) is not the one safeckpt.hf was written against."""


def differences(trainer_class: type) -> list[str]:
    """What ``trainer_class`` (``transformers.Trainer`` or a subclass) lacks or takes differently."""
    found = []
    for name, expected in TRAINER_INTERNALS.items():
        method = getattr(trainer_class, name, None)
        if method is None:
            found.append(f"{trainer_class.__name__}.{name} is gone")
            continue
        method = getattr(method, "__wrapped__", method)  # our own routing, installed earlier
        try:
            parameters = tuple(inspect.signature(method).parameters)
        except (TypeError, ValueError):
            found.append(f"{trainer_class.__name__}.{name} has no signature to check")
            continue
        if parameters != expected:
            found.append(
                f"{trainer_class.__name__}.{name}{_params(parameters)}, not {name}{_params(expected)}"
            )
    return found


def _params(names: tuple[str, ...]) -> str:
    return "(" + ", ".join(n for n in names if n != "self") + ")"


def check_trainer(trainer_class: type) -> None:
    """Raise :class:`TrainerInternalsError` unless the base ``Trainer`` has every internal as written.

    Only the base class is checked: a subclass may override ``_save_checkpoint`` as long as it calls
    ``super()`` (checked at the first save, where the override runs)."""
    import transformers

    base = transformers.Trainer
    if not issubclass(trainer_class, base):
        raise ConfigError(
            "safeckpt.hf.attach() takes a transformers.Trainer (or a subclass), got "
            f"{trainer_class.__name__}."
        )
    found = differences(base)
    if found:
        raise TrainerInternalsError(
            f"transformers {transformers.__version__} changed what safeckpt.hf relies on: "
            + "; ".join(found)
            + ". Install the transformers range safeckpt[hf] names (pip install 'safeckpt[hf]'), "
            "or a safeckpt release that supports this one."
        )


_lock = threading.Lock()
_routed: list[bool] = []


def route_trainer(binding_of: Callable[[Any], Any]) -> None:
    """Send :data:`ROUTED` calls of an attached Trainer to its binding (``binding_of(trainer)``, None
    for a Trainer that was not attached: then the Trainer's own method runs). Once per process.

    The binding has a method for each, named without the underscore (``save_checkpoint(original,
    model, trial)``, ``train(original, ...)``...), given the Trainer's own method, bound, to call
    where the call is not safeckpt's."""
    with _lock:
        if _routed:
            return
        import transformers

        base = transformers.Trainer
        for name in ROUTED:
            original = getattr(base, name)
            setattr(base, name, _router(name, original, binding_of))
        _routed.append(True)


def _router(name: str, original: Callable[..., Any], binding_of: Callable[[Any], Any]) -> Callable[..., Any]:
    handler = name.lstrip("_")

    @functools.wraps(original)
    def routed(self: Any, *args: Any, **kwargs: Any) -> Any:
        binding = binding_of(self)
        if binding is None:
            return original(self, *args, **kwargs)
        return getattr(binding, handler)(functools.partial(original, self), *args, **kwargs)

    return routed


def accelerator_objects(accelerator: Any) -> dict[str, list[Any]]:
    """What ``accelerator.save_state`` would save, by list (models, optimizers, schedulers,
    dataloaders, custom objects), as ``prepare`` and ``register_for_checkpointing`` left them."""
    found: dict[str, list[Any]] = {}
    for name in ACCELERATOR_LISTS:
        value = getattr(accelerator, name, None)
        if not isinstance(value, list):
            import accelerate

            raise TrainerInternalsError(
                f"accelerate {accelerate.__version__} has no list Accelerator.{name}, which "
                "safeckpt.hf.accelerator_state reads (what save_state saves). Install the accelerate "
                "range safeckpt[hf] names, or pass the objects to save yourself (docs/huggingface.md)."
            )
        found[name.lstrip("_")] = list(value)
    return found
