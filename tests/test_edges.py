"""The edges a new user hits (issue 38): a fallback that must not become a crash loop, registrations
that pruning must not race, roots that cannot be written, a second writer, readers beside a writer.

Real processes, a real full disk (tmpfs), real read-only mounts and a real unprivileged process
(root without CAP_DAC_OVERRIDE); see os_fixtures.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import edge_worker
import safeckpt
from edge_worker import consistent_state, is_whole
from forkserver import context
from os_fixtures import fill
from safeckpt import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    InvalidSaveError,
    Retention,
    RootInUseError,
    RootNotWritableError,
    read_record,
)
from safeckpt._format.catalog import damaged_note, scan
from safeckpt._fs.lock import SidecarLock
from safeckpt.cli import main
from safeckpt.errors import LockTimeoutError
from safeckpt.export import export_weights

pytestmark = pytest.mark.timeout(180)


def start(target: Any, *args: Any) -> Any:
    proc = context().Process(target=target, args=args)
    proc.start()
    return proc


def wait_for_file(path: Path, proc: Any, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        assert proc.is_alive() or path.exists(), f"the worker died (exit code {proc.exitcode})"
        time.sleep(0.01)
    raise AssertionError(f"{path} did not appear within {timeout} s")


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*"))


def save_steps(root: Path, steps: Any, **kwargs: Any) -> None:
    with CheckpointManager(root, async_save=False, **kwargs) as mgr:
        for step in steps:
            mgr.save(step, consistent_state(step))


def shard_of(root: Path, step: int) -> Path:
    return sorted((root / f"step_{step}").glob("*.distcp"))[0]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# --- 1. a fallback is not a crash loop -----------------------------------------------------------------


def test_a_restarted_quickstart_loop_resumes_past_a_damaged_step_every_time(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    code = "import sys, edge_worker; edge_worker.quickstart(*sys.argv[1:])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "support"), *sys.path])}

    def run(last: int) -> int:
        out = tmp_path / "started_at"
        proc = subprocess.run(
            [sys.executable, "-c", code, str(root), str(last), str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return int(out.read_text())

    assert run(120) == 0
    assert steps_on_disk(root)[-3:] == [110, 115, 120]
    flip(shard_of(root, 120))
    assert run(130) == 115  # fell back past 120 and saved 120..130 anew
    assert run(135) == 130  # and the next restart is as healthy as the first
    moved = scan(root).damaged
    assert len(moved) == 1 and moved[0].name.startswith("step_120.")
    note = damaged_note(moved[0])
    assert note["step"] == 120 and "checksum" in str(note["reason"])
    assert os.readlink(root / "latest") == "step_135"


def test_a_step_auto_resume_skipped_does_not_block_an_earlier_save(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_steps(root, (100, 110, 120))
    flip(shard_of(root, 120))
    state = consistent_state(0)
    with CheckpointManager(root, async_save=False) as mgr:
        assert mgr.restore(state).step == 110 and is_whole(state) and state["n"] == 110
        assert mgr.latest_step == 110
        mgr.save(115, consistent_state(115))  # InvalidSaveError before: "step 120 is already saved"
        with pytest.raises(InvalidSaveError, match="step 115 is already saved"):
            mgr.save(112, consistent_state(112))  # the order check itself still holds
    assert steps_on_disk(root) == [100, 110, 115]
    assert os.readlink(root / "latest") == "step_115"
    assert any("moved the unloadable step 120 aside" in w for w in warnings_of(caplog))
    with CheckpointManager(root) as mgr, pytest.raises(CheckpointNotFoundError, match="moved it aside"):
        mgr.restore(consistent_state(0), step=120)  # never loaded again


def test_a_damaged_sole_checkpoint_is_a_fresh_start_that_can_save(root: Path) -> None:
    save_steps(root, (7,))
    flip(root / "step_7" / "train_state.rank0.safetensors")  # found before the state changes
    with CheckpointManager(root, async_save=False) as mgr:
        assert mgr.restore(consistent_state(0)).step is None
        assert mgr.latest_step is None
        mgr.save(1, consistent_state(1))
    assert steps_on_disk(root) == [1] and [p.name[:7] for p in scan(root).damaged] == ["step_7."]


def test_a_reader_moves_nothing_and_the_next_owner_moves_the_damage_aside(root: Path, tmp_path: Path) -> None:
    save_steps(root, (1, 2))
    flip(shard_of(root, 2))
    with CheckpointManager(root, read_only=True) as reader:  # never changes the root
        assert reader.restore(consistent_state(0)).step == 1
    assert (root / "step_2").is_dir()
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    owner = start(edge_worker.live_owner, str(root), str(ready), str(stop))
    try:
        wait_for_file(ready, owner)
        with pytest.raises(RootInUseError):  # a writer is refused before it restores anything
            CheckpointManager(root, async_save=False)
        with CheckpointManager(root, read_only=True) as reader:  # a reader while the owner lives
            assert reader.restore(consistent_state(0)).step == 1
        assert (root / "step_2").is_dir()  # not a reader's root to change
    finally:
        stop.write_text("stop")
        owner.join(60)
    with CheckpointManager(root, async_save=False) as mgr:  # owns the root now
        assert mgr.restore(consistent_state(0)).step == 1
        mgr.save(3, consistent_state(3))
    assert steps_on_disk(root) == [1, 3] and [p.name[:7] for p in scan(root).damaged] == ["step_2."]
    state = consistent_state(0)
    with CheckpointManager(root) as again:
        assert again.restore(state).step == 3 and state["n"] == 3


# --- 2. pruning does not race the registry -------------------------------------------------------------


class CheckingRegistrar:
    """Registers by reading the whole checkpoint (as an upload does), slowly."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.loaded: dict[int, int] = {}
        self.errors: list[str] = []

    def register(self, step: int, path: Path, record: Any) -> dict[str, Any]:
        time.sleep(self.delay)
        try:
            self.loaded[step] = safeckpt.load(path)["n"]
        except Exception as e:
            self.errors.append(f"step {step}: {e}")
            raise
        return {}


