"""What :class:`~safeckpt.lightning.SafeCheckpointIO` needs from a Trainer's start, which Lightning
does not tell a ``CheckpointIO``.

A ``CheckpointIO`` is handed saves, loads and removals, nothing else: not the Trainer, not the
directory of its ``ModelCheckpoint``, no hook before the first save, and no part in resolving
``fit(ckpt_path="last")``. Two wrappers of ``ModelCheckpoint`` methods give it that; installed once,
when the first plugin is made, they change nothing for a Trainer whose strategy writes through
another ``CheckpointIO``:

* ``setup``: the callback's directory is checked as the Trainer starts (``check_dir``: a missing
  bucket, a directory under a file), on global rank 0, and every rank raises the same error;
  before, the raw S3 error came at the first save, after an epoch of training;
* the lookup behind ``fit(ckpt_path="last")``: on a URL dirpath Lightning lists the ``last`` files
  without their scheme (``bucket/run/last.ckpt``) and then looks for them on the local disk, so
  "last" found nothing, and the run trained from scratch and wrote ``last-v1.ckpt`` beside the old
  files (Lightning #18261). The scheme is put back; the plugin loads the file.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from .._store.registry import LOCAL, scheme_of
from .._util import torch_private
from ..errors import ConfigError

_lock = threading.Lock()
_plugin_types: tuple[type, ...] = ()


def install(plugin_type: type) -> None:
    """Wrap ``ModelCheckpoint``'s ``setup`` and "last" lookup for Trainers that write through
    ``plugin_type`` (once per process; later calls only add the type)."""
    global _plugin_types
    with _lock:
        if _plugin_types:
            if plugin_type not in _plugin_types:
                _plugin_types = (*_plugin_types, plugin_type)
            return
        _plugin_types = (plugin_type,)
        set_up = ModelCheckpoint.setup

        @functools.wraps(set_up)
        def setup(self: ModelCheckpoint, trainer: Any, pl_module: Any, stage: str) -> None:
            set_up(self, trainer, pl_module, stage)
            _check_at_start(self, trainer, stage)

        ModelCheckpoint.setup = setup  # type: ignore[method-assign]
        torch_private.adjust_last_checkpoints(_with_scheme)


def plugin_of(trainer: Any) -> Any:
    """The plugin the trainer's strategy writes through (inside a wrapping one too), or None."""
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    for _ in range(4):  # AsyncCheckpointIO and its kind hold the one they wrap as .checkpoint_io
        if isinstance(io, _plugin_types):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


def _check_at_start(callback: ModelCheckpoint, trainer: Any, stage: str) -> None:
    if stage != "fit" or not callback.dirpath:
        return
    plugin = plugin_of(trainer)
    if plugin is None:
        return
    error: BaseException | None = None
    if trainer.is_global_zero:  # the rank Lightning saves on
        try:
            plugin.check_dir(callback.dirpath)
        except Exception as e:
            error = e
    # Every rank raises the same error, and none waits in a collective for one that raised.
    error = trainer.strategy.broadcast(error, src=0)
    if error is not None:
        raise error


def _with_scheme(callback: ModelCheckpoint, trainer: Any, found: set[str]) -> set[str]:
    """The ``last`` files found in a URL dirpath, with the URL's scheme (Lightning drops it)."""
    if not callback.dirpath or plugin_of(trainer) is None:
        return found
    try:
        scheme = scheme_of(callback.dirpath)
    except ConfigError:
        return found  # not a URL this plugin writes to: as Lightning found it
    if scheme == LOCAL:
        return found
    return {path if "://" in path else f"{scheme}://{path}" for path in found}
