"""The sidecar lock: reentrant, thread-exclusive, and an flock another process respects."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from safeckpt._fs.lock import SidecarLock
from safeckpt.errors import CheckpointError, LockTimeoutError

# A second process that takes the flock of a root and holds it until told to let go.
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
fcntl.flock(fd, fcntl.LOCK_UN)
print("released", flush=True)
"""

# A second process that reports whether it could take the flock right now.
PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    print("busy")
else:
    print("free")
"""


@pytest.fixture
def lock_path(root: Path) -> Path:
    root.mkdir()
    return root / ".lock"


class Holder:
    """Another process holding the flock on ``path``."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "locked"

    def release(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "released"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def holder(lock_path: Path) -> Iterator[Holder]:
    h = Holder(lock_path)
    yield h
    h.close()


def probe(path: Path) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def in_thread(fn: object) -> BaseException | None:
    """Run ``fn`` in another thread; what it raised, or None."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as e:
            box[0] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box[0]


def test_reentrant_and_held(lock_path: Path) -> None:
    lock = SidecarLock(lock_path, timeout=5)
    assert not lock.held()
    with lock:
        assert lock.held()
        with lock:
            lock.acquire()
            assert lock.held()
            lock.release()
        assert lock.held()
    assert not lock.held()


def test_held_is_per_thread(lock_path: Path) -> None:
    lock = SidecarLock(lock_path, timeout=5)
    seen: list[bool] = []
    with lock:
        assert in_thread(lambda: seen.append(lock.held())) is None
    assert seen == [False]


def test_every_lock_object_of_a_root_is_one_lock(lock_path: Path) -> None:
    first = SidecarLock(lock_path, timeout=5)
    second = SidecarLock(lock_path.parent / "." / "sub" / ".." / ".lock", timeout=0.2)
    with first:
        assert second.held()
        with second:  # reentrant across objects: the same thread already holds it
            pass
        assert first.held()
        error = in_thread(second.acquire)
    assert isinstance(error, LockTimeoutError)
    assert not first.held() and not second.held()


def test_two_threads_exclude_each_other(lock_path: Path) -> None:
    lock = SidecarLock(lock_path, timeout=30)
    inside: list[int] = []
    overlaps: list[int] = []
    barrier = threading.Barrier(4)

    def worker(n: int) -> None:
        barrier.wait()
        for _ in range(200):
            with lock:
                inside.append(n)
                if len(inside) > 1:
                    overlaps.append(n)
                with lock:  # reentrant inside the critical section
                    pass
                inside.remove(n)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == []
    assert not lock.held()


def test_a_thread_waits_for_the_holder_then_gets_the_lock(lock_path: Path) -> None:
    lock = SidecarLock(lock_path, timeout=30)
    order: list[str] = []
    lock.acquire()
    waiter = threading.Thread(target=lambda: (lock.acquire(), order.append("waiter"), lock.release()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "the second thread did not wait for the lock"
    order.append("holder releases")
    lock.release()
    waiter.join()
    assert order == ["holder releases", "waiter"]


def test_a_thread_times_out_on_a_lock_another_thread_holds(lock_path: Path) -> None:
    lock = SidecarLock(lock_path, timeout=0.1)
    with lock:
        error = in_thread(lock.acquire)
    assert isinstance(error, LockTimeoutError)
    assert in_thread(lambda: (lock.acquire(), lock.release())) is None


def test_the_lock_is_an_flock_other_processes_see(lock_path: Path) -> None:
    lock = SidecarLock(lock_path, timeout=5)
    assert probe(lock_path) == "free"
    with lock:
        assert probe(lock_path) == "busy"
        with lock:
            pass
        assert probe(lock_path) == "busy", "the inner release let go of the flock"
    assert probe(lock_path) == "free"


def test_another_process_makes_acquire_time_out(lock_path: Path, holder: Holder) -> None:
    lock = SidecarLock(lock_path, timeout=0.3)
    with pytest.raises(LockTimeoutError) as info:
        lock.acquire()
    error = info.value
    assert isinstance(error, CheckpointError) and isinstance(error, TimeoutError)
    assert error.path == str(lock_path)
    assert str(lock_path) in str(error) and "0.3 s" in str(error)
    assert "another process" in str(error)
    assert not lock.held()
    # The failed acquire gave the thread lock back: another thread is not stuck behind it.
    assert isinstance(in_thread(lock.acquire), LockTimeoutError)
    holder.release()
    with lock:
        assert lock.held()


def test_acquire_waits_for_another_process_to_let_go(lock_path: Path, holder: Holder) -> None:
    lock = SidecarLock(lock_path, timeout=60)
    events: list[str] = []

    def take() -> None:
        lock.acquire()
        events.append("acquired")
        lock.release()

    taker = threading.Thread(target=take)
    taker.start()
    taker.join(0.3)
    assert taker.is_alive() and events == [], "acquire did not wait for the other process"
    events.append("other process releases")
    holder.release()
    taker.join()
    assert events == ["other process releases", "acquired"]


def test_release_by_a_thread_that_does_not_hold_it_raises(lock_path: Path) -> None:
    lock = SidecarLock(lock_path, timeout=5)
    with pytest.raises(RuntimeError, match="does not hold it"):
        lock.release()
    with lock:
        error = in_thread(lock.release)
        assert isinstance(error, RuntimeError) and "does not hold it" in str(error)
        assert lock.held()
        assert probe(lock_path) == "busy"
    assert not lock.held()
    assert probe(lock_path) == "free"
