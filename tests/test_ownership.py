"""One writer per root, decided before a restore, by evidence (safeckpt._root.ownership).

Other machines are played by processes in a UTS namespace of their own (tests/support/other_host.py),
each a real training job (tests/support/owner_worker.py) on a local root or on the S3 test server. The
jobs promise a short heartbeat (``--beat 0.5 --dead-after 3``) so the tests take seconds; the
time a restart takes with the library's defaults is measured by benchmarks/bench_restart.py.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import safeckpt
from other_host import needs_other_host, on_host
from safeckpt import CheckpointManager, RootInUseError, read_owner
from safeckpt._root import owner_record

WORKER = str(Path(__file__).parent / "support" / "owner_worker.py")
SHORT = ["--beat", "0.5", "--dead-after", "3", "--lease", "4"]

pytestmark = needs_other_host


@pytest.fixture(params=["local", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return request.getfixturevalue("s3_bucket").url("run")  # sets the AWS_* variables the jobs inherit


class Job:
    """A worker process and its log."""

    def __init__(
        self, url: str, log: Path, *args: str, host: str | None = None, prefix: list[str] | None = None
    ):
        argv = [sys.executable, WORKER, url, str(log), *args]
        if host is not None:
            argv = on_host(host, argv)
        self.log = log
        self.proc = subprocess.Popen(
            [*(prefix or []), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def wait_for(self, what: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines() if line.startswith(what)]
            if found:
                return found[0]
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        stderr = self.proc.stderr.read().decode() if self.proc.poll() is not None and self.proc.stderr else ""
        raise AssertionError(f"no {what!r} in {self.lines()} (exit {self.proc.poll()}): {stderr[-3000:]}")

    def committed(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines() if line.startswith("committed")]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


def weights_of(url: str) -> float:
    return float(safeckpt.load(url)["w"][0])


@pytest.fixture
def short_promise(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process (the claimant) promises a short heartbeat too."""
    monkeypatch.setattr(owner_record, "BEAT_EVERY", 0.5)
    monkeypatch.setattr(owner_record, "DEAD_AFTER", 3.0)


def test_a_job_restarted_on_another_machine_owns_the_root_before_it_restores(
    url: str, tmp_path: Path, jobs: list[Job]
) -> None:
    """The dead job's pid means nothing on the new machine: its record, unchanged for the 3 s it
    promised, proves it dead. The new job waits that long in its constructor, says so, and then
    owns the root: its restore is followed by saves, never by a RootInUseError."""
    first = Job(url, tmp_path / "a.log", *SHORT, host="node-a")
    jobs.append(first)
    first.wait_for("committed 3")
    first.proc.kill()  # kill -9, mid-run: its owner record stays
    first.proc.wait(30)
    assert read_owner(url) is not None and read_owner(url).host == "node-a"  # type: ignore[union-attr]
    second = Job(url, tmp_path / "b.log", *SHORT, "--steps", "2", host="node-b")
    jobs.append(second)
    assert second.proc.wait(120) == 0, (second.lines(), second.proc.stderr.read().decode()[-3000:])  # type: ignore[union-attr]
    lines = second.lines()
    opened = float(lines[0].split()[1])
    assert opened >= 2.5, lines  # it waited for evidence, not for a guess
    restored = int(lines[1].split()[1])
    assert restored >= 3 and second.committed() == [restored + 1, restored + 2]
    assert "waiting up to" in second.proc.stderr.read().decode()  # type: ignore[union-attr]
    assert weights_of(url) == restored + 2


