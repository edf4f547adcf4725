"""Uploading a save whose local copy is split across nodes (a local tier on each node's disk).

Each node's leader uploads its node's part of a save into one area of the
durable root's ``.staging/``, named by the save (``part.id``) and the run (so a
retry after a restart never writes into an abandoned area being deleted), the
same on every node. It then writes its marker there: ``.part-<node>``, the
files it put there and their checksums. Rank 0 commits the area once every node's marker is
in (the durable record lists the union), with the root's own protocol; the
other leaders learn of the commit from the durable record (its
``uploaded.id``). The upload threads never run collectives: an upload may take
longer than any collective's timeout.

A node whose part cannot be uploaded (its local copy is damaged) says so in its
marker (``lost``), and rank 0 then drops the whole save; a leader whose part
went up sees the area vanish without a commit and drops it too.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from .._format.layout import RECORD_NAME, Layout
from .._format.record import Record, read_record
from .._store.loc import Loc
from ..errors import CheckpointError, IncompleteCheckpointError

_MARKER = ".part-{node}"
# s between looks for the other nodes' markers, or for rank 0's commit: short at first (the parts
# go up side by side), then longer (each look is a request per missing node on object storage).
_POLL, _POLL_MAX = 0.2, 2.0
_WAIT_PER_TRY = 60.0  # s one try waits for them; then it counts as a failed try (retried)


class PartsNotIn(OSError):
    """Some nodes' parts are not in yet (or rank 0 has not committed yet): tried again."""


def area_of(layout: Layout, record: Record, run: str) -> Loc:
    """The durable staging area of a save's parts in this run (``run``: the same on every rank).
    Another run's area of the same save may still be in the root, being deleted as abandoned:
    a new run's upload never writes into it."""
    return layout.staging_dir(record.step, run + hashlib.sha256(str(record.part_id).encode()).hexdigest()[:6])


def of_run(name: str, run: str) -> bool:
    """Whether the staging name ``name`` is an area of run ``run`` (:func:`area_of`): in use by
    other nodes' leaders even before this rank claims the root, so never collected as a leftover."""
    return bool(run) and name.rpartition(".")[2].startswith(run)


def put_marker(area: Loc, record: Record, *, lost: str | None = None) -> None:
    """This node's part is in ``area`` (or, with ``lost``, never will be)."""
    node = _node_of(record)
    body: dict[str, Any] = {
        "node": node,
        "files": dict(record.files),
        "checksums": dict(record.checksums or {}),
    }
    if lost is not None:
        body = {"node": node, "lost": lost}
    (marker := area / _MARKER.format(node=node)).store.write_atomic(marker.key, json.dumps(body).encode())


def has_marker(area: Loc, record: Record) -> bool:
    return (area / _MARKER.format(node=_node_of(record))).entry() is not None


def _node_of(part: Record) -> int | None:
    return None if part.part is None else part.part.node


def nodes_of(part: Record) -> int:
    """How many nodes hold a part of the save ``part`` (a node's part record) is a part of."""
    return (part.part.nodes if part.part is not None else None) or 1


def whole_record(area: Loc, record: Record, *, should_stop: Callable[[], bool] | None) -> Record:
    """Rank 0: the save's record over every node's part, once every marker is in ``area`` (waits
    up to a try's length for them). Raises :class:`PartsNotIn` to be tried again, and
    :class:`IncompleteCheckpointError` when a node's part is lost."""
    nodes = nodes_of(record)
    deadline = time.monotonic() + _WAIT_PER_TRY
    found: dict[int, dict[str, Any]] = {}  # a marker is written once: read once
    pauses = _pauses()
    while True:
        found.update(_markers(area, [n for n in range(nodes) if n not in found]))
        lost = {n: m["lost"] for n, m in found.items() if "lost" in m}
        if lost:
            raise IncompleteCheckpointError(
                f"the part of step {record.step} on node(s) {', '.join(map(str, sorted(lost)))} cannot "
                f"be uploaded ({'; '.join(map(str, lost.values()))}), so the step is not durable",
                step=record.step,
            )
        if len(found) == nodes:
            break
        if time.monotonic() > deadline or (should_stop is not None and should_stop()):
            missing = sorted(set(range(nodes)) - set(found))
            raise PartsNotIn(f"the parts of step {record.step} from node(s) {missing} are not uploaded yet")
        time.sleep(next(pauses))
    files: dict[str, int] = {}
    checksums: dict[str, Any] = {}
    for marker in found.values():
        files.update(marker["files"])
        checksums.update(marker["checksums"])
    return Record.from_json(
        {**record.to_json(), "files": files, "checksums": checksums, "part": None},
        path=str(area / RECORD_NAME),
        step=record.step,
    )


def remove_markers(area: Loc, nodes: int) -> None:
    for node in range(nodes):
        marker = area / _MARKER.format(node=node)
        if marker.entry() is not None:
            marker.store.remove(marker.key)


def committed_part(layout: Layout, record: Record) -> Record | None:
    """The durable commit of the save ``record`` is a part of, if that is the root's copy of its step."""
    try:
        found = read_record(layout.step_dir(record.step))
    except (CheckpointError, OSError):
        return None
    if found is None or found.uploaded is None or found.uploaded.save != record.part_id:
        return None
    return found


def wait_committed(
    layout: Layout, area: Loc, record: Record, *, should_stop: Callable[[], bool] | None
) -> Record:
    """A node's leader, its part uploaded: until rank 0 commits the save (waits up to a try's
    length). :class:`PartsNotIn` to be tried again; :class:`IncompleteCheckpointError` when the
    save was dropped (its area gone, not committed)."""
    deadline = time.monotonic() + _WAIT_PER_TRY
    pauses = _pauses()
    while True:
        found = committed_part(layout, record)
        if found is not None:
            return found
        gone = not has_marker(area, record) and (area / RECORD_NAME).entry() is None
        if gone and committed_part(layout, record) is None:  # rank 0 writes the record, then commits
            raise IncompleteCheckpointError(
                f"step {record.step} was not committed in {layout.root}: another node's part of it "
                "could not be uploaded, so it is not durable",
                step=record.step,
            )
        if time.monotonic() > deadline or (should_stop is not None and should_stop()):
            raise PartsNotIn(f"step {record.step} is not committed in {layout.root} yet")
        time.sleep(next(pauses))


def _pauses() -> Iterator[float]:
    pause = _POLL
    while True:
        yield pause
        pause = min(pause * 1.5, _POLL_MAX)


def _markers(area: Loc, nodes: Iterable[int]) -> Mapping[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for node in nodes:
        marker = area / _MARKER.format(node=node)
        try:
            raw = marker.store.read_small(marker.key, limit=16 << 20, what="part marker")
        except FileNotFoundError:
            continue
        found[node] = json.loads(raw)
    return found