def test_a_commit_registering_is_kept_from_retention_until_its_registration_ends(root: Path) -> None:
    registrar = CheckingRegistrar(delay=0.3)
    with CheckpointManager(root, retention=Retention(keep_last=1), registrar=registrar) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, consistent_state(step))  # no wait: each commit prunes the one before
    assert registrar.errors == [] and registrar.loaded == {1: 1, 2: 2, 3: 3}
    assert steps_on_disk(root) == [3]  # what registration held back is pruned by close()
    assert read_record(root / "step_3").registration["status"] == "registered"


class HangingRegistrar:
    def __init__(self) -> None:
        self.release = threading.Event()

    def register(self, step: int, path: Path, record: Any) -> dict[str, Any]:
        self.release.wait(60)
        return {}


def test_a_hung_registrar_keeps_no_checkpoint_past_registration_timeout(root: Path) -> None:
    registrar = HangingRegistrar()
    mgr = CheckpointManager(
        root,
        async_save=False,
        retention=Retention(keep_last=1),
        registrar=registrar,
        registration_timeout=1.0,
    )
    try:
        mgr.save(1, consistent_state(1))
        mgr.save(2, consistent_state(2))
        assert steps_on_disk(root) == [1, 2]  # step 1 registering: held
        time.sleep(1.5)
        mgr.save(3, consistent_state(3))
        assert steps_on_disk(root) == [3]  # the registration ran past its timeout: held no longer
    finally:
        mgr.close()
        registrar.release.set()


