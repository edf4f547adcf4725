"""Directories on an object store without rename: a directory that was committed or moved is an
*alias* of the *area* (the key prefix) its bytes were written under.

An object store has no rename, and copying a checkpoint's bytes to commit or prune it would
cost as much as writing them again. So a save's bytes stay where they were
written (its staging directory, the area), and the name it is committed or
moved to holds one small *marker* object naming that area in its metadata:

* ``<name>/metadata.json``: the record, the one commit object of a checkpoint,
  written last with ``If-None-Match: *`` (``If-Match`` when it replaces one);
* ``<name>/.dir``: a directory without a record (an abandoned save moved to the trash).

Each area that an alias took is *claimed* (``.claims/<area, quoted>`` names the
alias) before the alias is written, so a listing of the area's parent hides
it once committed. A move's claim names the alias it moves from too, on a
second line: cut after the claim, before the old marker is deleted, the area
still belongs to the old name, which still points at it. A claim counts only
while a name it names still points at the area: an area whose save was cut
before the commit, whose commit was replaced, or whose move was cut between the
old marker's deletion and the new one's write belongs to no name; it is shown
again, and collected. No two names share an area (a move deletes the old marker
before it writes the new one); one written by hand beside the claim's owner is
removed without the bytes the owner holds.

An area can also be *used* by a later checkpoint: a save that shares an earlier
checkpoint's data file of unchanged tensors names, in its record's ``contents``,
the area that holds the file instead of uploading it again, and its commit
object lists those areas (``safeckpt-uses``). Before the commit object is
written, the new name is added to each used area's claim; an area then counts as
held while any name its claim names points at it or uses it, so pruning,
start-up collection and ``safeckpt gc`` delete it only after the last checkpoint
that reads it is gone (see ``docs/format.md``, "Bytes shared between checkpoints").
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import quote, unquote

from .._format.layout import RECORD_NAME
from .._store.base import join
from .client import NotFound, ObjectClient
from .spread import Spread

AREA = "safeckpt-area"  # the marker's user metadata (x-amz-meta-safeckpt-area): the area's name
USES = "safeckpt-uses"  # a commit object's: the earlier areas whose data files its record names
DIR_MARK = ".dir"
CLAIMS = ".claims"
MARKERS = (RECORD_NAME, DIR_MARK)


@dataclass(frozen=True)
class Alias:
    area: str
    marker: str
    """``metadata.json`` or ``.dir``: which marker object names the area."""
    size: int
    """The marker's size (the record's, for a committed checkpoint)."""
    uses: tuple[str, ...] = ()
    """The earlier areas holding data files this checkpoint shares (its record names them)."""

    @classmethod
    def of(cls, metadata: Mapping[str, str], marker: str, size: int) -> Alias:
        """From a marker's user metadata (its ``AREA``, and ``USES`` where it shares files)."""
        uses = tuple(a for a in metadata.get(USES, "").split(",") if a)
        return cls(metadata[AREA], marker, size, uses)


def uses_metadata(uses: tuple[str, ...]) -> dict[str, str]:
    return {USES: ",".join(uses)} if uses else {}


def shared_in_record(data: bytes) -> dict[str, tuple[str, int]]:
    """The data files a record takes from earlier areas: name -> (area, size), from its
    ``contents`` (``from``) and ``files``; empty for a record that shares nothing."""
    try:
        record = json.loads(data)
        contents, files = record.get("contents") or {}, record.get("files") or {}
        out = {}
        for name, entry in contents.items():
            area = entry.get("from") if isinstance(entry, dict) else None
            if isinstance(area, str) and area and isinstance(files.get(name), int):
                out[name] = (area, files[name])
        return out
    except (ValueError, AttributeError, TypeError):
        return {}  # not a record safeckpt reads: its files are looked for in its own area


