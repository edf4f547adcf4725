"""What every store must do, written once and run against each (as fsspec's abstract tests are).

Five stores: the local one (POSIX), S3 on the moto server, GCS on fake-gcs-server, Azure Blob on
Azurite, and an in-memory object store whose
client is written outside the package and registered through ``safeckpt.storage`` (a new
backend proves itself the same way: by passing this file). The seam's guarantees
(``safeckpt._store.base``): whole files replaced atomically, names listed by kind and size,
moves, removal, ``latest``, the lock, every byte verified on read, and a commit cut short at
any point of its sequence leaving the root as the last commit left it.

A kill is played by a store that stops reaching its storage after its N-th change (a
``Killed`` raised from then on, nothing cleaned up): what a ``kill -9`` leaves. The managers'
own kill -9 tests (test_crash.py, test_s3_crash.py) kill real processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import memory_objects
import safeckpt
import safeckpt.storage as storage
from faults import FaultyFileOps
from safeckpt import CheckpointManager, CorruptCheckpointError, LockTimeoutError, Retention
from safeckpt._format.catalog import scan
from safeckpt._format.checksums import FileChecksum
from safeckpt._format.layout import PRUNED, REPLACED, Layout, step_dirname
from safeckpt._format.record import Record, write_record
from safeckpt._objstore import lease as object_lease
from safeckpt._root.removal import Deleter
from safeckpt._root.startup import take_root
from safeckpt._store.base import DIR, FILE
from safeckpt._store.loc import Loc
from safeckpt._store.registry import open_store

KINDS = ["posix", "s3", "memory", "gcs", "azure"]


class Killed(BaseException):
    """The process died here: nothing it does after this reaches the storage."""


class Kind:
    """One store under test: its root URL, a fresh store on it (as a new process opens it), and one
    that dies after its N-th change."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url

    def fresh(self) -> Any:
        if self.name == "posix":
            from safeckpt._posix.store import PosixStore

            return PosixStore(Path(self.url))
        if self.name == "memory":
            return memory_objects.open_root(self.url)
        # A new store each time, as a new process opens it (open_store keeps one per URL).
        from safeckpt._azure import open_root as azure
        from safeckpt._gcs import open_root as gcs
        from safeckpt._s3 import open_root as s3

        return {"s3": s3, "gcs": gcs, "azure": azure}[self.name](self.url)

    def dying(self, after: int) -> Any:
        """A fresh store that makes ``after`` changes, then dies."""
        budget = [after]

        def spend() -> None:
            if budget[0] <= 0:
                raise Killed
            budget[0] -= 1

        if self.name == "posix":
            from safeckpt._posix.store import PosixStore

            return PosixStore(Path(self.url), _DyingFileOps(spend))
        store = self.fresh()
        store.client = _DyingClient(store.client, spend)
        store.aliases._client = store.client
        return store


class _DyingFileOps(FaultyFileOps):
    def __init__(self, spend: Callable[[], None]) -> None:
        super().__init__()
        self._spend = spend

    def _enter(self, op: str, paths: Any, seconds: float | None = None) -> Any:
        if op in ("write_file", "replace", "exchange", "symlink", "rmtree"):
            self._spend()
        return super()._enter(op, paths, seconds)


class _DyingClient:
    """An object client whose changes stop reaching the server after its budget."""

    _CHANGES = (
        "put",
        "delete",
        "delete_many",
        "start_upload",
        "upload_part",
        "finish_upload",
        "abort_upload",
    )

    def __init__(self, real: Any, spend: Callable[[], None]) -> None:
        self._real = real
        self._spend = spend

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in self._CHANGES:
            return attr

        def change(*args: Any, **kwargs: Any) -> Any:
            self._spend()
            return attr(*args, **kwargs)

        return change


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Kind]:
    monkeypatch.setattr(object_lease, "LEASE_SECONDS", 2.0)  # a lease left by a "killed" store
    if request.param == "posix":
        root = tmp_path / "root"
        root.mkdir()
        yield Kind("posix", str(root))
    elif request.param == "s3":
        yield Kind("s3", request.getfixturevalue("s3_bucket").url("root"))
    elif request.param == "gcs":
        yield Kind("gcs", request.getfixturevalue("gcs_bucket").url("root"))
    elif request.param == "azure":
        yield Kind("azure", request.getfixturevalue("azure_container").url("root"))
    else:
        memory_objects.register()  # from outside the package, through the public API
        yield Kind("memory", f"memory://conformance-{time.monotonic_ns()}/root")


# --- files ---------------------------------------------------------------------------------------


