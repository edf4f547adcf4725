"""Lightning integration: :class:`SafeCheckpointIO` and :class:`ManagedCheckpoint`.

Lightning is an optional dependency (``pip install 'safeckpt[lightning]'``): the
core package never imports this module, and importing it without Lightning
raises an ``ImportError`` that says what to install.

* ``Trainer(plugins=[SafeCheckpointIO()])``: Lightning's own ``.ckpt`` files and
  ``ModelCheckpoint``, written asynchronously and atomically, with top-k removal
  that never races a queued or running write.
* ``Trainer(callbacks=[ManagedCheckpoint(dirpath, ...)])``:
  safeckpt's layout (``step_<N>`` directories through ``CheckpointManager``,
  sharded state through DCP, retention, records, registrar, auto-resume).

See ``docs/lightning.md`` for which to use when.
"""

from __future__ import annotations

try:
    import lightning  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "safeckpt.lightning needs the `lightning` package (2.4 or newer): pip install 'safeckpt[lightning]'."
    ) from e

from .callback import ManagedCheckpoint
from .checkpoint_io import SafeCheckpointIO, StorageOptionsError

__all__ = ["ManagedCheckpoint", "SafeCheckpointIO", "StorageOptionsError"]
