"""A checkpoint root under a URL of an object store (``s3://bucket/prefix``, ...): the
:class:`~safeckpt._store.Store` built on an :class:`~.client.ObjectClient`, once for every service.

What each operation of the seam becomes (see :mod:`safeckpt._store.base` for
the contract, and :mod:`.aliases` for how directories live without rename):

* ``commit_dir``: the area's claim, then the record as the commit object, a
  create-only PUT (replacing the old record's token when it replaces one, whose
  area then moves to ``retired``). No instant without a complete checkpoint at
  ``final``: the one PUT is the commit.
* ``move`` of a directory: the claim moved, the old marker deleted, the marker
  written at the new name; of a file: copied, then deleted.
* ``write_atomic``/``write_new``: one PUT (an object is replaced whole); a
  record of a committed checkpoint keeps its area in the rewritten marker.
* ``write_pointer``: ``latest``, replacing only the token this store last read
  or wrote, so a second writer's move is an error, never silently undone.
* ``remove``: the area's objects (in the batches the service allows, and any
  unfinished upload under it), only when no other alias holds or uses the area;
  likewise each earlier area the checkpoint used.
* sharing (``dcp_writer``'s ``reuse``): a data file of unchanged tensors the
  previous commit holds is not uploaded; the record names the area holding it,
  the commit object lists the areas it uses, and each such area's claim names the
  new checkpoint before its commit object is written (see :mod:`.aliases`).
* ``lock``: a lease renewed with conditional writes (:mod:`.lease`).
* ``sync``, ``make_dir``: nothing to do; an object is durable once its PUT
  returns, and prefixes need no making.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .._format.layout import DAMAGED_NAME, LATEST_NAME, LOCK_NAME, RECORD_NAME, STAGING_NAME, TRASH_NAME
from .._store.base import DIR, FILE, Entry, join, leaf
from ..errors import IncompleteCheckpointError
from .aliases import AREA, CLAIMS, DIR_MARK, Alias, Aliases, shared_in_record, uses_metadata
from .client import NotFound, ObjectClient, PreconditionFailed, put_new, put_over
from .lease import LeaseLock, check_held
from .spread import Spread
from .transfer import RangeReader, UploadStream

_POINTER_LIMIT = 4096
_MAX_AREAS_USED = 12  # earlier areas one checkpoint reads files of; beyond, files are uploaded again


@dataclass(frozen=True)
class Transfer:
    """How bytes move: parts of ``part_size`` (uploads and ranged GETs), ``max_concurrency`` at once
    per file."""

    part_size: int
    max_concurrency: int


class ObjectRootStore:
    """A checkpoint root under a URL of an object store (see the module docstring): everything but
    the requests, which ``client`` makes.

    ``url``: the root as a person names it (``s3://bucket/prefix``); ``prefix``: its key prefix
    (``""`` or ending in ``/``).
    """

    def __init__(self, client: ObjectClient, url: str, prefix: str, transfer: Transfer) -> None:
        self.url = url
        self.prefix = prefix
        self.settings = transfer
        self.small_reads_at_once = 8  # each a round trip: a scan's records are read side by side
        self.client = client
        self.aliases = Aliases(self.client, prefix)
        self._pointers: dict[str, str | None] = {}  # token of each pointer as last read or written
        self._guard = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def where(self, name: str = "") -> str:
        _check(name)
        return f"{self.url}/{name}" if name else self.url

    # --- names ---------------------------------------------------------------

    def entries(self, name: str = "") -> list[Entry]:
        _check(name)
        base, alias = self.aliases.dir_key(name)
        spread = self.aliases.spread
        in_area = spread.lists_an_area(base)  # its data files are one level down
        with ThreadPoolExecutor(1, thread_name_prefix="safeckpt-s3-list") as beside:
            unfinished = beside.submit(self.client.uploads, base)  # one round trip, not two
            objects, prefixes = self.client.list(base, delimiter=None if in_area else "/")
            uploads = unfinished.result()
        if in_area:  # everything below, in one listing: each object at its name, deeper ones as dirs
            objects, prefixes = _one_level(spread, base, objects)
        out: dict[str, Entry] = {}
        for key, size in objects:
            entry_name = key[len(base) :]
            out[entry_name] = Entry(entry_name, FILE, size)
        hidden = {CLAIMS} if not name else set()
        if alias is None and prefixes:  # committed areas among the subdirectories are not shown
            hidden |= {leaf(a) for a in self.aliases.held_under(name)}
        for upload_key, _ in uploads:
            rest = spread.name(upload_key)[len(base) :]
            if "/" in rest:
                prefixes.append(base + rest.split("/")[0] + "/")
        for prefix in prefixes:
            entry_name = prefix[len(base) :].rstrip("/")
            if entry_name not in hidden:
                out[entry_name] = Entry(entry_name, DIR)
        if alias is not None and alias.marker in out:
            out[alias.marker] = Entry(alias.marker, FILE, alias.size)  # the commit object's size
        if alias is not None and alias.uses:  # the files it reads from earlier areas are its own too
            for file, (area, _size) in self.aliases.shared(name, alias).items():
                try:
                    head = self.client.head(self.aliases.spread.key(self.aliases.key(join(area, file))))
                except NotFound:
                    continue  # missing: the record's check says so
                out[file] = Entry(file, FILE, head.size)
        out.pop(DIR_MARK, None)
        return sorted(out.values(), key=lambda e: e.name)

    def entry(self, name: str) -> Entry | None:
        _check(name)
        if not name:
            return Entry("", DIR)
        try:
            return Entry(leaf(name), FILE, self.client.head(self.aliases.file_key(name)).size)
        except NotFound:
            pass
        base, alias = self.aliases.dir_key(name)
        if alias is not None:
            return Entry(leaf(name), DIR)
        if self._holds_anything(base) and self.aliases.owner(name) is None:
            return Entry(leaf(name), DIR)
        return None  # nothing, or the area of a name it was moved or committed to: gone from here

    def _holds_anything(self, base: str) -> bool:
        """An object, or an unfinished upload (a save cut short leaves one), under ``base``."""
        return self.client.list(base, delimiter="/", limit=1) != ([], []) or bool(self.client.uploads(base))

    def unfinished_bytes(self, name: str) -> int:
        """Bytes in the parts of unfinished multipart uploads under directory ``name``: a save cut
        short leaves them, stored (and billed) until aborted, and in no listing of objects. Beside
        the seam: ``safeckpt gc`` reports them as the size of what it removes."""
        _check(name)
        base, _ = self.aliases.dir_key(name)
        return sum(self.client.upload_size(key, upload_id) for key, upload_id in self.client.uploads(base))

    def make_dir(self, name: str) -> None:
        _check(name)
        self.aliases.declare_plain(name)  # a prefix needs no making; it is known not to be an alias

    def move(self, src: str, dst: str) -> None:
        _check(src)
        _check(dst)
        self._check_lease()
        alias = self.aliases.find(src)
        if alias is not None:
            self._move_alias(src, dst, alias)
            return
        try:
            got = self.client.get(self.aliases.file_key(src, fresh=True))
        except NotFound:
            got = None
        if got is not None:
            self.client.put(self.aliases.file_key(dst, fresh=True), got.data, metadata=got.metadata)
            self.client.delete(self.aliases.file_key(src, fresh=True))
            self._pointers.pop(src, None)
            self._pointers.pop(dst, None)
            return
        base, _ = self.aliases.dir_key(src)
        if not self._holds_anything(base):
            raise NotFound(2, "nothing to move", self.where(src))
        if self.aliases.owner(src) is not None:
            # The area of a commit (one cut short after its commit object landed): its bytes are
            # that checkpoint's, never moved or collected by the area's own name.
            raise PreconditionFailed(self.where(src))
        # A plain directory (the area of a save) becomes an alias at dst, its bytes where they are.
        self.aliases.claim(src, dst)
        put_new(self.client, self.aliases.key(join(dst, DIR_MARK)), b"", metadata={AREA: src})
        self.aliases.learn(dst, Alias(src, DIR_MARK, 0))

    def _move_alias(self, src: str, dst: str, alias: Alias) -> None:
        """The old name's marker goes before the new one is written, so no two names ever share an
        area: cut short in between, the area belongs to no name and is collected as a leftover."""
        marker = self.aliases.key(join(src, alias.marker))
        got = self.client.get(marker)
        self.aliases.claim(alias.area, dst, moving_from=src)  # src keeps it until its marker goes
        for used in alias.uses:  # dst reads those files too, from before src stops pointing at them
            self.aliases.add_user(used, dst)
        self.client.delete(marker)  # the instant src leaves every listing
        self.aliases.forget(src)
        put_new(self.client, self.aliases.key(join(dst, alias.marker)), got.data, metadata=got.metadata)
        self.aliases.learn(dst, alias)
        for area in (alias.area, *alias.uses):  # src names nothing now: claims stay short
            self.aliases.drop(area, src)

    def commit_dir(self, staged: str, final: str, *, displaced: str, retired: str) -> bool:
        """The record of ``staged`` becomes ``final``'s commit object (see the module docstring).
        ``displaced`` is not used: the replacement of a record is one conditional PUT."""
        _check(staged)
        _check(final)
        del displaced
        self._check_lease()
        record = self.client.get(self.aliases.key(join(staged, RECORD_NAME)))
        uses = tuple(sorted({area for area, _ in shared_in_record(record.data).values()}))
        metadata = {AREA: staged, **uses_metadata(uses)}
        commit_key = self.aliases.key(join(final, RECORD_NAME))
        for used in uses:
            # Before the commit object: from the instant it exists, the areas it reads are held.
            if self.aliases.owner(used) is None:
                raise IncompleteCheckpointError(
                    f"{self.where(staged)} shares files of {self.where(used)}, which no checkpoint "
                    "holds any more; save again (its files are then uploaded).",
                    path=self.where(staged),
                )
            self.aliases.add_user(used, final)
        self.aliases.claim(staged, final)
        existed, replaced = False, None
        try:
            put_new(self.client, commit_key, record.data, metadata=metadata)
        except PreconditionFailed:
            existed, replaced = True, self.aliases.find(final)
            etag = self.client.head(commit_key).token
            put_over(self.client, commit_key, record.data, etag, metadata=metadata)
        self.aliases.learn(final, Alias(staged, RECORD_NAME, len(record.data), uses))
        if replaced is not None:
            # The old bytes go to the trash; cut short here, they show as a leftover and are collected.
            self.aliases.claim(replaced.area, retired)
            put_new(
                self.client, self.aliases.key(join(retired, DIR_MARK)), b"", metadata={AREA: replaced.area}
            )
        return existed

    def remove(self, name: str) -> None:
        _check(name)
        self._check_lease()
        alias = self.aliases.find(name)
        if alias is not None:
            # Only when the area's claim names this alias (every alias safeckpt makes claims its
            # area first) and the area is one save's or directory's, not a container or another
            # name: a marker written by hand, or damaged, never takes other checkpoints' bytes.
            for area in (alias.area, *alias.uses):
                self._release(area, name)
            self._delete_under(self.aliases.key(name) + "/")
            self.aliases.forget(name)
            return
        key = self.aliases.file_key(name, fresh=True)
        try:
            self.client.head(key)
        except NotFound:
            pass
        else:
            self.client.delete(key)
            return
        if self.aliases.owner(name) is not None:
            raise PreconditionFailed(self.where(name))  # committed bytes: never removed by their area's name
        if not self._delete_under(key + "/"):
            raise NotFound(2, "no such file or directory", self.where(name))
        self.aliases.unclaim(name)

    def _release(self, area: str, name: str) -> None:
        """``name``, being removed, holds or uses ``area``: its objects go with the last such name;
        while another one holds or uses it, only ``name`` leaves its claim."""
        holders = self.aliases.holders(area)
        if name not in holders:
            return
        if len(holders) > 1:
            self.aliases.drop(area, name)
        elif self._removable_area(area):
            self._delete_under(self.aliases.key(area) + "/")
            self.aliases.unclaim(area)

    def _removable_area(self, area: str) -> bool:
        """Whether ``area`` (read from a marker's metadata) names the bytes of one save or one plain
        directory: not the root, a container of areas or names (``.staging``, ``.trash``,
        ``.damaged``, the claims), a pointer, or another alias."""
        parts = area.split("/")
        if any(part in ("", ".", "..") for part in parts) or parts[0] == CLAIMS:
            return False
        if area in (STAGING_NAME, TRASH_NAME, DAMAGED_NAME, LATEST_NAME, LOCK_NAME):
            return False
        return self.aliases.find(area) is None

    def _delete_under(self, prefix: str) -> bool:
        """Every object and unfinished upload under ``prefix``; whether there was any."""
        objects, _ = self.client.list(prefix, delimiter=None)
        uploads = self.client.uploads(prefix)
        for key, upload_id in uploads:
            self.client.abort_upload(key, upload_id)
        self.client.delete_many(key for key, _ in objects)
        return bool(objects or uploads)

    def sync(self, name: str = "") -> None:
        _check(name)  # a PUT is durable once it returns

    # --- files -----------------------------------------------------------------

    def read_small(self, name: str, *, limit: int, what: str) -> bytes:
        _check(name)
        try:
            got = self.client.get(self.aliases.key(name))  # a plain file, or a commit object itself
        except NotFound:
            got = self.client.get(self.aliases.file_key(name))  # a file inside an alias's area
        else:
            parent, _, marker = name.rpartition("/")
            if AREA in got.metadata and parent:  # a restore reads the record first: its area, fresh
                self.aliases.learn(parent, Alias.of(got.metadata, marker, got.size))
        if got.size > limit:
            raise IncompleteCheckpointError(
                f"{self.where(name)} has {got.size} bytes, more than any {what} has ({limit}); it is "
                "damaged or not safeckpt's. Restore another checkpoint.",
                path=self.where(name),
            )
        return got.data

    def open_read(self, name: str) -> RangeReader:
        _check(name)
        return RangeReader(
            self.client,
            self.aliases.file_key(name),
            part_size=self.settings.part_size,
            concurrency=self.settings.max_concurrency,
        )

    def write_atomic(self, name: str, data: bytes) -> None:
        _check(name)
        self._check_lease()
        parent, _, file_name = name.rpartition("/")
        alias = self.aliases.find(parent) if parent else None
        if alias is not None and alias.marker == file_name:
            # A record rewritten (a pin): the commit object keeps naming its area.
            metadata = {AREA: alias.area, **uses_metadata(alias.uses)}
            self.client.put(self.aliases.key(name), data, metadata=metadata)
            self.aliases.learn(parent, dataclasses.replace(alias, size=len(data)))
            return
        self.client.put(self.aliases.file_key(name, fresh=True), data)

    def write_new(self, name: str, data: bytes) -> None:
        self.write_atomic(name, data)  # a PUT is both

    def write_stream(self, name: str, write: Callable[[Any], object]) -> None:
        """One upload: the object appears, whole, when it completes; aborted if ``write`` raises."""
        _check(name)
        with self.upload(self.aliases.file_key(name, fresh=True)) as stream:
            write(stream)

    def upload(self, key: str) -> UploadStream:
        return UploadStream(
            self.client, key, part_size=self.settings.part_size, concurrency=self.settings.max_concurrency
        )

    def read_pointer(self, name: str) -> str | None:
        _check(name)
        try:
            got = self.client.get(self.aliases.key(name))
        except NotFound:
            self._pointers[name] = None
            return None
        self._pointers[name] = got.token
        if got.size > _POINTER_LIMIT:
            return None
        try:
            return got.data.decode("utf-8").strip() or None
        except UnicodeDecodeError:
            return None

    def write_pointer(self, name: str, target: str) -> None:
        _check(name)
        self._check_lease()
        with self._guard:
            if name not in self._pointers:
                self.read_pointer(name)
            etag = self._pointers.get(name)
            key, data = self.aliases.key(name), target.encode()
            try:
                if etag is None:
                    self._pointers[name] = put_new(self.client, key, data)
                else:
                    self._pointers[name] = put_over(self.client, key, data, etag)
            except (PreconditionFailed, NotFound):  # changed, or removed (If-Match on no object)
                self._pointers.pop(name, None)  # read again before the next move
                raise

    # --- checkpoints' bytes (DCP) ------------------------------------------------

    def dcp_writer(self, directory: str, *, direct_io: bool, dcp_own: bool, reuse: Any = None) -> Any:
        from .dcp import writer

        del direct_io
        base, _ = self.aliases.dir_key(directory)
        share: Callable[[Any], bool] | None = None
        earlier = self.aliases.find(reuse.earlier_dir) if reuse is not None and reuse.earlier_dir else None
        if earlier is not None:
            # Where each earlier file's bytes are: the area that first wrote them (this is what the
            # new record's ``from`` names, and the area its commit then uses).
            files = tuple(
                dataclasses.replace(f, origin=f.contents.shared_from or earlier.area) for f in reuse.earlier
            )
            reuse = dataclasses.replace(reuse, earlier=files)
            origins: set[str] = set()

            def share(file: Any) -> bool:
                # The commit object's metadata lists every area used (S3 allows 2 KB of it).
                if file.origin not in origins and len(origins) >= _MAX_AREAS_USED:
                    return False
                if not self._share(file):
                    return False
                origins.add(file.origin)
                return True

        return writer(self, base.rstrip("/"), dcp_own=dcp_own, reuse=reuse, share=share)

    def _share(self, file: Any) -> bool:
        """Whether the earlier checkpoint's ``file`` is where its record says, whole: the new
        checkpoint then names it instead of uploading it (no request writes anything)."""
        key = self.aliases.spread.key(self.aliases.key(join(file.origin, file.name)))
        try:
            return self.client.head(key).size == file.size
        except NotFound:
            return False

    def dcp_reader(
        self,
        directory: str,
        *,
        checksums: Mapping[str, Any] | None,
        step: int | None,
        direct_io: bool,
        dcp_own: bool,
        metadata: Callable[[], Any],
    ) -> Any:
        from .dcp import ObjectDcpReader

        del direct_io, dcp_own  # one reader: ranged GETs, every item checked
        base, alias = self.aliases.dir_key(directory, fresh=False)
        keys = {}
        if alias is not None and alias.uses:  # files it shares with earlier checkpoints: where they are
            keys = {
                file: self.aliases.spread.key(self.aliases.key(join(area, file)))
                for file, (area, _) in self.aliases.shared(directory, alias).items()
            }
        return ObjectDcpReader(
            self,
            base.rstrip("/"),
            checksums=checksums,
            step=step,
            metadata=metadata,
            directory=directory,
            keys=keys,
        )

    def dcp_prefetch(self, directory: str, rank: int, *, direct_io: bool) -> Callable[[], None]:
        return _nothing  # reads are ranged GETs in parallel already; no page cache to warm

    # --- the root as a whole -------------------------------------------------------

    def _check_lease(self) -> None:
        """A write this thread makes under the root's lease: only while the lease surely holds."""
        check_held(self.client, self.aliases.key(LOCK_NAME))

    def lock(self, *, timeout: float) -> LeaseLock:
        return LeaseLock(self.client, self.aliases.key(LOCK_NAME), url=self.where(LOCK_NAME), timeout=timeout)

    def free_space(self) -> int | None:
        return None  # a bucket has no free space to tell

    def explain_error(self, error: OSError) -> tuple[str, str]:
        if isinstance(error, PreconditionFailed):
            return "another process changed the root at the same time (a conditional write lost)", (
                "make sure one training job writes to this root, then save again"
            )
        return self.client.explain(error)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def _one_level(
    spread: Spread, base: str, below: list[tuple[str, int]]
) -> tuple[list[tuple[str, int]], list[str]]:
    """Objects and sub-prefixes directly under ``base``, from every object below it (a spread data
    file counted at its name)."""
    objects, prefixes = [], set()
    for key, size in below:
        name = spread.name(key)
        rest = name[len(base) :]
        if "/" in rest:
            prefixes.add(base + rest.split("/")[0] + "/")
        else:
            objects.append((name, size))
    return objects, sorted(prefixes)


def _nothing() -> None:
    return None


def _check(name: str) -> None:
    if name and (name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/"))):
        raise ValueError(f"not a name inside a root: {name!r}")
