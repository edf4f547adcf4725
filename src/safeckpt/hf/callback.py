"""The callback :func:`~safeckpt.hf.attach` adds: the schedule and preemption flag, once per step."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

__all__ = ["SafeckptCallback"]


class SafeckptCallback(TrainerCallback):
    """Asks the manager at every step's end (collective: every rank runs the callbacks) whether to
    save now (its ``schedule``, or a preemption signal on any rank), and stops the run once the
    save of a preempted step is done; waits for the queued saves when training ends."""

    def __init__(self, binding: Any) -> None:
        self.binding = binding

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        manager = self.binding.manager
        if self.binding.asks_each_step and manager.should_save(state.global_step):
            control.should_save = True
        if manager.preempted:
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.binding.manager.wait()  # train() returns with every checkpoint committed
        return control