# --- 3. errors name their cause ------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["a-file", "a-file/runs/ckpt"], ids=["the-root", "under-it"])
def test_a_root_that_is_or_is_under_a_file_is_refused_at_construction(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 52: a root under a file was accepted with a warning and failed only at the first save.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    root = tmp_path / where
    said = "is a file, not a directory" if root == blocker else f"is under {blocker}, which is a file"
    with pytest.raises(ConfigError, match=said):
        CheckpointManager(root, async_save=False)
    with pytest.raises(ConfigError, match=said):
        CheckpointManager(root, read_only=True)
    with pytest.raises(ConfigError, match=said):  # not "there is no complete checkpoint"
        safeckpt.load(root)
    for command in ("ls", "verify", "gc", "prune"):
        assert main([command, str(root)]) != 0
        assert said in capsys.readouterr().err, command
    assert blocker.read_text() == "not a directory"


def test_a_root_that_is_a_symbolic_link_is_refused_with_where_it_points(tmp_path: Path) -> None:
    # A root's names are never followed through a link, the root's own neither: it used to be
    # refused as "a file".
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    with pytest.raises(ConfigError, match="is a symbolic link to real, not a directory; pass the directory"):
        CheckpointManager(tmp_path / "link")
    with pytest.raises(ConfigError, match="is a symbolic link to real"):
        safeckpt.load(tmp_path / "link")


UNPRIVILEGED_SAVE = """
import json, sys, logging, torch
from safeckpt import CheckpointManager
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger("safeckpt").addHandler(Keep(level=logging.WARNING))
logging.getLogger("safeckpt").setLevel(logging.INFO)
out = {"warnings": records}
try:
    mgr = CheckpointManager(sys.argv[1], async_save=sys.argv[2] == "async")
    out["restored"] = mgr.restore({"w": torch.zeros(3)}).step
    try:
        mgr.save(int(sys.argv[3]), {"w": torch.ones(3)})
        mgr.wait()
        out["save"] = None
    except Exception as e:
        out["save"] = [type(e).__module__ + "." + type(e).__name__, str(e)]
    try:
        mgr.close()
        out["close"] = None
    except Exception as e:
        out["close"] = [type(e).__module__ + "." + type(e).__name__, str(e)]
except Exception as e:
    out["open"] = [type(e).__module__ + "." + type(e).__name__, str(e)]
print(json.dumps(out))
"""


def unprivileged_save(run: Any, root: Path, step: int, mode: str = "sync") -> dict[str, Any]:
    proc = run(UNPRIVILEGED_SAVE, str(root), mode, str(step))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_root_under_an_unwritable_parent_warns_at_open_and_save_names_eacces(
    tmp_path: Path, run_unprivileged: Any, mode: str
) -> None:
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    out = unprivileged_save(run_unprivileged, parent / "ckpt", 1, mode)
    assert "open" not in out, out
    assert any(level == "WARNING" and "permission denied" in m for level, m in out["warnings"]), out
    assert out["restored"] is None
    assert out["save"][0] == "safeckpt.errors.RootNotWritableError", out
    assert "permission denied" in out["save"][1] and "read_only=True" in out["save"][1]
    assert out["close"] is None
    assert list(parent.iterdir()) == []


def test_a_read_only_mount_restores_and_save_and_close_say_why(
    root: Path, read_only_bind: Any, caplog: pytest.LogCaptureFixture
) -> None:
    save_steps(root, (1, 2))
    read_only_bind(root)
    state = consistent_state(0)
    mgr = CheckpointManager(root, async_save=False)
    assert any("mounted read-only" in w for w in warnings_of(caplog))
    assert mgr.restore(state).step == 2 and is_whole(state)
    for _ in range(2):  # and again: a failed save leaves nothing that close() trips on
        with pytest.raises(RootNotWritableError, match="mounted read-only"):
            mgr.save(3, consistent_state(3))
    with pytest.raises(RootNotWritableError, match="mounted read-only"):
        mgr.pin(2)
    mgr.close()
    assert steps_on_disk(root) == [1, 2]


def test_read_only_true_says_nothing_at_open_and_refuses_writes(
    root: Path, read_only_bind: Any, caplog: pytest.LogCaptureFixture
) -> None:
    save_steps(root, (1,))
    read_only_bind(root)
    with CheckpointManager(root, read_only=True) as mgr:
        assert warnings_of(caplog) == []
        assert mgr.restore(consistent_state(0)).step == 1
        with pytest.raises(RootNotWritableError, match="read_only=True"):
            mgr.save(2, consistent_state(2))
    with CheckpointManager(root.parent / "elsewhere", read_only=True) as mgr:  # nothing created
        assert mgr.restore(consistent_state(0)).step is None
    assert not (root.parent / "elsewhere").exists()


def test_a_read_only_true_manager_on_a_writable_root_writes_nothing(root: Path) -> None:
    save_steps(root, (1,))
    before = sorted(p.name for p in root.iterdir())
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(consistent_state(0)).step == 1
        with pytest.raises(RootNotWritableError):
            mgr.save(2, consistent_state(2))
    assert sorted(p.name for p in root.iterdir()) == before


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("full", ["at_open", "while_writing"])
def test_a_full_disk_is_a_checkpoint_error_and_loses_nothing(
    small_fs: Any, async_save: bool, full: str
) -> None:
    disk = small_fs(8 << 20)
    root = disk / "ckpt"
    save_steps(root, (1,))
    if full == "at_open":
        fill(disk)
    with CheckpointManager(root, async_save=async_save) as mgr:
        if full == "while_writing":
            mgr.save(2, consistent_state(2))  # this manager owns the root and writes it
            mgr.wait()
            fill(disk)
        for step in (3, 4):  # a save after a failed one fails the same way, never differently
            with pytest.raises(CheckpointError, match=r"full|No space left") as info:
                mgr.save(step, consistent_state(step))
                mgr.wait()
            assert not isinstance(info.value, OSError)
        for filler in disk.glob("filler*"):
            filler.unlink()
        mgr.save(5, consistent_state(5))
        mgr.wait()
    assert steps_on_disk(root) == ([1, 5] if full == "at_open" else [1, 2, 5])
    state = consistent_state(0)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state, step=1).step == 1 and is_whole(state)


