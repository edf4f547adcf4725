"""Frozen weights stored once (issue 56) on a local root: what nothing trains is written into files of
its own, and a later save whose such file would hold the same bytes makes it a hard link of the
previous checkpoint's instead. Content decides, never ``requires_grad``: every way of changing a
frozen tensor is written, each checkpoint restores alone, and pruning never takes shared bytes.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import frozen_crash_worker
from crash_worker import KillAtOps
from forkserver import context
from safeckpt import CheckpointManager, Retention
from safeckpt._fs.fileops import FileOps
from safeckpt._ops.maintenance import verify
from safeckpt.errors import SaveFailedError


class Lora(nn.Module):
    """A frozen base weight and a trained low-rank adapter beside it (as PEFT's LoRA layers)."""

    def __init__(self, d: int = 32, r: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(r, d) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(d, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T

    def merge(self) -> None:
        """Fold the adapter into the base in place, as ``merge_and_unload`` does."""
        with torch.no_grad():
            self.base.weight += self.lora_b @ self.lora_a


def build(seed: int = 0) -> tuple[Lora, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(seed)
    model = Lora()
    optim = torch.optim.AdamW([model.lora_a, model.lora_b], lr=0.1)
    return model, optim, {"model": model, "optim": optim}


def train_step(model: Lora, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 32)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def record(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / f"step_{step}" / "metadata.json").read_text())


def untrained_files(root: Path, step: int) -> dict[str, Any]:
    return record(root, step).get("contents") or {}


def inode(path: Path) -> int:
    return os.stat(path).st_ino


def restored_base(root: Path, step: int) -> torch.Tensor:
    model, _, state = build(seed=99)
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(state, step=step).step == step
    return model.base.weight.detach().clone()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_unchanged_frozen_file_is_a_hard_link_and_every_checkpoint_loads_alone(
    root: Path, async_save: bool
) -> None:
    model, optim, state = build()
    with CheckpointManager(root, async_save=async_save, retention=Retention(keep_last=5)) as mgr:
        for step in (1, 2, 3):
            train_step(model, optim)
            mgr.save(step, state)
            mgr.wait()
    first = untrained_files(root, 1)
    assert list(first) == ["__0_1.distcp"] and "from" not in first["__0_1.distcp"]
    keys = [row[0] for row in first["__0_1.distcp"]["xxh3_128"]]
    assert sorted(keys) == ["model.base.bias", "model.base.weight"]  # the frozen ones, no adapter
    for step in (2, 3):
        assert untrained_files(root, step)["__0_1.distcp"]["from"] == "step_1"
        assert inode(root / f"step_{step}" / "__0_1.distcp") == inode(root / "step_1" / "__0_1.distcp")
        assert inode(root / f"step_{step}" / "__0_0.distcp") != inode(root / "step_1" / "__0_0.distcp")
    assert os.stat(root / "step_1" / "__0_1.distcp").st_nlink == 3
    assert all(problems == [] for problems in verify(root).values())
    # plain dcp.load reads the newest one whole: the frozen base and the trained adapter
    fresh = Lora()
    loaded = {"model": fresh.state_dict()}
    dcp.load(loaded, checkpoint_id=str(root / "step_3"))
    for name, value in model.state_dict().items():
        assert torch.equal(loaded["model"][name], value), name


def test_pruning_the_checkpoint_that_wrote_the_shared_bytes_keeps_them(root: Path) -> None:
    model, optim, state = build()
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=1)) as mgr:
        for step in (1, 2, 3):
            train_step(model, optim)
            mgr.save(step, state)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_3"]
    assert untrained_files(root, 3)["__0_1.distcp"]["from"] == "step_1"  # written by a pruned one
    assert os.stat(root / "step_3" / "__0_1.distcp").st_nlink == 1  # the bytes are step_3's alone now
    assert verify(root) == {3: []}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, optim2, state2 = build(seed=7)
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(state2).step == 3
    for name, value in expected.items():
        assert torch.equal(fresh.state_dict()[name], value), name
    assert optim2.state_dict()["state"][0]["step"] == optim.state_dict()["state"][0]["step"]


def _through_data(model: Lora) -> None:
    model.base.weight.data[0, 0] += 1.0  # no autograd, no version counter of the parameter


def _merged(model: Lora) -> None:
    model.merge()


def _loaded_elsewhere(model: Lora) -> None:
    other = Lora()
    with torch.no_grad():
        other.base.weight.normal_()
    model.base.load_state_dict(other.base.state_dict())


@pytest.mark.parametrize(
    "change", [_through_data, _merged, _loaded_elsewhere], ids=["data", "merge_and_unload", "loaded"]
)
def test_a_frozen_tensor_changed_in_any_way_is_written(root: Path, change: Any) -> None:
    model, _optim, state = build()
    with torch.no_grad():
        model.lora_b.normal_()  # an adapter whose merge changes the base
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=5)) as mgr:
        mgr.save(1, state)
        before = model.base.weight.detach().clone()
        change(model)
        after = model.base.weight.detach().clone()
        assert not torch.equal(before, after)
        mgr.save(2, state)
    assert "from" not in untrained_files(root, 2)["__0_1.distcp"]
    assert inode(root / "step_2" / "__0_1.distcp") != inode(root / "step_1" / "__0_1.distcp")
    assert torch.equal(restored_base(root, 2), after)
    assert torch.equal(restored_base(root, 1), before)


class TwoFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.steady = nn.Parameter(torch.arange(64.0), requires_grad=False)
        self.drifting = nn.Parameter(torch.zeros(64), requires_grad=False)
        self.head = nn.Parameter(torch.zeros(4))


def test_what_keeps_changing_is_split_from_what_does_not(root: Path) -> None:
    model = TwoFrozen()
    state = {"model": model}
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=5)) as mgr:
        for step in (1, 2, 3):
            model.drifting.data.fill_(float(step))  # changes at every save, although frozen
            mgr.save(step, state)
    assert set(untrained_files(root, 1)) == {"__0_1.distcp"}
    second = untrained_files(root, 2)  # nothing shared: step 1's file held the drifting tensor too
    assert all("from" not in c for c in second.values())
    grouped = {name: sorted(r[0] for r in c["xxh3_128"]) for name, c in second.items()}
    assert sorted(grouped.values()) == [["model.drifting"], ["model.steady"]]
    steady = next(n for n, keys in grouped.items() if keys == ["model.steady"])
    third = untrained_files(root, 3)
    assert third[steady]["from"] == "step_2"  # shared from the save that split it out
    assert inode(root / "step_3" / steady) == inode(root / "step_2" / steady)
    assert sum("from" not in c for c in third.values()) == 1  # the drifting one, written again
    fresh = TwoFrozen()
    with CheckpointManager(root, read_only=True) as mgr:
        mgr.restore({"model": fresh}, step=3)
    assert torch.equal(fresh.drifting, torch.full((64,), 3.0))
    assert torch.equal(fresh.steady, torch.arange(64.0))


