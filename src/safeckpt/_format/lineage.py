"""Which durable root a local commit belongs to, and whether that root has moved on past it.

With two tiers (``local_dir=``) a local commit is a step ahead of one durable
root, from one state of it. So each local commit records (``Record.local``):

* ``root`` and ``root_id``: the durable root it belongs to, by its location and
  by the identity written in it once (``.root-id``, made by its first writer
  with a local tier); a root removed and made again at the same place is
  another root;
* ``tier``: the identity of the local directory itself (its own ``.root-id``),
  which the durable copy of each of its uploads names (``uploaded.tier``, with
  the local commit's ``seq`` as ``uploaded.seq``);
* ``after``: the sequence of the durable root's newest commit when it was saved.

A local commit is *behind* when the root holds a commit made after the one it
followed that is not an upload of an earlier commit of the same local
directory: another node went on from the root meanwhile, and uploading this
copy would roll the root back. Which commit is newer is decided by the root's
own sequence and the local directory's, never by the clocks of two hosts.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable

from .._store.base import Lock
from .._store.loc import Loc
from .record import Record, same_checkpoint
from .tier_fields import Lineage

ROOT_ID_NAME = ".root-id"


def read_root_id(root: Loc) -> str | None:
    """The identity written in ``root``, or None when it has none (or an unreadable one)."""
    name = root / ROOT_ID_NAME
    try:
        raw = name.store.read_small(name.key, limit=4096, what="root identity")
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        found = json.loads(raw).get("id")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, str) and found else None


def ensure_root_id(root: Loc, lock: Lock) -> str:
    """The identity of ``root``, written first if it has none. Its writer only, under its lock."""
    with lock:
        found = read_root_id(root)
        if found is not None:
            return found
        made = uuid.uuid4().hex
        name = root / ROOT_ID_NAME
        name.store.write_atomic(name.key, (json.dumps({"id": made}) + "\n").encode())
        return made


def stamp(root: str, root_id: str | None, tier: str | None, after: int | None) -> Lineage:
    """What a local commit records of its durable root (see the module's docstring)."""
    return Lineage.stamped(root, root_id, tier, after)


def root_of(record: Record) -> str | None:
    """The durable root a local commit was saved for, as it says (for messages)."""
    if record.local is not None:
        return str(record.local.root)
    to = record.uploaded.to if record.uploaded is not None else None
    return None if to is None else to.rpartition("/")[0]


def belongs(record: Record, root: str, root_id: str | None) -> bool:
    """Whether the local commit ``record`` was saved for the durable root at ``root`` whose
    identity is ``root_id`` (None: it has none yet). The identities decide where both are known;
    else the locations. A commit of a safeckpt that recorded no root belongs to the root it was
    uploaded to, or, not uploaded, to any (as it did then)."""
    local = record.local
    if local is None:
        to = record.uploaded.to if record.uploaded is not None else None
        return to is None or to.startswith(root.rstrip("/") + "/")
    if local.root_id and root_id:
        return local.root_id == root_id
    return str(local.root) == root


def uploaded_from(durable: Record, tier: str | None) -> int | None:
    """The local ``seq`` of the commit of local directory ``tier`` that ``durable`` is the upload
    of; None when it is not one (a save made in the root directly, or another node's upload)."""
    up = durable.uploaded
    if tier is None or up is None or up.tier != tier:
        return None
    return up.seq


def moved_on(record: Record, durable: Iterable[Record]) -> Record | None:
    """The commit of the durable root (whose commits are ``durable``) that the local commit
    ``record`` is behind, or None when it is not behind (see the module's docstring). A root that
    holds ``record`` itself (the same step and bytes) is never moved on past it."""
    commits = sorted(durable, key=lambda r: (r.seq or 0, r.step))
    if any(same_checkpoint(r, record) for r in commits):
        return None
    local = record.local
    if local is None:  # recorded before local commits named their root: only the clocks are left
        newest = commits[-1] if commits else None
        return newest if newest is not None and newest.time > record.time else None
    after = local.after or 0
    for r in commits:
        if (r.seq or 0) <= after:
            continue
        mine = uploaded_from(r, local.tier)
        if mine is None or record.seq is None or mine >= record.seq:
            return r  # made elsewhere, or from a later commit of this directory
    return None


def newer_local(local: Record, durable: Record) -> bool:
    """Whether the local commit ``local`` (not behind its root) is the same as or newer than the
    durable commit ``durable``, by the root's sequence: one not uploaded yet is newer than all the
    root holds; an uploaded one stands where its durable copy was committed."""
    if local.uploaded is None:
        return True
    seq = local.uploaded.seq
    if seq is not None:
        return seq >= (durable.seq or 0)
    # Marked by a safeckpt that did not note where its durable copy stands: the same commit, or
    # else the root's (its copy there was pruned, or the root went on).
    return same_checkpoint(local, durable)
