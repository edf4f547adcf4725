"""The one door to torch's (and Lightning's) private symbols: each guarded, each with a public fallback.

safeckpt's fast paths lean on names torch does not promise to keep. Every one
of them is looked up here, and nowhere else, inside a ``try``: a torch release
that moves or changes one turns its fast path off and the public fallback
runs, with the same files on disk and the same values restored. ``import
safeckpt`` never fails because of one. Checked against torch 2.13; the floor
in ``pyproject.toml`` is the oldest torch the test suite was run on.

=================================  ==========================================  ==============================
private symbol                     fast path (who uses it)                     public fallback
=================================  ==========================================  ==============================
``dcp._traverse.set_element``      a loaded non-tensor value into the nested   DCP's own walk, written
                                   state (``_dcp.io.SafeLoadPlanner``)          again (``public_fallbacks``)
``dcp.filesystem._StorageInfo``    the raw DCP writer's per-item storage info  DCP's ``FileSystemWriter``
``dcp.filesystem._StoragePrefix``  (``_storage.writer``; both pickled into     and ``FileSystemReader``
                                   ``.metadata`` by DCP itself)                 (same files, slower)
``torch.serialization._save``      ``data.pkl`` of each tensor archive          as above
                                   (``_storage.torchsave.writer``)
``torch._weights_only_unpickler``  ``data.pkl`` parsed onto a meta tensor      as above
``.Unpickler``                     (``_storage.torchsave.reader``)
``TypedStorage(_internal=True)``   that parse, without a deprecation warning   ``TypedStorage(...)``
``torch._foreach_copy_``           a run of small archives copied at once      one ``copy_`` per tensor
                                   (``_storage.runs``)
``distributed_c10d._world``        is a gloo group still registered            ``get_process_group_ranks``
                                   (``_dist.participants``)                     raises ``KeyError`` if not
``DTensor._local_tensor``          a DTensor's local shard, no autograd node   ``to_local()`` under no_grad
                                   (``_state``, ``_manager.background``)
``DTensor._spec`` + ``DTensor()``  a host staging buffer wrapped with a        ``DTensor.from_local`` (on a
                                   device DTensor's layout                     CPU mesh the same; on a
                                   (``_manager.background``)                   device mesh the buffer lives
                                                                               on the device)
``SavePlanner._cached_*``,         DCP's save-plan cache, per manager          every save plans in full
``planner._cached_plans_key``      (``_dcp.plans``)
=================================  ==========================================  ==============================

Lightning's, reached only when :mod:`safeckpt.lightning` calls them (Lightning
is imported inside each function, never when this module is imported):

=========================================  ===========================================================
private symbol                             public fallback
=========================================  ===========================================================
``trainer._checkpoint_connector``          the loops' own ``state_dict()`` and ``load_state_dict()``
``._get_loops_state_dict``,                (fit, validate, test, predict), each callback's, the
``._loaded_checkpoint`` + ``restore_*``    precision plugin's, the datamodule's and the schedulers',
``call._call_callbacks_state_dict``        called as the connector calls them (``public_fallbacks``)
``call._call_lightning_datamodule_hook``
``fabric.utilities.cloud_io._load``        ``torch.load`` of the (local) file
``ModelCheckpoint._find_last_checkpoints``  none: Lightning resolves ``fit(ckpt_path="last")`` alone,
                                           which on a URL dirpath finds nothing (Lightning #18261)
=========================================  ===========================================================

They sit here rather than in a door of ``safeckpt.lightning``: one list to
read when torch or Lightning moves something, and one switch for all of
them. The layer contract allows it (import-linter checks safeckpt's own
modules; Lightning is an external package it leaves out) and the rule that
the core never imports Lightning holds at run time: nothing here imports it
unless a ``safeckpt.lightning`` object calls in.

Not symbols safeckpt calls: ``_dcp.safe_metadata``'s restricted unpickler admits
``torch.serialization._get_layout`` and the two ``filesystem`` classes by name,
because DCP pickles them into ``.metadata``; a torch without them could not
read its own checkpoints either.

``SAFECKPT_TORCH_PRIVATE=0`` (read once, when this module is imported) turns
every private fast path off, torch's and Lightning's, and logs a WARNING saying
so: the fallbacks alone run. ``make test`` runs a part of the suite a second
time that way. It is for tests, and a way around a private helper that
misbehaves on some torch without changing code.
"""

from __future__ import annotations

import importlib
import logging
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import public_fallbacks

__all__ = [
    "ENABLED",
    "PLAN_CACHES",
    "StorageInfo",
    "StoragePrefix",
    "WeightsOnlyUnpickler",
    "adjust_last_checkpoints",
    "available",
    "callbacks_state_dict",
    "child_module",
    "datamodule_state_dict",
    "dtensor_local",
    "dtensor_with_local",
    "foreach_copy_",
    "group_is_live",
    "load_lightning_file",
    "loops_state_dict",
    "missing",
    "plan_caching",
    "restore_trainer_state",
    "set_element",
    "torch_save_records",
    "typed_storage",
]

