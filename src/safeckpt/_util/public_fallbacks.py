"""The public fallbacks of :mod:`safeckpt._util.torch_private` that are more than a line: what a
private torch or Lightning helper does, written with public API only. Nothing here is private to
torch or Lightning; the door picks these when its private symbol is missing or switched off.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any


def set_element(root: Any, path: Sequence[Any], value: Any) -> None:
    """Set ``value`` in ``root`` along ``path`` (DCP's object path: keys and list indices),
    making the dicts and lists on the way as DCP's ``_traverse.set_element`` does."""
    current = root
    for i in range(1, len(path)):
        key, following = path[i - 1], path[i]
        default: Any = {} if type(following) is str else []
        if isinstance(current, Mapping):
            current = current.setdefault(key, default)  # type: ignore[attr-defined]
        else:
            while len(current) <= key:
                current.append(None)
            if current[key] is None:
                current[key] = default
            current = current[key]
    last = path[-1]
    if type(last) is int:
        while len(current) <= last:
            current.append(None)
    current[last] = value


def restore_trainer_state(trainer: Any, loaded: dict[str, Any]) -> None:
    """What the checkpoint connector's ``restore_*`` do, in its order, through public hooks only:
    datamodule, callbacks, precision plugin, the loop of the trainer's current function, LR schedulers."""
    if not loaded:
        return
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.trainer.states import TrainerFn

    datamodule = trainer.datamodule
    if datamodule is not None and type(datamodule).__qualname__ in loaded:
        datamodule.load_state_dict(loaded[type(datamodule).__qualname__])
    callback_states = loaded.get("callbacks")
    if callback_states is not None:
        for callback in trainer.callbacks:
            callback.on_load_checkpoint(trainer, trainer.lightning_module, loaded)
        for callback in trainer.callbacks:
            state = callback_states.get(callback.state_key)
            if state:
                callback.load_state_dict(copy.deepcopy(state))
    precision = trainer.precision_plugin
    precision.on_load_checkpoint(loaded)
    if type(precision).__qualname__ in loaded:
        precision.load_state_dict(loaded[type(precision).__qualname__])
    loops = loaded.get("loops")
    fn = trainer.state.fn
    if loops is not None:
        by_fn = {
            TrainerFn.FITTING: "fit_loop",
            TrainerFn.VALIDATING: "validate_loop",
            TrainerFn.TESTING: "test_loop",
            TrainerFn.PREDICTING: "predict_loop",
        }
        if fn in by_fn:
            getattr(trainer, by_fn[fn]).load_state_dict(loops[by_fn[fn]])
    if fn == TrainerFn.FITTING:
        max_epochs = trainer.max_epochs
        if max_epochs is not None and max_epochs != -1 and trainer.current_epoch > max_epochs:
            raise MisconfigurationException(
                f"You restored a checkpoint with current_epoch={trainer.current_epoch},"
                f" but you have set Trainer(max_epochs={max_epochs})."
            )
    # As the connector: schedulers past the shorter of the two lists are left as they are.
    for config, state in zip(trainer.lr_scheduler_configs, loaded["lr_schedulers"], strict=False):
        config.scheduler.load_state_dict(state)
