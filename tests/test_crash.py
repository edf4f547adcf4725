"""Crash safety for real: SIGKILL a training process inside save() and pruning, then resume.

Every kill point must leave a root from which restore() loads a committed,
complete checkpoint no older than the last one committed before the kill (the
rename into ``step_<N>`` is the commit point, whether or not ``latest`` moved
after it), and the next start must collect what the kill left behind.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import crash_worker
from forkserver import context
from safeckpt import CheckpointManager
from safeckpt._ops.maintenance import verify

STEPS = 5
SMALL = 1_000
LARGE = 4_000_000  # 16 MB: DCP writes take long enough to be hit by a timed kill


def run_worker(root: Path, log: Path, **kwargs: Any) -> int | None:
    proc = context().Process(target=crash_worker.train, args=(str(root), str(log)), kwargs=kwargs)
    proc.start()
    proc.join(timeout=120)
    assert not proc.is_alive(), "the worker hung"
    return proc.exitcode


def committed_before_kill(log: Path) -> int:
    """The newest step the killed process had committed: acknowledged by save()/wait(), or renamed
    into place (the commit point), whichever is later."""
    if not log.exists():
        return 0
    return max((int(line.split()[1]) for line in log.read_text().splitlines()), default=0)


def check_recovery(root: Path, log: Path, numel: int) -> int:
    known = committed_before_kill(log)
    state = crash_worker.make_state(numel)
    with CheckpointManager(root) as mgr:
        restored = mgr.restore(state).step or 0
    assert restored >= known, f"lost committed step {known}: restored {restored}"
    assert restored <= STEPS
    if restored:
        for tensor in state.values():
            assert torch.all(tensor == float(restored)), "a partial or mixed checkpoint was loaded"
        assert all(problems == [] for problems in verify(root).values())
    assert list((root / ".staging").iterdir()) == []
    assert list((root / ".trash").iterdir()) == []
    # and training resumes from there to the end
    assert run_worker(root, log, async_save=False, steps=STEPS, numel=numel) == 0
    assert committed_before_kill(log) == STEPS
    return restored


def count_ops(tmp_path: Path, **kwargs: Any) -> int:
    """How many filesystem operations an uninterrupted run makes (run in-process)."""
    return crash_worker.train(
        str(tmp_path / "count"), str(tmp_path / "count.log"), steps=STEPS, numel=SMALL, **kwargs
    )


@pytest.mark.parametrize(
    "async_save, no_exchange, stride",
    [(False, True, 1), (True, False, 2)],
    ids=["sync-two-renames", "async-exchange"],
)
def test_kill_at_every_filesystem_operation(
    tmp_path: Path, async_save: bool, no_exchange: bool, stride: int
) -> None:
    mode = dict(async_save=async_save, no_exchange=no_exchange)
    total = count_ops(tmp_path, **mode)
    assert total > 25
    outcomes = []
    for kill_at in range(1, total + 1, stride):
        root, log = tmp_path / f"root{kill_at}", tmp_path / f"log{kill_at}"
        code = run_worker(root, log, steps=STEPS, numel=SMALL, kill_at=kill_at, **mode)
        assert code in (-signal.SIGKILL, 0)
        outcomes.append((kill_at, code, check_recovery(root, log, SMALL)))
    killed = [o for o in outcomes if o[1] == -signal.SIGKILL]
    assert len(killed) >= len(outcomes) - 2, "most kill points must actually be reached"


def test_kill_at_random_moments_during_large_writes(tmp_path: Path) -> None:
    rng = random.Random(1234)
    for attempt in range(12):
        root, log = tmp_path / f"root{attempt}", tmp_path / f"log{attempt}"
        async_save = attempt % 2 == 1
        code = run_worker(
            root, log, async_save=async_save, steps=STEPS, numel=LARGE, kill_after=rng.uniform(0.2, 3.0)
        )
        assert code in (-signal.SIGKILL, 0)
        check_recovery(root, log, LARGE)