logger = logging.getLogger(__name__)

SWITCH = "SAFECKPT_TORCH_PRIVATE"


def _switch_on() -> bool:
    value = os.environ.get(SWITCH, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


ENABLED = _switch_on()
"""False under ``SAFECKPT_TORCH_PRIVATE=0``: no private symbol is looked up, every fallback runs."""

if not ENABLED:
    logger.warning(
        "safeckpt: %s=0: torch's and Lightning's private fast paths are off; the public fallbacks "
        "run (same files, same values, slower)",
        SWITCH,
    )

_missing: dict[str, str] = {}  # name -> why its fast path is off (import error, switch)


def _private(module: str, name: str) -> Any:
    """``module``'s ``name`` (a dotted path of attributes), or None when the switch is off or it is gone."""
    if not ENABLED:
        _missing[f"{module}.{name}"] = f"{SWITCH}=0"
        return None
    try:
        return operator.attrgetter(name)(importlib.import_module(module))
    except Exception as e:  # ImportError, AttributeError, or whatever a half-moved module raises
        _missing[f"{module}.{name}"] = f"{type(e).__name__}: {e}"
        logger.debug("safeckpt: %s.%s is not available (%s); its public fallback runs", module, name, e)
        return None


# --- DCP: nested values on load ---------------------------------------------------------------


set_element: Callable[[Any, Sequence[Any], Any], None] = (
    _private("torch.distributed.checkpoint._traverse", "set_element") or public_fallbacks.set_element
)


# --- the raw DCP writer and reader (torch.save's archive, written and parsed by us) -------------

StorageInfo: Any = _private("torch.distributed.checkpoint.filesystem", "_StorageInfo")
"""DCP's per-item storage info (file, offset, length), or None: DCP's own writer runs."""
StoragePrefix: Any = _private("torch.distributed.checkpoint.filesystem", "_StoragePrefix")
"""DCP's per-rank file prefix, or None: DCP's own writer runs."""
torch_save_records: Any = _private("torch.serialization", "_save")
"""The pickling half of ``torch.save`` (any writer with ``write_record``), or None: DCP's own writer."""
WeightsOnlyUnpickler: Any = _private("torch._weights_only_unpickler", "Unpickler")
"""The unpickler of ``torch.load(weights_only=True)``, or None: DCP's own reader runs."""

_typed_storage_internal = ENABLED  # TypedStorage(_internal=True): no deprecation warning


def typed_storage(untyped: torch.UntypedStorage, dtype: torch.dtype) -> Any:
    """A ``TypedStorage`` over ``untyped``, made as torch's own unpickling makes it."""
    global _typed_storage_internal
    if _typed_storage_internal:
        try:
            return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        except TypeError as e:  # the keyword is gone: the public call (it may warn once)
            _missing["TypedStorage._internal"] = str(e)
            _typed_storage_internal = False
    elif not ENABLED:
        _missing["TypedStorage._internal"] = f"{SWITCH}=0"
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype)


def _copy_each(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``torch._foreach_copy_``'s effect, one ``copy_`` at a time."""
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


foreach_copy_: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], Any] = (
    _private("torch", "_foreach_copy_") or _copy_each
)


# --- modules --------------------------------------------------------------------------------------


def _child_public(module: torch.nn.Module, name: str) -> torch.nn.Module | None:
    if not name:
        return None  # get_submodule("") is the module itself; a child never has that name
    try:
        return module.get_submodule(name)
    except AttributeError:  # no such attribute, or one that is not a module
        return None