class Aliases:
    """Finding, making and retiring aliases of one root (``key`` maps a name to its object key)."""

    def __init__(self, client: ObjectClient, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self.spread = Spread(prefix)
        self._known: dict[str, Alias] = {}  # found since: a reader holds a record before its bytes
        self._plain: set[str] = set()  # made here as plain directories: never an alias (no HEADs)
        self._shared: dict[tuple[str, str], dict[str, tuple[str, int]]] = {}  # (name, area) -> shared

    def key(self, name: str) -> str:
        return self._prefix + name

    def find(self, name: str, *, fresh: bool = True) -> Alias | None:
        """The alias directory ``name`` is, or None for a plain prefix (or nothing)."""
        if not name or name in self._plain:
            return None
        if not fresh and name in self._known:
            return self._known[name]
        for marker in MARKERS:
            try:
                head = self._client.head(self.key(join(name, marker)))
            except NotFound:
                continue
            if not head.metadata.get(AREA):
                break  # a record written into a plain directory (a save not committed yet)
            found = self._known[name] = Alias.of(head.metadata, marker, head.size)
            return found
        self._known.pop(name, None)
        return None

    def declare_plain(self, name: str) -> None:
        """``name`` (and each directory above it) was made as a plain directory: a save's area or a
        container. Aliases are made only at the names a commit or a move goes to, which are never
        made as directories, so this holds for every process."""
        while name:
            self._plain.add(name)
            name = name.rpartition("/")[0]

    def learn(self, name: str, alias: Alias) -> None:
        """What ``name`` is an alias of, as this store just wrote it or read its marker."""
        self._known[name] = alias

    def forget(self, name: str) -> None:
        self._known.pop(name, None)

    # --- where a name's bytes are -------------------------------------------------------------------

    def file_key(self, name: str, *, fresh: bool = False) -> str:
        """The object key of file ``name``: under the area of the nearest directory on its way that
        is an alias, the marker itself for an alias's record, else the name as it is (a data file
        of a save's area one level lower, see :mod:`.spread`). An alias
        already found is trusted (``fresh`` looks again): a reader found it reading the record it
        holds, and a copy replaced since is told apart by that record (its files are gone or differ)."""
        parts = name.split("/")
        for i in range(1, len(parts)):
            directory = "/".join(parts[:i])
            alias = self.find(directory, fresh=fresh)
            if alias is not None:
                rest = "/".join(parts[i:])
                if rest == alias.marker:
                    return self.key(name)
                if alias.uses and rest in (shared := self.shared(directory, alias)):
                    return self.spread.key(self.key(join(shared[rest][0], rest)))
                return self.spread.key(self.key(join(alias.area, rest)))
        return self.spread.key(self.key(name))

    def dir_key(self, name: str, *, fresh: bool = True) -> tuple[str, Alias | None]:
        """The key prefix (ending in ``/``, or the root's) of directory ``name``, and its alias."""
        if not name:
            return self._prefix, None
        alias = self.find(name, fresh=fresh)
        if alias is not None:
            return self.key(alias.area) + "/", alias
        parent, _, leaf = name.rpartition("/")
        if parent:
            base, _ = self.dir_key(parent, fresh=fresh)
            return base + leaf + "/", None
        return self.key(name) + "/", None

    def shared(self, name: str, alias: Alias) -> dict[str, tuple[str, int]]:
        """The data files checkpoint ``name`` (``alias``) reads from earlier areas: file -> (area,
        size), from its record (read once per name and area)."""
        if not alias.uses or alias.marker != RECORD_NAME:
            return {}
        found = self._shared.get((name, alias.area))
        if found is None:
            data = self._client.get(self.key(join(name, alias.marker))).data
            named = shared_in_record(data).items()
            found = {file: (area, size) for file, (area, size) in named if area in alias.uses}
            self._shared[(name, alias.area)] = found
        return found

    # --- claims -----------------------------------------------------------------------------------

    def _claim_key(self, area: str) -> str:
        return self.key(join(CLAIMS, quote(area, safe="")))

    def _named(self, area: str) -> list[str]:
        try:
            return [n for n in self._client.get(self._claim_key(area)).data.decode().split("\n") if n]
        except NotFound:
            return []

    def claim(self, area: str, alias: str, *, moving_from: str | None = None) -> None:
        """``alias`` takes ``area`` (``moving_from``: the alias that holds it until the move ends).
        Names already there stay (the later checkpoints that use the area's files)."""
        names = [alias] if moving_from is None else [alias, moving_from]
        self._client.put(self._claim_key(area), "\n".join(names + self._others(area, names)).encode())

    def _others(self, area: str, names: list[str]) -> list[str]:
        return [n for n in self._named(area) if n not in names]

    def add_user(self, area: str, alias: str) -> None:
        """``alias`` is about to use ``area``'s files (written before its commit object)."""
        named = self._named(area)
        if alias not in named:
            self._client.put(self._claim_key(area), "\n".join([*named, alias]).encode())

    def drop(self, area: str, alias: str) -> None:
        """``alias`` no longer holds nor uses ``area`` (it is being removed, the area kept)."""
        named = self._named(area)
        if alias in named:
            self._client.put(self._claim_key(area), "\n".join(n for n in named if n != alias).encode())

    def holders(self, area: str, *, first: bool = False) -> list[str]:
        """The names that hold ``area`` now: named by its claim, and pointing at it or using it
        (``first``: stop at the first found)."""
        found = []
        for name in self._named(area):
            alias = self.find(name)
            if alias is not None and (alias.area == area or area in alias.uses):
                found.append(name)
                if first:
                    break
        return found

    def owner(self, area: str) -> str | None:
        """A name that holds ``area`` now (see :meth:`holders`), or None: the area is collectable."""
        held = self.holders(area, first=True)
        return held[0] if held else None

    def unclaim(self, area: str) -> None:
        with contextlib.suppress(NotFound):
            self._client.delete(self._claim_key(area))

    def held_under(self, directory: str) -> set[str]:
        """The areas directly under ``directory`` that an alias holds (hidden from its listing)."""
        start = quote(directory + "/", safe="") if directory else ""
        objects, _ = self._client.list(self.key(f"{CLAIMS}/{start}"), delimiter=None)
        areas = [unquote(key.rpartition("/")[2]) for key, _size in objects]
        areas = [area for area in areas if area.rpartition("/")[0] == directory]
        if len(areas) < 2:
            return {area for area in areas if self.owner(area) is not None}
        # Two round trips per area (its claim, its alias's marker): side by side.
        with ThreadPoolExecutor(min(len(areas), 8), thread_name_prefix="safeckpt-s3-claims") as pool:
            owners = list(pool.map(self.owner, areas))
        return {area for area, owner in zip(areas, owners, strict=True) if owner is not None}
