"""The Trainer's own state as one entry of a safeckpt checkpoint, and the resume marker built from it.

The entry holds ``TrainerState`` (global step, epoch, log history, best metric and best step, the
stateful callbacks such as early stopping, ``TrainerControl``) as the JSON string the Trainer
itself writes to ``trainer_state.json``, so it goes into the train-state file without pickle and
reads back exactly. Beside it: which ``checkpoint-N`` folder the run was imported from, if any.

The marker is a local directory holding that ``trainer_state.json`` and nothing else: handed to
``Trainer.train(resume_from_checkpoint=marker)``, it makes the Trainer's own resume code compute
the epoch and the batches already trained in it, restore the stateful callbacks and skip the
batches, while :mod:`.trainer` answers the internals that would read weights from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

TRAINER_KEY = "trainer"
"""The state entry that holds the Trainer's own state."""

FORMAT = 1


def state_json(state: Any) -> str:
    """``TrainerState`` as the Trainer writes it (``TrainerState.save_to_json``)."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


class TrainerStateEntry:
    """``state_dict()`` is the Trainer's state now; ``load_state_dict()`` keeps what a restore read."""

    def __init__(self, trainer: Any, imported_from: str | None = None) -> None:
        self.trainer = trainer
        self.imported_from = imported_from
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        import transformers

        return {
            "format": FORMAT,
            "trainer_state": state_json(self.trainer.state),
            "transformers": transformers.__version__,
            "imported_from": self.imported_from,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = dict(state)

    def loaded_state(self) -> dict[str, Any]:
        """The restored ``TrainerState`` as a dict (``TrainerState(**it)`` builds one)."""
        assert self.loaded is not None
        return json.loads(self.loaded["trainer_state"])


def write_marker(trainer_state: Mapping[str, Any]) -> str:
    """A fresh local directory holding ``trainer_state.json`` with ``trainer_state``.

    ``best_model_checkpoint`` is left out: the Trainer drops one that is not a local directory
    (an ``s3://`` root), with a warning; :mod:`.trainer` puts it back after the Trainer read it.
    """
    from transformers.trainer import TRAINER_STATE_NAME

    data = dict(trainer_state)
    data["best_model_checkpoint"] = None
    marker = tempfile.mkdtemp(prefix="safeckpt-hf-resume-")
    with open(os.path.join(marker, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return marker


__all__ = ["TRAINER_KEY", "TrainerStateEntry", "state_json", "write_marker"]