def test_an_unwritable_trash_with_a_leftover_does_not_fail_the_open(
    root: Path, run_unprivileged: Any
) -> None:
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(3)})  # the state the unprivileged job restores
    leftover = root / ".staging" / "step_2.0123456789ab"
    leftover.mkdir(parents=True)
    (leftover / "part").write_bytes(b"x" * 10)
    (root / ".trash").chmod(0o555)
    out = unprivileged_save(run_unprivileged, root, 2)
    assert "open" not in out and out["restored"] == 1, out
    assert any("collecting interrupted saves" in m and "Permission denied" in m for _, m in out["warnings"])
    assert out["save"] is None and out["close"] is None, out
    assert steps_on_disk(root) == [1, 2]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_root_removed_under_a_running_job_is_made_again(
    root: Path, async_save: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(1, consistent_state(1))
        mgr.wait()
        shutil.rmtree(root)
        mgr.save(2, consistent_state(2))
        mgr.wait()
        assert mgr.latest_step == 2
    assert any("was removed while this job ran" in w and "step(s) 1" in w for w in warnings_of(caplog))
    assert steps_on_disk(root) == [2]
    state = consistent_state(0)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state).step == 2 and is_whole(state)


# --- 4. a second writer learns it at once --------------------------------------------------------------


def test_a_second_writer_is_refused_at_construction_within_seconds(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    owner = start(edge_worker.live_owner, str(root), str(ready), str(stop))
    try:
        pid = int(wait_for_file(ready, owner))
        started = time.monotonic()
        with pytest.raises(RootInUseError, match=f"pid {pid} on ") as info:
            CheckpointManager(root, async_save=False)  # lock_timeout stays 300 s
        assert time.monotonic() - started < 30  # seconds, not lock_timeout's five minutes
        assert "read_only=True" in str(info.value)
        with CheckpointManager(root, read_only=True) as reader:  # reading needs no ownership
            assert reader.restore(consistent_state(0)).step == 1
    finally:
        stop.write_text("stop")
        owner.join(60)
    assert owner.exitcode == 0 and steps_on_disk(root) == [1]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_root_taken_over_while_this_job_ran_fails_the_next_save_and_keeps_the_commits(
    root: Path, async_save: bool
) -> None:
    """Another host took the root over (this job looked dead to it). ``save()`` does not ask the
    store whether the root is still ours on the training thread: the writer thread does before it
    writes. Either way the save fails, naming the other writer, and writes nothing."""
    with CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(1, consistent_state(1))
        mgr.wait()
        owner = json.loads((root / ".owner").read_text())
        owner.update(host="another-host", pid=1, token="theirs", heartbeat=time.time(), writing=True)
        (root / ".owner").write_text(json.dumps(owner))
        with pytest.raises(CheckpointError, match="another-host") as info:
            mgr.save(2, consistent_state(2))
            mgr.wait()
        assert isinstance(info.value, RootInUseError) or isinstance(info.value.__cause__, RootInUseError)
        assert mgr.latest_step == 1
    assert steps_on_disk(root) == [1]
    assert json.loads((root / ".owner").read_text())["token"] == "theirs"  # theirs, untouched


# --- 5. load and export choose as auto-resume does -----------------------------------------------------


@pytest.mark.parametrize("damaged", ["shard", "train_state"])
def test_load_and_export_fall_back_past_damage_as_restore_does(
    root: Path, tmp_path: Path, damaged: str, capsys: pytest.CaptureFixture[str]
) -> None:
    save_steps(root, (1, 2))
    flip(shard_of(root, 2) if damaged == "shard" else root / "step_2" / "train_state.rank0.safetensors")
    assert safeckpt.load(root)["n"] == 1
    with pytest.raises(CorruptCheckpointError):
        safeckpt.load(root, step=2)  # an explicit step raises what it found
    out = tmp_path / "w.safetensors"
    result = export_weights(root, out)
    assert result.step == 1
    assert main(["export", str(root), "--to", str(tmp_path / "cli.safetensors")]) == 0
    assert "of step 1" in capsys.readouterr().out
    assert main(["export", str(root), "--step", "2", "--to", str(tmp_path / "x")]) == 1
    assert steps_on_disk(root) == [1, 2]  # readers never move anything


# --- 6. a reader beside a writer gets a whole checkpoint -----------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_a_reader_of_a_step_being_saved_again_gets_one_whole_checkpoint(
    root: Path, tmp_path: Path, async_save: bool
) -> None:
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    writer = start(edge_worker.resaver, str(root), str(stop), str(ready), async_save)
    reads, seen = 0, set()
    try:
        wait_for_file(ready, writer)
        deadline = time.monotonic() + 6
        with CheckpointManager(root, read_only=True) as reader:
            while time.monotonic() < deadline:
                state = consistent_state(0)
                assert reader.restore(state, step=5).step == 5
                assert is_whole(state), "a mix of two saves"
                seen.add(state["n"])
                assert is_whole(safeckpt.load(root, step=5))
                reads += 1
    finally:
        stop.write_text("stop")
        writer.join(60)
    assert writer.exitcode == 0
    assert reads > 20 and len(seen) > 5, (reads, seen)  # the writer replaced it under the reader