def test_a_file_is_replaced_whole_and_read_back(kind: Kind) -> None:
    store = kind.fresh()
    store.make_dir("a")  # a parent is made before its files (the contract; an object store needs none)
    store.write_atomic("a/f", b"first")
    assert store.read_small("a/f", limit=100, what="f") == b"first"
    store.write_atomic("a/f", b"second, longer")
    assert store.read_small("a/f", limit=100, what="f") == b"second, longer"
    with pytest.raises(safeckpt.CheckpointError):
        store.read_small("a/f", limit=3, what="f")  # larger than any file of its kind
    with pytest.raises(FileNotFoundError):
        store.read_small("a/missing", limit=100, what="f")


def test_a_stream_appears_whole_when_it_is_closed(kind: Kind) -> None:
    store = kind.fresh()
    data = bytes(range(256)) * 4096  # 1 MiB
    store.make_dir("s")
    store.write_stream("s/big", lambda f: (f.write(data[:1000]), f.write(data[1000:])))
    with store.open_read("s/big") as handle:
        assert handle.size == len(data)
        assert bytes(handle.read(1000, 5000)) == data[1000:6000]
    with pytest.raises(RuntimeError):  # a writer that fails leaves nothing
        store.write_stream("s/broken", lambda f: (f.write(b"x" * 10), _raise(RuntimeError("no"))))
    assert store.entry("s/broken") is None


def _raise(error: BaseException) -> None:
    raise error


def test_names_are_listed_by_kind_and_size(kind: Kind) -> None:
    store = kind.fresh()
    store.make_dir("d/sub")
    store.write_atomic("d/one", b"1")
    store.write_atomic("d/sub/two", b"22")
    listed = {e.name: (e.kind, e.size) for e in store.entries("d")}
    assert listed["one"] == (FILE, 1) and listed["sub"][0] == DIR
    assert store.entry("d/sub/two") is not None and store.entry("d/sub/two").size == 2  # type: ignore[union-attr]
    assert store.entry("d/nothing") is None
    assert [e.name for e in store.entries("nothing-here")] == []


def test_latest_is_a_pointer_replaced_whole(kind: Kind) -> None:
    store = kind.fresh()
    assert store.read_pointer("latest") is None
    store.write_pointer("latest", "step_1")
    store.write_pointer("latest", "step_2")
    assert kind.fresh().read_pointer("latest") == "step_2"


def test_a_directory_moves_and_is_removed_whole(kind: Kind) -> None:
    store = kind.fresh()
    store.make_dir("x/g")
    store.write_atomic("x/f", b"f")
    store.write_atomic("x/g/h", b"h")
    store.move("x", "y")
    assert store.entry("x") is None and store.read_small("y/g/h", limit=10, what="h") == b"h"
    store.remove("y")
    assert store.entry("y") is None and kind.fresh().entry("y") is None
    with pytest.raises(FileNotFoundError):
        store.remove("y")


# --- the lock -------------------------------------------------------------------------------------


def test_the_lock_is_reentrant_and_excludes_another_thread(kind: Kind) -> None:
    store = kind.fresh()
    lock = store.lock(timeout=5)
    other: list[str] = []

    def try_it() -> None:
        try:
            with store.lock(timeout=0.3):
                other.append("taken")
        except LockTimeoutError:
            other.append("refused")

    with lock:
        with lock:
            assert lock.held()
        thread = threading.Thread(target=try_it)
        thread.start()
        thread.join()
    assert other == ["refused"] and not lock.held()
    try_it()
    assert other == ["refused", "taken"]


# --- checkpoints: the commit and a kill at each point of it -----------------------------------------------


def _stage(store: Any, step: int, seq: int) -> tuple[Loc, Record]:
    """A save's files in ``.staging``, as a writer leaves them before its commit; its record."""
    layout = Layout(Loc(store, ""))
    staged = layout.staging_dir(step, f"{seq:012x}")
    data = _data(step)
    store.make_dir(staged.key)
    store.write_stream((staged / "__0_0.distcp").key, lambda f: f.write(data))
    record = Record(
        step=step,
        time=1.0e9 + step,
        files={"__0_0.distcp": len(data)},
        checksums={"__0_0.distcp": FileChecksum.whole(data).to_json()},
        seq=seq,
    )
    return staged, record


def _data(step: int) -> bytes:
    return f"data of step {step}".encode() * 100


def _commit(store: Any, step: int, seq: int) -> None:
    """The commit sequence (as the committer runs it): files, the record, the commit, ``latest``."""
    layout = Layout(Loc(store, ""))
    lock = store.lock(timeout=10)
    staged, record = _stage(store, step, seq)
    write_record(staged, record, lock)
    with lock:
        store.make_dir(layout.trash.key)
        store.commit_dir(
            staged.key,
            layout.step_dir(step).key,
            displaced=layout.new_trash_path(step, REPLACED).key,
            retired=layout.new_trash_path(step, PRUNED).key,
        )
        store.write_pointer(layout.latest_path.key, step_dirname(step))


