"""One rank of a 2-rank gloo run on an ``s3://`` root (used by test_s3_ranks.py).

Each rank writes what it saw (its result, or the error it raised) to ``<results>/rank<r>.json``.
The S3 settings come in as ``storage_options``: a forked or spawned rank may not see the test's
environment.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from safeckpt import CheckpointManager, Retention
from safeckpt._objstore import lease as s3_lease
from safeckpt._s3 import client as s3_client
from safeckpt.errors import CheckpointError

# A rank killed while holding an S3 root's lease makes the next start wait for it to expire: the
# lease this process writes (and its successor honours) is short, so a kill costs seconds, not 30.
s3_lease.LEASE_SECONDS = 4.0


def _model(ws: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (ws,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, optim: torch.optim.Optimizer, rank: int, steps: int) -> None:
    for i in range(steps):
        torch.manual_seed(100 + i)
        model(torch.randn(4, 16)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


def _local(model: nn.Module) -> dict[str, list[float]]:
    return {k: v.to_local().flatten().tolist() for k, v in model.state_dict().items()}


def save(rank: int, ws: int, url: str, options: dict[str, Any], *, fail_rank: int | None = None) -> Any:
    model, optim = _model(ws)
    errors = []
    with CheckpointManager(  # a root with {rank} in it: each rank's own (a misconfigured job)
        url.format(rank=rank), async_save=True, retention=Retention(keep_last=2), storage_options=options
    ) as mgr:
        for step in (1, 2, 3):
            _train(model, optim, rank, 1)
            if step == 2 and rank == fail_rank:
                _fail_data_uploads()
            try:
                mgr.save(step, {"model": model, "optim": optim})
                mgr.wait()
            except CheckpointError as e:
                errors.append([step, type(e).__name__, str(e)[:300]])
            if step == 2 and rank == fail_rank:
                _restore_uploads()
        latest = mgr.latest_step
    return {"weights": _local(model), "errors": errors, "latest": latest}


def restore(rank: int, ws: int, url: str, options: dict[str, Any]) -> Any:
    model, optim = _model(ws)
    with CheckpointManager(url, storage_options=options) as mgr:
        step = mgr.restore({"model": model, "optim": optim}).step
    return {"weights": _local(model), "step": step}


def tiers_save(rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str) -> Any:
    """Two tiers: ``local_dir`` (``{rank}`` in it gives each rank its own) and the prefix."""
    model, optim = _model(ws)
    try:
        mgr = CheckpointManager(
            url, local_dir=local_dir.format(rank=rank), async_save=True, storage_options=options
        )
    except CheckpointError as e:
        return {"error": [type(e).__name__, str(e)]}
    with mgr:
        for step in (1, 2, 3):
            _train(model, optim, rank, 1)
            mgr.save(step, {"model": model, "optim": optim})
        mgr.wait(durable=True)
        latest = mgr.latest_step
    return {"weights": _local(model), "latest": latest}


def _two_durable_steps(
    model: nn.Module, optim: Any, rank: int, url: str, options: dict[str, Any], local_dir: str
) -> CheckpointManager:
    """A sync manager with two tiers (``local_dir``'s ``{rank}`` formatted), steps 1 and 2 saved
    and made durable: where the scenarios that die at step 3 start."""
    mgr = CheckpointManager(
        url, local_dir=local_dir.format(rank=rank), async_save=False, storage_options=options
    )
    for step in (1, 2):
        _train(model, optim, rank, 1)
        mgr.save(step, {"model": model, "optim": optim})
    mgr.wait(durable=True)
    return mgr


def _node_1_fails_commit(
    rank: int, step: int, nth: int = 1, *, then_on_rank_0: Callable[[Any], None] | None = None
) -> None:
    """Node 1's leader fails its ``nth`` local commit of ``step`` (ENOSPC: a full disk); on rank 0,
    ``then_on_rank_0(committer)`` runs once its own ``nth`` commit of ``step`` is done."""
    import errno

    from safeckpt._manager import committer

    real = committer.Committer._commit
    seen: list[int] = []

    def commit(self, job, checksums, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(job.step)
        this_one = job.step == step and seen.count(step) == nth
        if rank == 1 and this_one:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        done = real(self, job, checksums, **kwargs)
        if rank == 0 and this_one and then_on_rank_0 is not None:
            then_on_rank_0(self)
        return done

    committer.Committer._commit = commit  # type: ignore[method-assign]


def _never_uploaded(step: int) -> None:
    """The uploads of ``step`` never run: the process dies first."""
    import threading

    from safeckpt._tiers import uploads

    real = uploads.Uploader._upload

    def upload(self, local):  # type: ignore[no-untyped-def]
        if local.record.step == step:
            threading.Event().wait()
        return real(self, local)

    uploads.Uploader._upload = upload  # type: ignore[method-assign]


def tiers_save_no_upload(
    rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str, out: str
) -> Any:
    """As ``tiers_save``, but the job dies (``os._exit``, every rank) once step 3 is committed
    locally, before its upload."""
    _never_uploaded(3)
    model, optim = _model(ws)
    mgr = _two_durable_steps(model, optim, rank, url, options, local_dir)
    _train(model, optim, rank, 1)
    mgr.save(3, {"model": model, "optim": optim})
    result = {"weights": _local(model), "latest": mgr.latest_step}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"ok": True, "result": result}))
    dist.barrier()
    os._exit(0)


def tiers_die_at(
    rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str, out: str, point: str
) -> Any:
    """Steps 1 and 2 made durable; then one process dies at step 3: node 1's leader with its files
    written, before its local commit (``local_write``), or, step 3 committed on both nodes, while it
    goes up: node 1's leader halfway through its part (``during_upload``), or rank 0 with the whole
    record written into the area, before the commit (``durable_commit``). The other rank's call
    then fails, and it exits too."""
    from safeckpt._manager import committer
    from safeckpt._tiers import durable

    result: dict[str, Any] = {}

    def finish() -> None:
        (Path(out) / f"rank{rank}.json").write_text(json.dumps({"ok": True, "result": result}))
        os._exit(0)

    if point == "durable_commit" and rank == 0:
        real_write = durable.write_record

        def write(directory, record, lock):  # type: ignore[no-untyped-def]
            real_write(directory, record, lock)
            if record.step == 3:
                finish()

        durable.write_record = write
    elif point == "local_write" and rank == 1:
        real_commit = committer.Committer._commit

        def commit(self, job, checksums, **kwargs):  # type: ignore[no-untyped-def]
            if job.step == 3:
                finish()  # written, not committed on this node
            return real_commit(self, job, checksums, **kwargs)

        committer.Committer._commit = commit  # type: ignore[method-assign]
    elif point == "during_upload" and rank == 1:
        real_copy = durable.copy_checkpoint

        def copy(source, record, target, **kwargs):  # type: ignore[no-untyped-def]
            if record.step == 3:
                target.store.make_dir(target.key)

                def half(out):  # type: ignore[no-untyped-def]
                    out.write(b"\0" * 16)
                    finish()

                target.store.write_stream((target / sorted(record.files)[0]).key, half)
            return real_copy(source, record, target, **kwargs)

        durable.copy_checkpoint = copy
    model, optim = _model(ws)
    mgr = _two_durable_steps(model, optim, rank, url, options, local_dir)
    result["weights_2"] = _local(model)
    _train(model, optim, rank, 1)
    try:
        mgr.save(3, {"model": model, "optim": optim})
        result.update(weights=_local(model), latest=mgr.latest_step)
        mgr.wait(durable=True)
    except CheckpointError as e:  # the other process died
        result["error"] = type(e).__name__
    finish()


def tiers_commit_fails(rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str) -> Any:
    """Steps 1 and 2 made durable; node 1's leader fails its local commit of step 3 (a full disk)
    after node 0 committed its part: the save fails on both ranks, and step 4 then goes up."""
    from safeckpt._fs.atomic import read_pointer

    _node_1_fails_commit(rank, 3)
    model, optim = _model(ws)
    mgr = _two_durable_steps(model, optim, rank, url, options, local_dir)
    with mgr:
        _train(model, optim, rank, 1)
        try:
            mgr.save(3, {"model": model, "optim": optim})
            failed = None
        except CheckpointError as e:
            failed = [type(e).__name__, str(e)]
        local = sorted(p.name for p in Path(local_dir.format(rank=rank)).glob("step_*"))
        latest_after_3 = mgr.latest_step
        pointer_after_3 = read_pointer(Path(local_dir.format(rank=rank)) / "latest")
        _train(model, optim, rank, 1)
        mgr.save(4, {"model": model, "optim": optim})
        mgr.wait(durable=True)
        return {
            "failed": failed,
            "local_after_3": local,
            "latest_after_3": latest_after_3,
            "pointer_after_3": pointer_after_3,
            "weights": _local(model),
            "latest": mgr.latest_step,
        }


def tiers_resave_fails(rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str) -> Any:
    """Steps 1 and 2 made durable; step 2 saved again, and node 1's leader fails its local commit
    of it after node 0 committed its part: node 0 puts back the copy of step 2 its part replaced.
    Then step 2 is saved once more, on every node."""
    _node_1_fails_commit(rank, 2, nth=2)
    model, optim = _model(ws)
    local = Path(local_dir.format(rank=rank))
    with _two_durable_steps(model, optim, rank, url, options, local_dir) as mgr:
        seq_before = json.loads((local / "step_2" / "metadata.json").read_text())["seq"]
        weights_2 = _local(model)
        _train(model, optim, rank, 1)
        try:
            mgr.save(2, {"model": model, "optim": optim})
            failed = None
        except CheckpointError as e:
            failed = type(e).__name__
        step_2 = local / "step_2" / "metadata.json"
        seq_after = json.loads(step_2.read_text())["seq"] if step_2.exists() else None
        staging = sorted(p.name for p in (local / ".staging").iterdir())
        latest = mgr.latest_step
        mgr.save(2, {"model": model, "optim": optim})  # again, on every node: the old copy goes
        mgr.wait(durable=True)
        return {
            "failed": failed,
            "seq_before": seq_before,
            "seq_after": seq_after,
            "latest": latest,
            "staging": staging,
            "weights_2": weights_2,
            "seq_resaved": json.loads(step_2.read_text())["seq"],
            "staging_resaved": sorted(p.name for p in (local / ".staging").iterdir()),
            "weights": _local(model),
        }


def tiers_full_disk(rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str) -> Any:
    """Six saves, each made durable before the next, of a model whose shards take about 1.5 MiB a
    rank with Adam's moments: node 1's ``local_dir`` is a small disk (the test's), which fills."""
    import logging

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: said.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("safeckpt").addHandler(handler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512))
    mesh = init_device_mesh("cpu", (ws,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    local = Path(local_dir.format(rank=rank))
    with CheckpointManager(
        url, local_dir=local, local_retention=Retention(keep_last=10), storage_options=options
    ) as mgr:
        for step in range(1, 7):
            _train(model, optim, rank, 1)
            mgr.save(step, {"model": model, "optim": optim})
            mgr.wait(durable=True)  # each one uploaded before the next: every older one may go
        latest = mgr.latest_step
    kept = sorted(int(p.name.split("_")[1]) for p in local.glob("step_*"))
    return {"latest": latest, "kept": kept, "said": said}


def tiers_resave_while_uploading(
    rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str
) -> Any:
    """Step 1 made durable, step 2 committed on both nodes and still going up, when step 2 is saved
    again and node 1 fails its commit: rank 0's upload of the first copy is tried while node 0's
    new part stands in its place (so it finds another copy there), then that copy is put back.
    ``wait(durable=True)`` must still make the first copy of step 2 durable."""
    import threading

    from safeckpt._format.record import amend_record
    from safeckpt._manager.saves import Committed
    from safeckpt._tiers import uploads

    resaving, tried = threading.Event(), threading.Event()

    def pin_then_let_the_upload_try(committer: Any) -> None:
        # A pin of step 2 meanwhile (what pin() does to the local copy): the copy put back takes it.
        entry = committer._view.get(2)
        committer._view.update(Committed(entry.path, amend_record(entry.path, committer._lock, pinned=True)))
        resaving.set()  # the new part stands in place: let the held upload try now
        assert tried.wait(30)

    _node_1_fails_commit(rank, 2, nth=2, then_on_rank_0=pin_then_let_the_upload_try)
    if rank == 0:
        real_upload = uploads.Uploader._upload

        def upload(self, local):  # type: ignore[no-untyped-def]
            if local.record.step != 2 or tried.is_set():
                return real_upload(self, local)
            assert resaving.wait(30)
            try:
                return real_upload(self, local)
            finally:
                tried.set()

        uploads.Uploader._upload = upload  # type: ignore[method-assign]
    model, optim = _model(ws)
    local = Path(local_dir.format(rank=rank))
    with CheckpointManager(url, local_dir=local, async_save=False, storage_options=options) as mgr:
        _train(model, optim, rank, 1)
        mgr.save(1, {"model": model, "optim": optim})
        mgr.wait(durable=True)
        _train(model, optim, rank, 1)
        mgr.save(2, {"model": model, "optim": optim})  # committed on both nodes, not up yet
        first = json.loads((local / "step_2" / "metadata.json").read_text())
        weights_2 = _local(model)
        _train(model, optim, rank, 1)
        try:
            mgr.save(2, {"model": model, "optim": optim})
            failed = None
        except CheckpointError as e:
            failed = type(e).__name__
        mgr.wait(durable=True)
    now = json.loads((local / "step_2" / "metadata.json").read_text())  # marked by close() at the latest
    return {
        "failed": failed,
        "part_id": first["part"]["id"],
        "seq_kept": now["seq"] == first["seq"],
        "uploaded": now.get("uploaded"),
        "pinned": now["pinned"],
        "weights_2": weights_2,
    }


def tiers_die_resaving(
    rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str, out: str
) -> Any:
    """Step 1 made durable, step 2 committed on both nodes and not up yet (its uploads never run);
    then step 2 saved again: node 1 fails its commit, and rank 0 dies once it committed its own
    part, before the nodes agree. The next start must put node 0's first copy back."""
    result: dict[str, Any] = {}

    def finish(*_: Any) -> None:
        (Path(out) / f"rank{rank}.json").write_text(json.dumps({"ok": True, "result": result}))
        os._exit(0)

    _never_uploaded(2)
    # Rank 0 dies once its part is committed (the copy it replaced held aside), before the agreement.
    _node_1_fails_commit(rank, 2, nth=2, then_on_rank_0=finish)
    model, optim = _model(ws)
    local = Path(local_dir.format(rank=rank))
    mgr = CheckpointManager(url, local_dir=local, async_save=False, storage_options=options)
    _train(model, optim, rank, 1)
    mgr.save(1, {"model": model, "optim": optim})
    mgr.wait(durable=True)
    _train(model, optim, rank, 1)
    mgr.save(2, {"model": model, "optim": optim})
    result.update(weights_2=_local(model))
    result["part_id"] = json.loads((local / "step_2" / "metadata.json").read_text())["part"]["id"]
    _train(model, optim, rank, 1)
    try:
        mgr.save(2, {"model": model, "optim": optim})
    except CheckpointError as e:  # the other process died
        result["error"] = type(e).__name__
    finish()


def tiers_root_down(rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str) -> Any:
    """Saves while the durable tier refuses every write: they commit on each node and wait; once it
    is back (the test clears its proxy), ``wait(durable=True)`` succeeds with all of them uploaded."""
    import time

    from safeckpt.errors import SaveFailedError

    model, optim = _model(ws)
    failures = 0
    with CheckpointManager(
        url, local_dir=local_dir.format(rank=rank), storage_options=options, retry_interval=0.05
    ) as mgr:
        for step in (1, 2, 3):
            _train(model, optim, rank, 1)
            mgr.save(step, {"model": model, "optim": optim})
            mgr.wait()
        deadline = time.monotonic() + 120
        while True:
            try:
                mgr.wait(durable=True)
                break
            except SaveFailedError:
                failures += 1
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        latest = mgr.latest_step
    return {"weights": _local(model), "latest": latest, "failures": failures}


def tiers_restore(rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str) -> Any:
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: said.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("safeckpt").addHandler(handler)
    logging.getLogger("safeckpt").setLevel(logging.INFO)
    model, optim = _model(ws)
    with CheckpointManager(url, local_dir=local_dir.format(rank=rank), storage_options=options) as mgr:
        restored = mgr.restore({"model": model, "optim": optim})
    return {"weights": _local(model), "step": restored.step, "path": str(restored.path), "said": said}


UPLOAD_PAUSE = 3.0  # s added to each upload on rank 0: longer than the collective timeout (2 s)


def tiers_slow_upload(rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str) -> Any:
    """Rank 0's uploads outlast the manager's collective timeout while every rank waits: in
    wait(durable=True), then in close()."""
    import time

    from safeckpt._tiers import durable

    real = durable.copy_checkpoint

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(UPLOAD_PAUSE)
        return real(*args, **kwargs)

    durable.copy_checkpoint = slow  # type: ignore[assignment]
    model, optim = _model(ws)
    start = time.monotonic()
    with CheckpointManager(url, local_dir=local_dir, timeout=2.0, storage_options=options) as mgr:
        mgr.save(1, {"model": model, "optim": optim})
        mgr.wait(durable=True)
        waited = time.monotonic() - start
        mgr.save(2, {"model": model, "optim": optim})
    return {"waited": waited, "closed": time.monotonic() - start}


def tiers_mismatch(rank: int, ws: int, url: str, options: dict[str, Any], *, local_dir: str) -> Any:
    """Rank 0 in wait(durable=True), rank 1 in wait(): both raise RankAgreementError, none hangs."""
    model, optim = _model(ws)
    with CheckpointManager(url, local_dir=local_dir, timeout=20.0, storage_options=options) as mgr:
        mgr.save(1, {"model": model, "optim": optim})
        try:
            mgr.wait(durable=rank == 0)
        except CheckpointError as e:
            return {"error": [type(e).__name__, str(e)[:300]]}
    return {"error": None}


_real_put = s3_client.S3Client.put
_real_part = s3_client.S3Client.upload_part


def _fail_data_uploads() -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise s3_client.S3Error("SlowDown", 503, "injected on this rank", "x")

    s3_client.S3Client.put = refuse  # type: ignore[method-assign]
    s3_client.S3Client.upload_part = refuse  # type: ignore[method-assign]


def _restore_uploads() -> None:
    s3_client.S3Client.put = _real_put  # type: ignore[method-assign]
    s3_client.S3Client.upload_part = _real_part  # type: ignore[method-assign]


SCENARIOS = {
    "save": save,
    "restore": restore,
    "tiers_save": tiers_save,
    "tiers_restore": tiers_restore,
    "tiers_save_no_upload": tiers_save_no_upload,
    "tiers_die_at": tiers_die_at,
    "tiers_root_down": tiers_root_down,
    "tiers_commit_fails": tiers_commit_fails,
    "tiers_full_disk": tiers_full_disk,
    "tiers_resave_fails": tiers_resave_fails,
    "tiers_die_resaving": tiers_die_resaving,
    "tiers_resave_while_uploading": tiers_resave_while_uploading,
    "tiers_slow_upload": tiers_slow_upload,
    "tiers_mismatch": tiers_mismatch,
}


def main(
    scenario: str, rank: int, ws: int, port: int, url: str, results: str, kwargs: dict[str, Any]
) -> None:
    torch.set_num_threads(1)
    out = Path(results) / f"rank{rank}.json"
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=60))
        result = SCENARIOS[scenario](rank, ws, url, **kwargs)
        out.write_text(json.dumps({"ok": True, "result": result}))
    except BaseException as e:
        out.write_text(json.dumps({"ok": False, "error": repr(e), "traceback": traceback.format_exc()}))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
