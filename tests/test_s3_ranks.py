"""Two gloo ranks (FSDP2) checkpointing to one ``s3://`` prefix: every rank's shard goes up and comes
back, and a failed upload on one rank fails that save on every rank and loses nothing committed."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import s3_dist_worker
import safeckpt
from safeckpt._s3.spread import shard

pytestmark = pytest.mark.timeout(600)


def _launch(scenario: str, url: str, results: Path, **kwargs: Any) -> list[dict[str, Any]]:
    results.mkdir(parents=True, exist_ok=True)
    for old in results.glob("rank*.json"):
        old.unlink()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=s3_dist_worker.main, args=(scenario, rank, 2, port, url, str(results), kwargs))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
        if proc.is_alive():
            proc.kill()
    reports = [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report["ok"], f"rank {rank}: {report.get('traceback')}"
    return [r["result"] for r in reports]


def test_two_ranks_save_to_a_prefix_and_restore_their_own_shards(s3_bucket, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, options = s3_bucket.url("ranks/run"), s3_bucket.storage_options
    saved = _launch("save", url, tmp_path / "r", options=options)
    assert [s["latest"] for s in saved] == [3, 3] and all(not s["errors"] for s in saved)
    # Each rank's data object one level below its save's area, under its own hashed prefix.
    listed = s3_bucket.keys()  # every key of the bucket
    data = [k.split("/") for k in listed if k.endswith(".distcp")]
    assert {leaf for *_, leaf in data} == {"__0_0.distcp", "__1_0.distcp"}
    assert all(area.startswith("step_") and hashed == shard(leaf) for *_, area, hashed, leaf in data)
    assert len({hashed for *_, hashed, _ in data}) == 2
    restored = _launch("restore", url, tmp_path / "r", options=options)
    assert [r["step"] for r in restored] == [3, 3]
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]  # each rank its own shard
    # Resumed at one rank: the plain model gets the whole tensors (each rank's rows, in rank order).
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    with safeckpt.CheckpointManager(url, storage_options=options) as mgr:
        assert mgr.restore({"model": model}, strict=False).step == 3
    for name, tensor in model.state_dict().items():
        whole = torch.cat([torch.tensor(s["weights"][name]) for s in saved]).reshape(tensor.shape)
        assert torch.equal(tensor, whole), name


def test_a_failed_upload_on_one_rank_fails_the_save_on_both_and_loses_nothing(
    s3_bucket, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    url, options = s3_bucket.url("ranks/fail"), s3_bucket.storage_options
    saved = _launch("save", url, tmp_path / "r", options=options, fail_rank=1)
    for report in saved:
        assert [e[0] for e in report["errors"]] == [2], report["errors"]  # step 2, on every rank
        assert report["errors"][0][1] == "SaveFailedError" and "rank 1" in report["errors"][0][2]
        assert report["latest"] == 3
    restored = _launch("restore", url, tmp_path / "r", options=options)
    assert [r["step"] for r in restored] == [3, 3]
    keys = s3_bucket.keys()  # every key of the bucket
    commits = sorted(k for k in keys if k.startswith("ranks/fail/step_") and k.endswith("/metadata.json"))
    assert commits == ["ranks/fail/step_1/metadata.json", "ranks/fail/step_3/metadata.json"]


# --- two tiers: a local directory the ranks share (one node), the prefix as the durable tier ---------


def test_two_ranks_with_a_shared_local_dir_commit_there_upload_and_resume_from_the_nearest_copy(
    s3_bucket, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    url, options, local = s3_bucket.url("ranks/tiers"), s3_bucket.storage_options, tmp_path / "node"
    saved = _launch("tiers_save", url, tmp_path / "r", options=options, local_dir=str(local))
    assert [s["latest"] for s in saved] == [3, 3]
    # Both ranks' files went into the local commit, and every commit was uploaded whole.
    assert sorted(p.name for p in (local / "step_3").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    record = json.loads((local / "step_3" / "metadata.json").read_text())
    assert record["uploaded"]["to"] == f"{url}/step_3"
    durable = json.loads(
        s3_bucket.client()
        .get_object(Bucket=s3_bucket.name, Key="ranks/tiers/step_3/metadata.json")["Body"]
        .read()
    )
    assert durable["uploaded"]["from"] == str(local / "step_3")
    restored = _launch("tiers_restore", url, tmp_path / "r", options=options, local_dir=str(local))
    assert [r["step"] for r in restored] == [3, 3]
    assert [r["path"] for r in restored] == [str(local / "step_3")] * 2  # the nearest copy, on both
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]
    # A flipped byte in rank 1's local file: every rank loads step 3 from the prefix instead.
    data = local / "step_3" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    restored = _launch("tiers_restore", url, tmp_path / "r", options=options, local_dir=str(local))
    assert [r["step"] for r in restored] == [3, 3]
    assert all(r["path"].startswith(url) for r in restored), [r["path"] for r in restored]
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]


# --- two tiers: a local directory on each node's own disk ----------------------------------------


def test_each_node_commits_its_part_on_its_own_disk_and_the_prefix_gets_the_whole_checkpoint(
    s3_bucket, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # Two ranks, each its own "node": neither sees the other's local_dir.
    url, options = s3_bucket.url("ranks/apart"), s3_bucket.storage_options
    nodes = str(tmp_path / "node{rank}")
    saved = _launch("tiers_save", url, tmp_path / "r", options=options, local_dir=nodes)
    assert [s["latest"] for s in saved] == [3, 3], saved
    for rank in (0, 1):  # each node's local copy: its own rank's files, and its part of the save
        step_3 = tmp_path / f"node{rank}" / "step_3"
        assert sorted(p.name for p in step_3.glob("*.distcp")) == [f"__{rank}_0.distcp"]
        record = json.loads((step_3 / "metadata.json").read_text())
        assert record["part"]["node"] == rank and record["part"]["nodes"] == 2
        assert record["uploaded"]["to"] == f"{url}/step_3"
    ids = {
        json.loads((tmp_path / f"node{r}" / "step_3" / "metadata.json").read_text())["part"]["id"]
        for r in (0, 1)
    }
    assert len(ids) == 1
    durable = json.loads(
        s3_bucket.client()
        .get_object(Bucket=s3_bucket.name, Key="ranks/apart/step_3/metadata.json")["Body"]
        .read()
    )
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(durable["files"])
    assert durable["uploaded"]["id"] in ids and "part" not in durable
    keys = s3_bucket.keys()  # every key of the bucket
    assert not [k for k in keys if ".part-" in k]  # no marker left anywhere
    # Each rank reads its node's part from its own disk, the rest (the other node's files) from the
    # prefix: node 0 holds .metadata, its rank's shard and train state; node 1 its shard and train state.
    restored = _launch("tiers_restore", url, tmp_path / "r", options=options, local_dir=nodes)
    assert [r["step"] for r in restored] == [3, 3]
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]
    for rank, files in ((0, 3), (1, 2)):
        assert (
            f"safeckpt: reading {files} file(s) of step 3 from {tmp_path / f'node{rank}' / 'step_3'}"
            in restored[rank]["said"]
        )
    assert not any("local parts" in m for r in restored for m in r["said"]), restored[0]["said"]
    # A flipped byte in node 1's part: every rank reads step 3 again, from the prefix alone.
    data = tmp_path / "node1" / "step_3" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    restored = _launch("tiers_restore", url, tmp_path / "r", options=options, local_dir=nodes)
    assert [r["step"] for r in restored] == [3, 3]
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]
    assert all(any("with the nodes' local parts" in m for m in r["said"]) for r in restored)
    # A replaced node: node 1's disk is empty. Both ranks still resume at step 3: node 0 reads its
    # part locally, node 1 everything from the prefix.
    shutil.rmtree(tmp_path / "node1")
    restored = _launch("tiers_restore", url, tmp_path / "r", options=options, local_dir=nodes)
    assert [r["step"] for r in restored] == [3, 3]
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]
    assert any("reading 3 file(s) of step 3" in m for m in restored[0]["said"])
    assert not any("file(s) of step 3 from" in m for m in restored[1]["said"])


def test_a_save_one_node_committed_and_another_did_not_upload_is_uploaded_by_the_next_start(
    s3_bucket, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # The job dies after both nodes committed step 3 locally, before any upload of it: the next
    # start uploads both parts and commits step 3 in the prefix before training goes on.
    url, options = s3_bucket.url("ranks/later"), s3_bucket.storage_options
    nodes = str(tmp_path / "node{rank}")
    saved = _launch(
        "tiers_save_no_upload",
        url,
        tmp_path / "r",
        options=options,
        local_dir=nodes,
        out=str(tmp_path / "r"),
    )
    assert [s["latest"] for s in saved] == [3, 3], saved
    keys = s3_bucket.keys()
    assert "ranks/later/step_3/metadata.json" not in keys
    restored = _launch("tiers_restore", url, tmp_path / "r", options=options, local_dir=nodes)
    assert [r["step"] for r in restored] == [3, 3]
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]
    keys = s3_bucket.keys()  # every key of the bucket
    assert "ranks/later/step_3/metadata.json" in keys


@pytest.mark.parametrize("point", ["during_upload", "durable_commit"])
def test_a_process_killed_while_a_save_goes_up_loses_nothing_and_the_next_start_commits_it_once(
    s3_bucket, tmp_path: Path, point: str
) -> None:  # type: ignore[no-untyped-def]
    # Node 1's leader dies halfway through its part, or rank 0 with the whole record in the area
    # before the commit: step 3 is in both nodes' parts only. The next start collects the area,
    # uploads both parts again and commits step 3 once, before training goes on.
    url, options = s3_bucket.url(f"ranks/kill-{point}"), s3_bucket.storage_options
    nodes, out = str(tmp_path / "node{rank}"), str(tmp_path / "r")
    saved = _launch(
        "tiers_die_at", url, tmp_path / "r", options=options, local_dir=nodes, out=out, point=point
    )
    assert [s["latest"] for s in saved] == [3, 3], saved
    prefix = f"ranks/kill-{point}/"
    keys = s3_bucket.keys()  # every key of the bucket
    assert f"{prefix}step_3/metadata.json" not in keys
    restored = _launch("tiers_restore", url, tmp_path / "r", options=options, local_dir=nodes)
    assert [r["step"] for r in restored] == [3, 3]
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]
    keys = s3_bucket.keys()  # every key of the bucket
    assert f"{prefix}step_3/metadata.json" in keys
    assert not [k for k in keys if ".part-" in k], keys
    for rank in (0, 1):  # each node's part is marked uploaded
        record = json.loads((tmp_path / f"node{rank}" / "step_3" / "metadata.json").read_text())
        assert record["uploaded"]["to"] == f"{url}/step_3"


def test_every_rank_waits_with_rank_0_for_uploads_longer_than_the_collective_timeout(
    s3_bucket, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # wait(durable=True) and close() wait for rank 0's uploads; the other ranks wait with it in
    # heartbeats, never in one collective that the upload outlasts.
    url, options = s3_bucket.url("ranks/slow"), s3_bucket.storage_options
    local = str(tmp_path / "n")
    reports = _launch("tiers_slow_upload", url, tmp_path / "r", options=options, local_dir=local)
    pause = s3_dist_worker.UPLOAD_PAUSE
    assert all(r["waited"] >= pause and r["closed"] >= 2 * pause for r in reports), reports
    keys = s3_bucket.keys()  # every key of the bucket
    assert {f"ranks/slow/step_{s}/metadata.json" for s in (1, 2)} <= set(keys)


def test_a_root_that_is_not_shared_by_the_ranks_fails_every_save_instead_of_committing_part(
    tmp_path: Path,
) -> None:
    # A node-local path given as the root on several nodes: rank 0 cannot see rank 1's files.
    saved = _launch("save", str(tmp_path / "node{rank}"), tmp_path / "r", options=None)
    for report in saved:
        assert [e[0] for e in report["errors"]] == [1, 2, 3], report["errors"]
        assert all("rank 0 does not see __1_0.distcp" in e[2] for e in report["errors"])
        assert report["latest"] is None
    assert not list((tmp_path / "node0").glob("step_*"))


def test_ranks_in_different_waits_raise_rank_agreement_error_instead_of_hanging(
    s3_bucket, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    url, options = s3_bucket.url("ranks/mismatch"), s3_bucket.storage_options
    reports = _launch("tiers_mismatch", url, tmp_path / "r", options=options, local_dir=str(tmp_path / "n"))
    for report in reports:
        assert report["error"][0] == "RankAgreementError", report
        assert "wait(durable=True)" in report["error"][1] and "in wait()" in report["error"][1]
