"""Model weights out of a checkpoint and back in (public): safetensors or a Hugging Face folder.

The implementation lives in :mod:`safeckpt._ops.export` and
:mod:`safeckpt._ops.weights_import`; this module is the public path the docs
name (``safeckpt.export.export_weights``, ``safeckpt.export.import_weights``).
"""

from ._ops.export import (
    DEFAULT_READ_BUDGET,
    DEFAULT_SHARD_SIZE,
    DTYPES,
    FORMATS,
    HF,
    INDEX_NAME,
    SAFETENSORS,
    ExportExistsError,
    ExportPlan,
    ExportResult,
    ExportTensor,
    export_weights,
    plan_export,
    write_export,
)
from ._ops.weights_import import import_weights, read_weights, weights_module

__all__ = [
    "DEFAULT_READ_BUDGET",
    "DEFAULT_SHARD_SIZE",
    "DTYPES",
    "FORMATS",
    "HF",
    "INDEX_NAME",
    "SAFETENSORS",
    "ExportExistsError",
    "ExportPlan",
    "ExportResult",
    "ExportTensor",
    "export_weights",
    "import_weights",
    "plan_export",
    "read_weights",
    "weights_module",
    "write_export",
]