def _child_private(module: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return module._modules.get(name)
    except AttributeError:  # a torch whose Module keeps its children elsewhere
        return _child_public(module, name)


def _children_dict() -> bool:
    """Whether a Module keeps its children in the dict ``_modules`` (an instance attribute)."""
    if not ENABLED:
        _missing["torch.nn.Module._modules"] = f"{SWITCH}=0"
        return False
    if isinstance(getattr(torch.nn.Module(), "_modules", None), dict):
        return True
    _missing["torch.nn.Module._modules"] = "not a dict of children in this torch"
    return False


child_module: Callable[[torch.nn.Module, str], torch.nn.Module | None] = (
    _child_private if _children_dict() else _child_public
)
"""``module``'s direct child module ``name`` (``Module._modules``), or None."""


# --- process groups -----------------------------------------------------------------------------

_world_known = _private("torch.distributed.distributed_c10d", "_world") is not None


def group_is_live(group: Any) -> bool:
    """Whether ``group`` is still registered (not destroyed yet). Call only with ``dist`` initialized."""
    import torch.distributed as dist

    if _world_known:
        try:
            return group in dist.distributed_c10d._world.pg_map
        except AttributeError:
            pass
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


# --- DTensor --------------------------------------------------------------------------------------


def _dtensor_class() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


def _has_slot(name: str) -> bool:
    """Whether DTensor still has the attribute ``name`` (a slot: every DTensor carries it)."""
    return _private("torch.distributed.tensor", f"DTensor.{name}") is not None


def _local_public(tensor: Any) -> torch.Tensor:
    """A DTensor's local shard through ``to_local()`` (without grad mode: no autograd node)."""
    with torch.no_grad():
        return tensor.to_local()


dtensor_local: Callable[[Any], torch.Tensor] = (
    operator.attrgetter("_local_tensor") if _has_slot("_local_tensor") else _local_public
)
"""A DTensor's local tensor (the object itself on the fast path, a view sharing it otherwise)."""

_spec_known = _has_slot("_spec")


def dtensor_with_local(like: Any, local: torch.Tensor) -> Any:
    """A DTensor with ``like``'s mesh, placements and global shape around ``local``, which stays
    where it is (a host buffer in a device DTensor) on the fast path. The fallback,
    ``DTensor.from_local``, moves ``local`` to the mesh's device: on a CPU mesh nothing
    changes; on a device mesh the buffer is a device copy (same values saved, more device memory)."""
    DTensor = _dtensor_class()
    if _spec_known:
        try:
            return DTensor(local, like._spec, requires_grad=False)
        except (AttributeError, TypeError):
            pass
    with torch.no_grad():
        return DTensor.from_local(
            local,
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )


# --- DCP's save-plan cache --------------------------------------------------------------------

PLAN_CACHES = ("save_plan", "all_plans", "global_plan", "metadata", "final_save_plan")


class PlanCaching:
    """DCP's class-level save-plan caches (``SavePlanner._cached_<name>``, each a dict by key) and
    the key a planner files its plans under (``_cached_plans_key``)."""

    def __init__(self, planner_class: Any) -> None:
        self._class = planner_class

    def cache(self, name: str) -> dict[str, Any]:
        """The cache ``name`` (one of ``save_plan``, ``all_plans``, ``global_plan``, ``metadata``,
        ``final_save_plan``), looked up each time: torch may replace it."""
        return getattr(self._class, f"_cached_{name}")

    def forget(self, key: str) -> None:
        for name in PLAN_CACHES:
            getattr(self._class, f"_cached_{name}", {}).pop(key, None)

    @staticmethod
    def use_key(planner: Any, key: str) -> None:
        """File ``planner``'s plans under ``key`` (DCP's default is the class name, shared)."""
        planner._cached_plans_key = key


def _plan_caching() -> PlanCaching | None:
    import inspect

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner

    module = "torch.distributed.checkpoint.planner"
    caches = [_private(module, f"SavePlanner._cached_{name}") for name in PLAN_CACHES]
    if any(not isinstance(c, dict) for c in caches):
        return None
    # The key is an instance attribute DefaultSavePlanner.__init__ sets when it caches.
    if "enable_plan_caching" not in inspect.signature(DefaultSavePlanner.__init__).parameters:
        _missing["DefaultSavePlanner(enable_plan_caching=)"] = "not in this torch"
        return None
    planner = DefaultSavePlanner(enable_plan_caching=True)
    if not isinstance(getattr(planner, "_cached_plans_key", None), str):
        _missing["DefaultSavePlanner._cached_plans_key"] = "not in this torch"
        return None
    return PlanCaching(SavePlanner)


plan_caching: PlanCaching | None = _plan_caching()
"""DCP's plan caching as :mod:`safeckpt._dcp.plans` was written against it, or None: plan in full."""


# --- Lightning (imported only when called) -------------------------------------------------------

_lightning: dict[str, Any] = {}


def _lightning_private(module: str, name: str) -> Any:
    """A Lightning private, looked up on first use (Lightning imported then), or None."""
    key = f"{module}:{name}"
    if key not in _lightning:
        _lightning[key] = _private(module, name)
    return _lightning[key]


def _connector(trainer: Any, *needed: str) -> Any:
    """The trainer's checkpoint connector if it has every one of ``needed``, else None."""
    if not ENABLED:
        _missing["Trainer._checkpoint_connector"] = f"{SWITCH}=0"
        return None
    connector = getattr(trainer, "_checkpoint_connector", None)
    if connector is None or not all(hasattr(connector, name) for name in needed):
        _missing["Trainer._checkpoint_connector"] = f"lacks one of {needed}"
        return None
    return connector


def loops_state_dict(trainer: Any) -> dict[str, Any]:
    """The state of the trainer's four loops, as Lightning puts it in a checkpoint (``"loops"``)."""
    connector = _connector(trainer, "_get_loops_state_dict")
    if connector is not None:
        return connector._get_loops_state_dict()
    return {name: getattr(trainer, name).state_dict() for name in _LOOPS}


_LOOPS = ("fit_loop", "validate_loop", "test_loop", "predict_loop")


def callbacks_state_dict(trainer: Any) -> dict[str, Any]:
    """Every callback's non-empty ``state_dict()``, by its ``state_key`` (a checkpoint's ``"callbacks"``)."""
    private = _lightning_private("lightning.pytorch.trainer.call", "_call_callbacks_state_dict")
    if private is not None:
        return private(trainer)
    states = {}
    for callback in trainer.callbacks:
        state = callback.state_dict()
        if state:
            states[callback.state_key] = state
    return states


def datamodule_state_dict(trainer: Any) -> Any:
    """The datamodule's ``state_dict()`` (call only with a datamodule), profiled as Lightning does."""
    private = _lightning_private("lightning.pytorch.trainer.call", "_call_lightning_datamodule_hook")
    if private is not None:
        return private(trainer, "state_dict")
    return trainer.datamodule.state_dict()


_RESTORES = (
    "restore_datamodule",
    "restore_callbacks",
    "restore_precision_plugin_state",
    "restore_loops",
    "restore_lr_schedulers",
)


def restore_trainer_state(trainer: Any, loaded: dict[str, Any]) -> None:
    """What ``Trainer.fit(ckpt_path=...)`` restores after the weights and optimizers: datamodule,
    callbacks, precision plugin, loops, LR schedulers, from ``loaded`` (a checkpoint dict
    without weights). Leaves the trainer with nothing of it to restore again."""
    connector = _connector(trainer, "_loaded_checkpoint", *_RESTORES)
    if connector is not None:
        connector._loaded_checkpoint = loaded
        try:
            for name in _RESTORES:
                getattr(connector, name)()
        finally:
            connector._loaded_checkpoint = {}  # so the Trainer's own restore has nothing left to do
        return
    public_fallbacks.restore_trainer_state(trainer, loaded)


def load_lightning_file(path: os.PathLike[str], *, map_location: Any, weights_only: bool | None) -> Any:
    """``torch.load`` of a local ``.ckpt`` file, as Lightning's own loader does it."""
    private = _lightning_private("lightning.fabric.utilities.cloud_io", "_load")
    if private is not None:
        return private(path, map_location=map_location, weights_only=weights_only)
    with open(path, "rb") as f:
        return torch.load(f, map_location=map_location, weights_only=weights_only)


_last_adjusted: list[bool] = []  # whether adjust_last_checkpoints took, once decided


def adjust_last_checkpoints(adjust: Callable[[Any, Any, set[str]], set[str]]) -> bool:
    """Pass what every ``ModelCheckpoint`` finds for ``fit(ckpt_path="last")`` through
    ``adjust(callback, trainer, found)``; once per process (later calls change nothing). Whether
    it took: not where the method is gone or the switch is off (Lightning's own lookup runs)."""
    if _last_adjusted:
        return _last_adjusted[0]
    from lightning.pytorch.callbacks import ModelCheckpoint

    name = "ModelCheckpoint._find_last_checkpoints"
    found_by = getattr(ModelCheckpoint, "_find_last_checkpoints", None) if ENABLED else None
    if found_by is None:
        _missing[name] = f"{SWITCH}=0" if not ENABLED else "not in this Lightning"
        _last_adjusted.append(False)
        return False

    def find_last(self: Any, trainer: Any) -> set[str]:
        return adjust(self, trainer, set(found_by(self, trainer)))

    ModelCheckpoint._find_last_checkpoints = find_last  # type: ignore[method-assign]
    _last_adjusted.append(True)
    return True


# --- what is on -----------------------------------------------------------------------------------


def available() -> dict[str, bool]:
    """Each torch fast path, and whether it runs (False: its public fallback does). Lightning's are
    looked up when first used and are not listed before."""
    return {
        "set_element": set_element is not public_fallbacks.set_element,
        "raw DCP storage (_StorageInfo, _StoragePrefix, _save, weights-only Unpickler)": None
        not in (StorageInfo, StoragePrefix, torch_save_records, WeightsOnlyUnpickler),
        "TypedStorage(_internal=True)": _typed_storage_internal,
        "_foreach_copy_": foreach_copy_ is not _copy_each,
        "distributed_c10d._world": _world_known,
        "DTensor._local_tensor": dtensor_local is not _local_public,
        "DTensor._spec": _spec_known,
        "Module._modules": child_module is _child_private,
        "save-plan caching": plan_caching is not None,
    }


def missing() -> dict[str, str]:
    """Each private symbol found missing so far, with why (an import error, the switch)."""
    return dict(_missing)
