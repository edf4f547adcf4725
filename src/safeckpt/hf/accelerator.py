"""``accelerator_state(accelerator)``: what ``Accelerator.save_state`` saves, as a CheckpointManager state.

``save_state`` writes the prepared models, optimizers, LR schedulers, the samplers' and stateful
dataloaders' positions, the grad scaler, every rank's RNG states and the objects passed to
``register_for_checkpointing``, into a folder, synchronously, with nothing that says the folder is
complete. The same objects in a dict go through a :class:`~safeckpt.CheckpointManager` instead:
async, committed at once, checked on load, retention, ``s3://``, auto-resume past damage.

    state = accelerator_state(accelerator)
    with CheckpointManager(root) as mgr:
        start = (r := mgr.restore(state)).step or 0
        ...
        mgr.save(step, state)

The RNG states are the manager's own (``save_rng``, every rank's). Making a data iterator draws
a seed from torch's RNG; the run that never stopped made the epoch's iterator at the epoch's start.
So a loop resumed in the middle of an epoch takes its first batches from :func:`skip_batches`,
and goes on draw for draw (the Trainer does the same). The dict holds the objects
themselves, so build it once after ``prepare`` and ``register_for_checkpointing``; build it again
after preparing more.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .._state.train_state import capture_rng, restore_rng
from .._util.hf_private import accelerator_objects

__all__ = ["accelerator_state", "skip_batches"]


class _LoaderPosition:
    """A prepared dataloader's epoch counter (``DataLoaderShard.iteration``: the epoch its seedable
    sampler shuffles for), and a stateful dataloader's own state where it keeps one."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"iteration": int(getattr(self.loader, "iteration", 0))}
        if getattr(self.loader, "use_stateful_dataloader", False):
            state["loader"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(int(state["iteration"]))
        if "loader" in state and getattr(self.loader, "use_stateful_dataloader", False):
            self.loader.load_state_dict(state["loader"])


class _Counters:
    """The accelerator's own counters ``save_state`` keeps: the gradient-accumulation step."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


def accelerator_state(accelerator: Any) -> dict[str, Any]:
    """The state ``accelerator.save_state()`` would save, as a dict to give ``CheckpointManager.save``
    and ``restore``: ``model_<i>``, ``optimizer_<i>``, ``scheduler_<i>``, ``dataloader_<i>``,
    ``custom_<i>`` (in the order ``prepare`` and ``register_for_checkpointing`` took them),
    ``scaler`` (under mixed precision with one) and ``accelerator`` (its step counter)."""
    objects = accelerator_objects(accelerator)
    state: dict[str, Any] = {}
    for i, model in enumerate(objects["models"]):
        state[f"model_{i}"] = model
    for i, optimizer in enumerate(objects["optimizers"]):
        state[f"optimizer_{i}"] = getattr(optimizer, "optimizer", optimizer)  # the wrapped torch optimizer
    for i, scheduler in enumerate(objects["schedulers"]):
        state[f"scheduler_{i}"] = getattr(scheduler, "scheduler", scheduler)
    for i, loader in enumerate(objects["dataloaders"]):
        state[f"dataloader_{i}"] = _LoaderPosition(loader)
    for i, obj in enumerate(objects["custom_objects"]):
        state[f"custom_{i}"] = obj
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        state["scaler"] = scaler
    state["accelerator"] = _Counters(accelerator)
    return state


def skip_batches(accelerator: Any, loader: Any, count: int) -> Iterator[Any]:
    """The batches of ``loader``'s epoch after the first ``count``, for a loop resumed mid-epoch.

    Accelerate's ``skip_first_batches`` (a map-style dataset's skipped batches are only drawn as
    indices, never loaded), with the RNG states left as the restore set them: the data iterator
    draws its seed from torch's RNG when it fetches its first batch, which the run that never
    stopped did at the epoch's start. Set the loader's epoch first (``loader.set_epoch(epoch)``).
    """
    batches = iter(accelerator.skip_first_batches(loader, count) if count else loader)
    rng = capture_rng()
    try:
        first = next(batches)
    except StopIteration:
        return
    finally:
        restore_rng(rng)
    yield first
    yield from batches