def test_a_reader_beside_a_job_that_prunes_never_sees_a_raw_error(root: Path, tmp_path: Path) -> None:
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    writer = start(edge_worker.pruner, str(root), str(stop), str(ready))
    reads, steps = 0, set()
    try:
        wait_for_file(ready, writer)
        deadline = time.monotonic() + 6
        with CheckpointManager(root, read_only=True) as reader:
            while time.monotonic() < deadline:
                state = consistent_state(0)
                restored = reader.restore(state)
                assert restored.step is not None and is_whole(state) and state["n"] == restored.step
                steps.add(restored.step)
                reads += 1
    finally:
        stop.write_text("stop")
        writer.join(60)
    assert writer.exitcode == 0
    assert reads > 20 and len(steps) > 5, (reads, steps)


# --- 9. quieter footguns -------------------------------------------------------------------------------


def test_a_narrower_retention_warns_listing_what_the_earlier_run_kept(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(
        root, async_save=False, retention=Retention(keep_last=2, keep_best=1, metric="loss")
    ) as mgr:
        for step, loss in [(1, 0.1), (2, 0.5), (3, 0.6), (4, 0.7)]:
            mgr.save(step, consistent_state(step), metrics={"loss": loss})
    assert steps_on_disk(root) == [1, 3, 4]
    caplog.clear()
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=2)) as mgr:
        mgr.save(5, consistent_state(5), metrics={"loss": 0.9})
    narrower = [w for w in warnings_of(caplog) if "narrower" in w]
    assert len(narrower) == 1 and "step 1 (best 1 by loss (min))" in narrower[0], warnings_of(caplog)
    assert steps_on_disk(root) == [4, 5]