def test_a_live_writer_on_another_machine_refuses_a_second_one_at_its_construction(
    url: str, tmp_path: Path, jobs: list[Job], caplog: pytest.LogCaptureFixture
) -> None:
    first = Job(url, tmp_path / "a.log", *SHORT, host="node-a")
    jobs.append(first)
    first.wait_for("committed 2")
    started = time.monotonic()
    with pytest.raises(RootInUseError, match="on node-a") as info:
        CheckpointManager(url, async_save=False)
    assert time.monotonic() - started < 3  # its record changed within a heartbeat or two
    assert info.value.owner["host"] == "node-a"
    waits = [r for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(waits) == 1 and "on node-a" in waits[0].getMessage()  # said once, with the owner
    assert first.proc.poll() is None and "refused" not in " ".join(first.lines())


def test_a_live_writer_in_another_pid_namespace_is_not_taken_for_a_dead_pid(
    tmp_path: Path, jobs: list[Job]
) -> None:
    """A container on this kernel: the same hostname and boot id, its own pids. Its pid, looked
    up here, is another process or none: only its heartbeat can say it is alive."""
    root = str(tmp_path / "ckpt")
    first = Job(root, tmp_path / "a.log", *SHORT, prefix=["unshare", "--pid", "--fork", "--mount-proc"])
    jobs.append(first)
    first.wait_for("committed 2")
    owner = read_owner(root)
    assert owner is not None and owner.pid_ns != owner_record.machine()[2]
    with pytest.raises(RootInUseError):
        CheckpointManager(root, async_save=False)
    assert first.proc.poll() is None


@pytest.mark.parametrize("skewed", ["claimant", "owner"])
def test_clock_skew_never_displaces_a_live_writer(
    url: str, tmp_path: Path, jobs: list[Job], skewed: str
) -> None:
    """A claimant whose clock runs 200 s ahead (its owner's heartbeat looks 200 s old), or an
    owner whose clock runs 200 s behind: no time written by one host is read by another's clock."""
    owner_skew = ["--skew", "-200"] if skewed == "owner" else []
    first = Job(url, tmp_path / "a.log", *SHORT, *owner_skew, host="node-a")
    jobs.append(first)
    first.wait_for("committed 2")
    claimant_skew = ["--skew", "200"] if skewed == "claimant" else []
    second = Job(url, tmp_path / "b.log", *SHORT, *claimant_skew, host="node-b")
    jobs.append(second)
    assert second.proc.wait(60) == 3
    assert second.wait_for("refused").startswith("refused RootInUseError"), second.lines()
    before = first.committed()[-1]
    first.wait_for(f"committed {before + 2}")  # the live writer goes on, its saves unrefused
    assert "refused" not in " ".join(first.lines())


def pause_outside_the_lock(job: Job, url: str) -> None:
    """SIGSTOP ``job`` at a moment it holds no sidecar lock. A local root's lock is ``flock``, which
    a stopped process keeps: a writer paused inside a commit blocks every other one (for up to
    its ``lock_timeout``) until it resumes, and is then still the owner. That case is not this
    test's; an S3 lease runs out by itself, so there any moment will do."""
    for _ in range(200):
        job.proc.send_signal(signal.SIGSTOP)
        time.sleep(0.05)  # the stop has landed
        if "://" in url:
            return
        with open(Path(url) / ".lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                job.proc.send_signal(signal.SIGCONT)
                time.sleep(0.05)
                continue
            fcntl.flock(f, fcntl.LOCK_UN)
            return
    raise AssertionError("the job always held its root's lock")


@pytest.mark.parametrize("host", ["node-a", None], ids=["another machine", "this machine"])
def test_a_paused_writer_that_was_taken_over_finds_out_at_its_next_save_and_touches_nothing(
    url: str, tmp_path: Path, jobs: list[Job], short_promise: None, host: str | None
) -> None:
    """Paused, its pid still runs: on this machine too, only its heartbeat can tell (a process
    that dropped its manager without closing it is the same case). On this machine a heartbeat
    younger than its promise proves it alive, so the new job starts once the promise has run out
    (on another machine it waits that long itself)."""
    first = Job(url, tmp_path / "a.log", *SHORT, host=host)
    jobs.append(first)
    first.wait_for("committed 3")
    pause_outside_the_lock(first, url)  # a frozen VM: its heartbeat stops, its process does not end
    paused_at = first.committed()[-1]
    if host is None:
        time.sleep(3.5)  # its promise (3 s) runs out
    state = {"w": torch.zeros(64)}
    with CheckpointManager(url, async_save=False) as mgr:  # waits out its promise, then takes over
        assert mgr.restore(state).step == paused_at
        state["w"].fill_(1000.0)
        mgr.save(1000, state)
        first.proc.send_signal(signal.SIGCONT)
        assert first.proc.wait(60) == 3  # its next save (or the one it was in) refused it
        refusal = first.wait_for("refused")
        assert refusal.startswith("refused RootInUseError") and "taken over" in refusal, refusal
        mgr.save(1001, state)  # the new owner goes on
        owner = read_owner(url)
        assert owner is not None and owner.pid == os.getpid()
    assert first.committed()[-1] <= paused_at + 1
    with CheckpointManager(url, read_only=True) as reader:
        assert [c.step for c in reader.checkpoints() if c.step > paused_at + 1] == [1000, 1001]
    assert weights_of(url) == 1000.0


def test_a_dead_writer_on_this_machine_is_taken_over_at_once(
    url: str, tmp_path: Path, jobs: list[Job], caplog: pytest.LogCaptureFixture
) -> None:
    first = Job(url, tmp_path / "a.log")  # the library's own promise: 20 s
    jobs.append(first)
    first.wait_for("committed 2")
    first.proc.kill()
    first.proc.wait(30)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="safeckpt"), CheckpointManager(url, async_save=False) as mgr:
        opened = time.monotonic() - started
        mgr.restore({"w": torch.zeros(64)})
    assert opened < owner_record.DEAD_AFTER / 2  # its pid proved it dead: no heartbeat to wait for
    assert any("dead owner" in r.getMessage() for r in caplog.records)
    assert not any("waiting up to" in r.getMessage() for r in caplog.records)


def test_a_lock_taken_for_a_write_proves_the_root_is_still_ours(root: Path) -> None:
    """The last line of defence of a writer that lost its root between two checks (paused right
    after the writer thread's check): every write holds the lock, and taking it reads the record."""
    from safeckpt._root.ownership import OwnedLock, Ownership
    from stores import root as local_root

    top = local_root(root)
    root.mkdir()
    raw = top.store.lock(timeout=5)
    ownership = Ownership(top, raw)
    ownership.claim()
    owned = OwnedLock(raw, ownership)
    try:
        with owned, owned:  # ours: taken, and again inside (one check, at the outermost)
            pass
        record = (root / ".owner").read_text().replace(ownership.token, "theirs")
        (root / ".owner").write_text(record.replace('"host": "', '"host": "elsewhere-'))
        with pytest.raises(RootInUseError, match=r"taken over by pid .* on elsewhere-"), owned:
            raise AssertionError("a lost root's lock is never held")
        assert not raw.held() and not ownership.claimed
        with pytest.raises(RootInUseError):  # and it stays lost
            owned.acquire()
    finally:
        ownership.release()
    assert "theirs" in (root / ".owner").read_text()  # the new owner's record, untouched


def test_gc_never_takes_a_live_writer_on_another_machine_for_dead(
    tmp_path: Path, jobs: list[Job]
) -> None:
    """gc watches the owner's heartbeat before it takes the root's lock: under it, the heartbeat
    (which needs the lock) could not show, and a live writer would look dead."""
    root = str(tmp_path / "ckpt")
    first = Job(root, tmp_path / "a.log", *SHORT, "--every", "0.05", host="node-a")
    jobs.append(first)
    first.wait_for("committed 3")
    done = subprocess.run(
        [sys.executable, "-m", "safeckpt", "gc", root, "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["owner_alive"] is True, report
    assert all(i["action"] != "removed" for i in report["items"] if i["kind"] in ("staging", "trash")), report
    before = first.committed()[-1]
    first.wait_for(f"committed {before + 3}")  # the job goes on, its saves whole
    assert "refused" not in " ".join(first.lines())


def test_a_root_whose_owner_record_went_away_is_claimed_again_and_pruned_as_before(root: Path) -> None:
    with CheckpointManager(root, async_save=False, retention=safeckpt.Retention(keep_last=1)) as mgr:
        mgr.save(1, {"w": torch.zeros(4)})
        (root / ".owner").unlink()  # by hand: the job finds out, and claims the root again
        for step in (2, 3, 4):
            mgr.save(step, {"w": torch.full((4,), float(step))})
        owner = read_owner(root)
        assert owner is not None and owner.pid == os.getpid()
        deadline = time.monotonic() + 30  # the deleter runs again: the trash empties in the background
        while list((root / ".trash").iterdir()):
            assert time.monotonic() < deadline, list((root / ".trash").iterdir())
            time.sleep(0.05)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_4"]
