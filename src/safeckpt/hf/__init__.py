"""Hugging Face integration: :func:`attach` for the ``Trainer`` (and its subclasses: TRL's
trainers, your own), :func:`accelerator_state` for loops built on ``accelerate.Accelerator``.

``transformers`` and ``accelerate`` are optional dependencies (``pip install 'safeckpt[hf]'``):
the core package never imports this module, and importing it without them raises an
``ImportError`` that says what to install. See ``docs/huggingface.md``.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "safeckpt.hf needs the `transformers` and `accelerate` packages: pip install 'safeckpt[hf]'."
    ) from e

from .._util.hf_private import TrainerInternalsError
from .accelerator import accelerator_state, skip_batches
from .trainer import attach, manager_of

__all__ = ["TrainerInternalsError", "accelerator_state", "attach", "manager_of", "skip_batches"]
