"""Which tier holds each checkpoint of a run with two tiers (``safeckpt ls --local-dir``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .._format.catalog import Catalog, Entry, settled_scan
from .._format.layout import parse_staging_name
from .._format.record import same_checkpoint
from .._store.loc import Loc, as_root


@dataclass(frozen=True)
class Tiers:
    in_both: frozenset[int]
    """Steps whose local copy is the root's (the same bytes)."""
    local_only: tuple[Entry, ...]
    """Local commits the root does not hold, by step."""
    uploading: frozenset[int]
    """Steps of ``local_only`` with a save in the root's ``.staging/`` (an upload under way)."""


def compare_tiers(durable: Catalog, local_dir: Loc | str | os.PathLike[str]) -> Tiers:
    """``durable`` (the root's catalog) against the committed checkpoints of ``local_dir``."""
    local = {e.step: e for e in settled_scan(as_root(local_dir)).entries if e.committed and e.record}
    there = {e.step: e.record for e in durable.entries if e.committed and e.record}
    in_both = frozenset(
        s for s, e in local.items() if e.record and (r := there.get(s)) and same_checkpoint(e.record, r)
    )
    local_only = tuple(e for s, e in sorted(local.items()) if s not in in_both)
    staged = {parse_staging_name(p.name) for p in durable.staging}
    return Tiers(in_both, local_only, frozenset(e.step for e in local_only if e.step in staged))