def _next_start(kind: Kind) -> dict[int, int]:
    """What a new writer finds once it has collected what the dead one left: step -> seq."""
    store = kind.fresh()
    layout = Layout(Loc(store, ""))
    lock = store.lock(timeout=30)
    catalog = take_root(layout, lock)
    assert not layout.staging_entries(), "every interrupted save was collected"
    Deleter(layout, lock).drain(10)  # and deleted, as its deleter does in the background
    return {e.step: e.record.seq for e in catalog.newest_first() if e.record is not None}


@pytest.mark.parametrize("again", [False, True], ids=["a new step", "a step saved again"])
def test_a_kill_at_each_point_of_a_commit_leaves_the_last_commit(kind: Kind, again: bool) -> None:
    _commit(kind.fresh(), 1, 1)
    _commit(kind.fresh(), 2, 2)
    step = 2 if again else 3
    changes = 0
    while True:  # a kill after 0, 1, 2, ... changes, until the commit runs whole
        prior = _next_start(kind).get(step)
        store = kind.dying(changes)
        try:
            _commit(store, step, 3 + changes)
        except Killed:
            found = _next_start(kind)
            assert set(found) >= {1, 2}, (changes, found)  # nothing committed was lost
            # The step is its commit before or the new one, whole: never a mix, never neither.
            assert found.get(step) in {prior, 3 + changes}, (changes, prior, found)
            newest = scan(Loc(kind.fresh(), "")).latest_step
            assert newest == max(found, key=lambda s: found[s] or 0), (changes, found, newest)
            changes += 1
            continue
        break
    assert changes >= 3, "the commit sequence makes several changes: each was a kill point"
    found = _next_start(kind)
    assert found[step] == 3 + changes and scan(Loc(kind.fresh(), "")).latest_step == step


# --- checkpoints through the manager ------------------------------------------------------------------


def test_a_manager_saves_prunes_and_restores_every_byte_verified(kind: Kind) -> None:
    url = kind.url
    with CheckpointManager(url, async_save=False, retention=Retention(keep_last=2)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((1000,), float(step))})
        assert [c.step for c in mgr.checkpoints()] == [2, 3]
    state = {"w": torch.zeros(1000)}
    with CheckpointManager(url, read_only=True) as reader:
        assert reader.restore(state).step == 3 and float(state["w"][0]) == 3.0
    assert float(safeckpt.load(url)["w"][-1]) == 3.0
    # A changed byte is never loaded: an explicit step raises, auto-resume falls back.
    store = open_store(url)
    name = next(e.name for e in store.entries("step_3") if e.name.endswith(".distcp"))
    with store.open_read(f"step_3/{name}") as handle:
        data = bytearray(handle.read(0, handle.size))
    data[len(data) // 2] ^= 0xFF
    store.write_atomic(f"step_3/{name}", bytes(data))
    with pytest.raises(CorruptCheckpointError):
        safeckpt.load(url, step=3)
    assert float(safeckpt.load(url)["w"][0]) == 2.0


def test_a_store_registered_from_outside_serves_every_entry_point() -> None:
    memory_objects.register()
    url = f"memory://outside-{time.monotonic_ns()}/run"
    with CheckpointManager(url, async_save=False) as mgr:
        mgr.save(7, {"w": torch.ones(3)})
    assert float(safeckpt.load(url)["w"].sum()) == 3.0
    from safeckpt.cli import main

    assert main(["ls", url]) == 0
    with pytest.raises(safeckpt.ConfigError, match="scheme"):
        storage.register_store("Not A Scheme", memory_objects.open_root)


def test_a_kill_at_each_point_of_a_prune_leaves_the_checkpoint_whole_or_gone(kind: Kind) -> None:
    """A prune moves a checkpoint to the trash (on an object store: its claim, then its marker):
    cut after any change, the checkpoint is still committed with every byte, or it is gone."""
    from safeckpt._root.removal import to_trash

    changes = 0
    while True:
        _commit(kind.fresh(), 1, 1)  # (again, after a run that pruned it whole)
        _commit(kind.fresh(), 2, 2)
        store = kind.dying(changes)
        layout = Layout(Loc(store, ""))
        try:
            with store.lock(timeout=10):
                to_trash(layout, layout.step_dir(1), 1)
        except Killed:
            found = _next_start(kind)
            assert 2 in found, (changes, found)
            if 1 in found:  # not pruned: whole, every byte as committed
                with kind.fresh().open_read("step_1/__0_0.distcp") as handle:
                    assert bytes(handle.read(0, handle.size)) == _data(1), changes
            changes += 1
            continue
        break
    assert changes >= 1
    assert 1 not in _next_start(kind)
