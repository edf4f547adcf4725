"""Registering committed checkpoints after the fact (``safeckpt register ROOT``).

A registration that failed, did not finish, or never happened (a process killed
before its worker ran, a registrar added later) is done here, from the records
alone: the registrar each registration recorded is rebuilt from its
``to_json()`` (:func:`registrar_from_json`), or the caller passes one.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .._format.catalog import scan
from .._format.record import Record
from .._policy.retention import CheckpointInfo
from .._store.base import Store
from .._store.loc import Loc, as_root
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError
from .registrar import Registrar
from .worker import RETRIED, CommitInfo, is_best, register_one

# Registrar kinds a record can name, by import path: the core never imports an integration
# (safeckpt.mlflow imports mlflow lazily, but it is still a layer above this one).
KINDS = {
    "mlflow": "safeckpt.mlflow:MlflowRegistrar",
    "jsonl": "safeckpt._registration.registrar:JsonlIndexRegistrar",
}


def registrar_from_json(data: Mapping[str, Any]) -> Registrar:
    """Rebuild a registrar from its ``to_json()`` (dispatch on ``data["kind"]`` through ``KINDS``)."""
    kind = data.get("kind") if isinstance(data, Mapping) else None
    if kind not in KINDS:
        raise ConfigError(
            f"cannot rebuild a registrar of kind {kind!r} (known: {', '.join(map(repr, KINDS))}); pass the "
            "registrar explicitly."
        )
    module, _, name = KINDS[kind].partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls.from_json(data)


def register_pending(
    root: Loc | Store | str | os.PathLike[str], registrar: Registrar | None = None, *, step: int | None = None
) -> list[tuple[int, str]]:
    """(Re)register committed checkpoints of ``root``: ``(step, status)`` for each one tried.

    With ``step``: that checkpoint, whatever its registration says. Without:
    every one whose registration ``failed`` or is ``unfinished``, oldest first,
    and, when ``registrar`` is given, those with no registration at all that
    it wants (``should_register``). ``registrar`` None: rebuilt per record from
    the ``registrar`` its registration recorded (:func:`registrar_from_json`);
    a record without one gets status ``"no registrar"``. Registering is
    idempotent for registrars that look up before they create (MLflow does).
    Holds the sidecar lock for each record amend; safe while a job writes.
    """
    top = as_root(root)
    root = top.where
    catalog = scan(top)
    committed = catalog.committed
    lock = top.store.lock(timeout=300.0)
    try:
        if step is not None:
            if step not in committed:
                raise CheckpointNotFoundError(
                    f"there is no committed checkpoint of step {step} in {root}; see `safeckpt ls {root}`.",
                    step=step,
                    path=str(root),
                )
            chosen = [(committed[step], False)]
        else:
            chosen = _pending(committed.values(), registrar is not None)
        infos = [
            CheckpointInfo(e.step, e.record.metrics, e.record.time, e.record.pinned)
            for e in committed.values()
            if e.record is not None
        ]
        built: dict[str, Registrar] = {}
        results: list[tuple[int, str]] = []
        for entry, check in chosen:
            record = entry.record
            assert record is not None
            which = registrar if registrar is not None else _rebuilt(record, built)
            if which is None:
                results.append((record.step, "no registrar"))
                continue
            # The newest step counts as the run's final one for a registrar that chooses
            # (which="final"); one that registers every commit just registers it.
            info = CommitInfo.of(
                record.step,
                entry.path,
                record,
                top,
                is_best=is_best(record.step, infos, _record_retention(record)),
                final=record.step == catalog.latest_step and hasattr(which, "should_register"),
            )
            status = register_one(which, info, lock, check=check)
            if status is not None:
                results.append((record.step, status))
        for rebuilt in built.values():
            close = getattr(rebuilt, "close", None)
            if close is not None:
                close()
        return results
    finally:
        lock.close()


def _pending(entries: Iterable[Any], has_registrar: bool) -> list[tuple[Any, bool]]:
    chosen = []
    for entry in entries:
        registration = entry.record.registration if entry.record is not None else None
        if isinstance(registration, Mapping) and registration.get("status") in RETRIED:
            chosen.append((entry, False))
        elif registration is None and has_registrar:
            chosen.append((entry, True))
    return sorted(chosen, key=lambda c: c[0].record.time)


def _record_retention(record: Record) -> Any:
    from .._policy.retention import Retention

    try:
        return Retention.from_json(record.retention) if record.retention else None
    except (CheckpointError, TypeError):
        return None


def _rebuilt(record: Record, built: dict[str, Registrar]) -> Registrar | None:
    registration = record.registration
    data = registration.get("registrar") if isinstance(registration, Mapping) else None
    if not isinstance(data, Mapping):
        return None
    key = repr(sorted(data.items()))
    if key not in built:
        built[key] = registrar_from_json(data)
    return built[key]