def test_restoring_a_missing_step_lists_the_steps_there_are(root: Path) -> None:
    save_steps(root, (10, 20, 30))
    with CheckpointManager(root) as mgr, pytest.raises(CheckpointNotFoundError, match="are 10, 20, 30"):
        mgr.restore(consistent_state(0), step=99)


def test_a_root_that_turns_read_only_under_its_owner_still_closes(
    root: Path, read_only_bind: Any, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = CheckpointManager(root, async_save=False)
    mgr.save(1, consistent_state(1))  # this manager owns the root and wrote its owner record
    read_only_bind(root)
    mgr.close()  # the owner record cannot be removed: a warning, never an error from close()
    assert any("could not remove the owner record" in w for w in warnings_of(caplog)), warnings_of(caplog)
    state = consistent_state(0)
    with CheckpointManager(root, read_only=True) as again:
        assert again.restore(state).step == 1 and is_whole(state)


FLOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_lock_file_removed_under_a_job_is_not_locked_through_its_old_file(root: Path) -> None:
    root.mkdir()
    lock = SidecarLock(root / ".lock", timeout=0.5)
    with lock:
        pass  # the lock file stays open between acquisitions
    shutil.rmtree(root)  # the root removed by hand, and made again by another job that locks it
    root.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", FLOCK_HOLDER, str(root / ".lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockTimeoutError):  # a lock on the removed file would exclude nobody
            lock.acquire()
    finally:
        holder.kill()
        holder.wait()
        for stream in (holder.stdin, holder.stdout):
            if stream is not None:
                stream.close()
    with lock:  # the other process is gone: the file the path names is locked now
        assert lock.held()


UNPRIVILEGED_RESUME = """
import json, logging, sys
sys.path.insert(0, sys.argv[2])
from edge_worker import consistent_state, is_whole
from safeckpt import CheckpointManager, InvalidSaveError
warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("safeckpt").addHandler(Keep(level=logging.WARNING))
out = {"warnings": warnings}
with CheckpointManager(sys.argv[1], async_save=False) as mgr:
    state = consistent_state(0)
    out["restored"] = mgr.restore(state).step
    out["whole"] = is_whole(state)
    mgr.save(115, consistent_state(115))
    try:
        mgr.save(112, consistent_state(112))
        out["112"] = None
    except InvalidSaveError as e:
        out["112"] = str(e)
print(json.dumps(out))
"""


def test_a_damaged_step_that_cannot_be_moved_aside_does_not_block_an_earlier_save(
    root: Path, run_unprivileged: Any
) -> None:
    save_steps(root, (100, 110, 120))
    flip(shard_of(root, 120))
    (root / ".damaged").mkdir()
    (root / ".damaged").chmod(0o555)  # the move aside fails (EACCES): step 120 stays where it is
    proc = run_unprivileged(UNPRIVILEGED_RESUME, str(root), str(Path(__file__).parent / "support"))
    assert proc.returncode == 0, proc.stderr[-3000:]  # InvalidSaveError before: "step 120 is already saved"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["restored"] == 110 and out["whole"], out
    assert any("could not move the unloadable step 120 aside" in w for w in out["warnings"]), out
    assert "step 115 is already saved" in out["112"], out  # the order check itself still holds
    assert steps_on_disk(root) == [100, 110, 115, 120]
    assert os.readlink(root / "latest") == "step_115"
