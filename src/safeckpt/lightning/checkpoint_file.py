"""One Lightning checkpoint file: its staging buffers and its atomic write.

* :class:`CheckpointSlot` copies a checkpoint dict's tensors into host buffers kept
  from save to save (a :class:`~safeckpt._manager.background.StagingSlot` that keeps container
  types); a :class:`~safeckpt._manager.background.StagingPool` of them bounds how many wait;
* the file itself is written by the directory's store (``Store.write_stream``).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

from .._manager.background import StagingSlot

TEMP_NAME = re.compile(r"\..+\.tmp\.[0-9a-f]{12}")
"""The temp files a local store's ``write_stream`` makes (``.<name>.tmp.<12 hex>``)."""


class CheckpointSlot(StagingSlot):
    """A :class:`StagingSlot` that keeps container types and attributes.

    A checkpoint's ``state_dict`` is an ``OrderedDict`` whose ``_metadata`` (module
    versions) ``load_state_dict`` reads, and ``hyper_parameters`` may be an
    ``AttributeDict``: a shallow copy keeps both, then tensors go into the buffers.
    """

    def _stage(
        self, value: Any, path: tuple[Any, ...], seen: set[tuple[Any, ...]], device_copy: list[bool]
    ) -> Any:
        if isinstance(value, torch.Tensor):
            seen.add(path)
            return self._copy(value, path, device_copy)
        if isinstance(value, dict):
            out = copy.copy(value)
            for key, item in value.items():
                out[key] = self._stage(item, (*path, key), seen, device_copy)
            return out
        if type(value) in (list, tuple):
            return type(value)(self._stage(v, (*path, i), seen, device_copy) for i, v in enumerate(value))
        return copy.deepcopy(value)
