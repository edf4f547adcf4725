"""Two gloo ranks (FSDP2) checkpointing to one ``s3://`` prefix: every rank's shard goes up and comes
back, and a failed upload on one rank fails that save on every rank and loses nothing committed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import s3_dist_worker
import safeckpt
from s3_ranks_launch import launch as _launch
from safeckpt._objstore.spread import shard

pytestmark = pytest.mark.timeout(600)


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