def test_a_full_fine_tune_writes_as_before(root: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    optim = torch.optim.AdamW(model.parameters())
    with CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": model, "optim": optim})
    assert "contents" not in record(root, 2)
    assert sorted(record(root, 2)["files"]) == [".metadata", "__0_0.distcp", "train_state.rank0.safetensors"]


class NoHardLinks(FileOps):
    def link(self, src: Path, dst: Path) -> None:
        raise OSError(errno.EPERM, "this filesystem has no hard links", str(dst))


def test_a_filesystem_without_hard_links_gets_the_file_written(root: Path) -> None:
    model, _optim, state = build()
    with CheckpointManager(root, async_save=False, file_ops=NoHardLinks()) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
    assert "from" not in untrained_files(root, 2)["__0_1.distcp"]
    assert inode(root / "step_2" / "__0_1.distcp") != inode(root / "step_1" / "__0_1.distcp")
    assert torch.equal(restored_base(root, 2), model.base.weight)


# --- save() takes a digest, not a copy, of what has not changed since the last save() -------------


def test_an_unchanged_frozen_base_is_digested_at_save_not_copied(root: Path) -> None:
    model, optim, state = build()
    base = sum(p.nbytes for p in model.base.parameters())
    with CheckpointManager(root, retention=Retention(keep_last=5)) as mgr:
        pool = mgr._pool  # type: ignore[union-attr]
        mgr.save(1, state)  # the first save: nothing to compare with, everything copied
        assert pool.nbytes >= base
        mgr.wait()
        for step in (2, 3):
            train_step(model, optim)
            mgr.save(step, state)
            assert pool.nbytes < base  # the adapter and AdamW's state only
            mgr.wait()
        model.base.weight.data[3, 3] += 1.0  # through .data: its digest tells
        mgr.save(4, state)
        assert pool.nbytes >= base
    for step in (2, 3):
        assert untrained_files(root, step)["__0_1.distcp"]["from"] == "step_1"
    assert "from" not in untrained_files(root, 4)["__0_1.distcp"]
    assert torch.equal(restored_base(root, 4), model.base.weight)


def test_with_dcps_own_writer_save_copies_every_frozen_tensor(root: Path) -> None:
    # DCP's own writer (dcp_io="torch") cannot check a live tensor's digest: nothing is left uncopied.
    model, optim, state = build()
    base = sum(p.nbytes for p in model.base.parameters())
    with CheckpointManager(root, dcp_io="torch", retention=Retention(keep_last=5)) as mgr:
        pool = mgr._pool  # type: ignore[union-attr]
        for step in (1, 2, 3):
            train_step(model, optim)
            mgr.save(step, state)
            assert pool.nbytes >= base
            mgr.wait()
    assert torch.equal(restored_base(root, 3), model.base.weight)


class GatedNoLinks(NoHardLinks):
    """No hard links (a tensor save() did not copy must be written from the live one), and the
    writer held at its attempt to link until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.reached, self.go = threading.Event(), threading.Event()

    def link(self, src: Path, dst: Path) -> None:
        self.reached.set()
        assert self.go.wait(60)
        super().link(src, dst)


def test_a_frozen_tensor_changed_after_save_returned_is_never_stored(root: Path) -> None:
    model, _optim, state = build()
    ops = GatedNoLinks()
    with CheckpointManager(root, file_ops=ops, retention=Retention(keep_last=5)) as mgr:
        mgr.save(1, state)
        mgr.wait()
        at_save = model.base.weight.detach().clone()
        mgr.save(2, state)  # unchanged since save 1: digested, not copied
        assert ops.reached.wait(60)
        model.base.weight.data.mul_(2.0)  # after save() returned, before its bytes are written
        ops.go.set()
        with pytest.raises(SaveFailedError, match="has changed since"):
            mgr.wait()
        mgr.save(3, state)  # copies it: the digest differs from save 2's
        mgr.wait()
        assert [c.step for c in mgr.checkpoints()] == [1, 3]
    assert torch.equal(restored_base(root, 1), at_save)
    assert torch.equal(restored_base(root, 3), at_save * 2.0)


# --- kill -9 in a save that shares, and in the pruning of what it shares from ---------------------

STEPS = 4
NUMEL = 1_000


def run_worker(root: Path, log: Path, **kwargs: Any) -> int | None:
    proc = context().Process(target=frozen_crash_worker.train, args=(str(root), str(log)), kwargs=kwargs)
    proc.start()
    proc.join(timeout=120)
    assert not proc.is_alive(), "the worker hung"
    return proc.exitcode


def committed_before_kill(log: Path) -> int:
    if not log.exists():
        return 0
    return max((int(line.split()[1]) for line in log.read_text().splitlines()), default=0)


def check_recovery(root: Path, log: Path) -> None:
    known = committed_before_kill(log)
    model, state = frozen_crash_worker.make_state(NUMEL)
    with CheckpointManager(root) as mgr:
        restored = mgr.restore(state).step or 0
    assert restored >= known, f"lost committed step {known}: restored {restored}"
    if restored:
        assert torch.all(model.head == float(restored)), "a partial or mixed checkpoint was loaded"
        expected = frozen_crash_worker.frozen_value(restored)
        assert torch.all(model.base == expected), "the frozen part is another commit's"
        assert all(problems == [] for problems in verify(root).values())
    assert list((root / ".staging").iterdir()) == []
    assert list((root / ".trash").iterdir()) == []
    assert run_worker(root, log, steps=STEPS, numel=NUMEL) == 0
    assert committed_before_kill(log) == STEPS


def test_kill_at_each_step_of_a_sharing_save_and_of_its_pruning(tmp_path: Path) -> None:
    names = frozen_crash_worker.train(
        str(tmp_path / "count"), str(tmp_path / "count.log"), steps=STEPS, numel=NUMEL
    )
    links = [i + 1 for i, n in enumerate(names) if n == "link"]
    assert len(links) == 2  # steps 2 and 4 share (3 changed the frozen part)
    # Each link; in the last sharing save, the operation after it, the record's rename and the
    # commit's, and the removal of the pruned checkpoint it shares from (the slow-marked test below
    # kills at every operation).
    after_link = [i + 1 for i, n in enumerate(names) if n == "replace" and i + 1 > links[-1]][:2]
    removal = [i + 1 for i, n in enumerate(names) if n == "rmtree" and i + 1 > links[-1]]
    chosen = sorted({*links, links[-1] + 1, *after_link, *removal})
    killed = 0
    for kill_at in chosen:
        root, log = tmp_path / f"root{kill_at}", tmp_path / f"log{kill_at}"
        code = run_worker(root, log, steps=STEPS, numel=NUMEL, kill_at=kill_at)
        assert code in (-signal.SIGKILL, 0)
        killed += code == -signal.SIGKILL
        check_recovery(root, log)
    assert killed >= len(chosen) - 1


@pytest.mark.slow
def test_kill_at_every_filesystem_operation_with_a_frozen_part(tmp_path: Path) -> None:
    names = frozen_crash_worker.train(
        str(tmp_path / "count"), str(tmp_path / "count.log"), steps=STEPS, numel=NUMEL
    )
    for kill_at in range(1, len(names) + 1):
        root, log = tmp_path / f"root{kill_at}", tmp_path / f"log{kill_at}"
        code = run_worker(root, log, steps=STEPS, numel=NUMEL, kill_at=kill_at)
        assert code in (-signal.SIGKILL, 0)
        check_recovery(root, log)


def test_kill_ops_count_links(tmp_path: Path) -> None:
    """The crash worker's seam sees the link (else the kill tests above would never hit it)."""
    ops = KillAtOps(None)
    (tmp_path / "a").write_bytes(b"x")
    ops.link(tmp_path / "a", tmp_path / "b")
    assert ops.names == ["link"] and (tmp_path / "b").read_bytes() == b"x"


def test_ls_and_inspect_show_own_and_shared_bytes_and_a_du_total(root: Path, capsys: Any) -> None:
    from safeckpt._ops.inspection import inspect_checkpoint
    from safeckpt.cli import main
    from safeckpt.cli.ls import listing

    model, optim, state = build()
    with CheckpointManager(root, async_save=False, retention=Retention(keep_last=5)) as mgr:
        for step in (1, 2, 3):
            train_step(model, optim)
            mgr.save(step, state)
    data = listing(root)
    by_step = {c["step"]: c for c in data["checkpoints"]}
    frozen = os.stat(root / "step_1" / "__0_1.distcp").st_size
    assert [by_step[s]["shared_bytes"] for s in (1, 2, 3)] == [0, frozen, frozen]
    assert all(c["own_bytes"] + c["shared_bytes"] == c["size"] for c in by_step.values())
    # du counts the hard-linked file once
    du = sum(os.stat(p).st_size for p in {os.stat(f).st_ino: f for f in root.glob("step_*/*")}.values())
    records = sum((root / f"step_{s}" / "metadata.json").stat().st_size for s in (1, 2, 3))
    assert data["total_bytes"] == du - records  # the records are not counted in any size
    assert inspect_checkpoint(root, 3)["shared_from"] == ["step_1"]
    assert main(["inspect", str(root), "3"]) == 0
    assert "shared:" in capsys.readouterr().out
