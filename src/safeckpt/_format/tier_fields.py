"""What a record says of the tiers of a run with ``local_dir=`` (``docs/tiers.md``), typed.

Three optional fields of :class:`~safeckpt._format.record.Record`, each a JSON object in
``metadata.json``:

* ``part`` (:class:`Part`): with a local tier on each node's own disk, the local record of a
  node's part of a save;
* ``uploaded`` (:class:`Upload`): on a durable copy, when and from where it was uploaded; on a
  local copy, once its upload committed, when and to where;
* ``local`` (:class:`Lineage`): on a local commit, the durable root it follows (see
  :mod:`safeckpt._format.lineage`).

The JSON is what every earlier version wrote and reads, and a record read and written again (a
pin, an upload's mark) keeps it as it was: a key written as null stays null (``nulls``), an absent
one absent. A record is untrusted input, and one of these fields must never make a checkpoint
unloadable: a key of an unexpected type, or one this version does not know, is kept as read
(``others``) and written back as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_NONE: frozenset[str] = frozenset()
# The keys each field knows, and their JSON types.
_PART = {"id": (str,), "node": (int,), "nodes": (int,)}
_UPLOAD = {"at": (int, float), "to": (str,), "from": (str,), "tier": (str,), "seq": (int,), "id": (str,)}
_LINEAGE = {"root": (str,), "root_id": (str,), "tier": (str,), "after": (int,)}


def _split(
    raw: Mapping[str, Any], kinds: Mapping[str, tuple[type, ...]]
) -> tuple[dict[str, Any], frozenset[str], dict[str, Any]]:
    """``raw``'s known keys of the expected kinds, those of them that are null, and every other key
    as read."""
    known: dict[str, Any] = {}
    others: dict[str, Any] = {}
    for key, value in raw.items():
        expected = kinds.get(key)
        fits = value is None or (expected is not None and isinstance(value, expected))
        if expected is not None and fits and not isinstance(value, bool):
            known[key] = value
        else:
            others[key] = value
    return known, frozenset(k for k, v in known.items() if v is None), others


def _json(values: Mapping[str, Any], nulls: frozenset[str], others: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (JSON key -> value, in order) as written: each set one, each null one that was
    written as null, and every other key as read (a mistyped known key too, as it was)."""
    data = {k: v for k, v in values.items() if v is not None or k in nulls}
    data.update(others)
    return data


@dataclass(frozen=True)
class Part:
    """A node's part of a save: its files are those this node's ranks wrote, and the checkpoint is
    whole when every node holds its part of one save."""

    save: str | None
    """The save it is a part of: the name of that save's staging directory, the same on every node
    (JSON ``id``)."""
    node: int | None
    """This node's number (nodes are numbered by their lowest rank)."""
    nodes: int | None
    """How many nodes hold a part of the save."""
    nulls: frozenset[str] = field(default=_NONE, compare=False, repr=False)
    others: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Part:
        known, nulls, others = _split(raw, _PART)
        return cls(known.get("id"), known.get("node"), known.get("nodes"), nulls, others)

    def to_json(self) -> dict[str, Any]:
        return _json({"id": self.save, "node": self.node, "nodes": self.nodes}, self.nulls, self.others)


@dataclass(frozen=True)
class Upload:
    """Where a checkpoint's other copy is: on a durable copy, the local commit it is the upload of
    (``source``, ``tier``, ``seq``, and ``save`` for a save of several nodes' parts); on a local
    copy, its durable copy (``to``)."""

    at: float | None = None
    """When the upload committed (Unix time)."""
    to: str | None = None
    """On a local copy: its durable copy's location."""
    source: str | None = None
    """On a durable copy: the local copy's location (JSON ``from``)."""
    tier: str | None = None
    """On a durable copy: the identity of the local directory it came from (see ``lineage``)."""
    seq: int | None = None
    """On a durable copy: the local commit's sequence in that directory."""
    save: str | None = None
    """On a durable copy of several nodes' parts: the save (``Part.save``; JSON ``id``)."""
    nulls: frozenset[str] = field(default=_NONE, compare=False, repr=False)
    others: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def local_mark(cls, at: float, to: str) -> Upload:
        """What a local record says once its upload committed."""
        return cls(at=at, to=to)

    @classmethod
    def durable_copy(
        cls, at: float, source: str, *, tier: str | None, seq: int | None, save: str | None
    ) -> Upload:
        """What a durable record says of the local commit it is the upload of (its ``tier`` and
        ``seq`` written as null where unknown)."""
        return cls(at=at, source=source, tier=tier, seq=seq, save=save, nulls=frozenset({"tier", "seq"}))

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Upload:
        known, nulls, others = _split(raw, _UPLOAD)
        at = known.get("at")
        return cls(
            at=None if at is None else float(at),
            to=known.get("to"),
            source=known.get("from"),
            tier=known.get("tier"),
            seq=known.get("seq"),
            save=known.get("id"),
            nulls=nulls,
            others=others,
        )

    def to_json(self) -> dict[str, Any]:
        values = {
            "at": self.at,
            "from": self.source,
            "tier": self.tier,
            "seq": self.seq,
            "to": self.to,
            "id": self.save,
        }
        return _json(values, self.nulls, self.others)


@dataclass(frozen=True)
class Lineage:
    """What a local commit records of the durable root it follows (see
    :mod:`safeckpt._format.lineage`)."""

    root: str | None = None
    """The durable root's location."""
    root_id: str | None = None
    """The durable root's identity (its ``.root-id``), None where it had none yet."""
    tier: str | None = None
    """The local directory's own identity."""
    after: int | None = None
    """The ``seq`` of the durable root's newest commit when this one was saved (None: unknown)."""
    nulls: frozenset[str] = field(default=_NONE, compare=False, repr=False)
    others: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def stamped(cls, root: str, root_id: str | None, tier: str | None, after: int | None) -> Lineage:
        """What a local commit records as it is saved (each key written, null where unknown)."""
        return cls(root, root_id, tier, after, nulls=frozenset({"root_id", "tier", "after"}))

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Lineage:
        known, nulls, others = _split(raw, _LINEAGE)
        return cls(
            known.get("root"), known.get("root_id"), known.get("tier"), known.get("after"), nulls, others
        )

    def to_json(self) -> dict[str, Any]:
        values = {"root": self.root, "root_id": self.root_id, "tier": self.tier, "after": self.after}
        return _json(values, self.nulls, self.others)
