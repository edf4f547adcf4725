"""Two tiers with a local directory on each node's own disk: two gloo ranks, each its own "node"
(neither sees the other's ``local_dir``), with an ``s3://`` prefix or a directory as the root."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from s3_ranks_launch import launch as _launch

pytestmark = pytest.mark.timeout(600)


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


def test_each_node_commits_its_part_and_a_shared_filesystem_root_gets_the_whole_checkpoint(
    tmp_path: Path,
) -> None:
    # The same with a shared-filesystem path as the durable tier: its own commit (the rename).
    root, nodes = tmp_path / "shared", str(tmp_path / "node{rank}")
    saved = _launch("tiers_save", str(root), tmp_path / "r", options=None, local_dir=nodes)
    assert [s["latest"] for s in saved] == [3, 3], saved
    durable = json.loads((root / "step_3" / "metadata.json").read_text())
    assert sorted(n for n in durable["files"] if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list(root.glob("step_*/.part-*")) and not list(root.glob(".staging/*"))
    for rank in (0, 1):
        record = json.loads((tmp_path / f"node{rank}" / "step_3" / "metadata.json").read_text())
        assert record["part"]["id"] == durable["uploaded"]["id"] and record["uploaded"]["to"] == str(
            root / "step_3"
        )
    shutil.rmtree(tmp_path / "node0")  # node 0 replaced: .metadata and its shard come from the root
    restored = _launch("tiers_restore", str(root), tmp_path / "r", options=None, local_dir=nodes)
    assert [r["step"] for r in restored] == [3, 3]
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]
    assert any("safeckpt: reading 2 file(s) of step 3" in m for m in restored[1]["said"])


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


def test_a_process_killed_before_its_nodes_local_commit_leaves_a_part_that_is_never_uploaded(
    s3_bucket, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # Node 1's leader dies with step 3 written, before its local commit; node 0 committed its part.
    # Step 3 exists whole nowhere: the next start does not upload node 0's part, and both ranks
    # resume at step 2.
    url, options = s3_bucket.url("ranks/kill-local"), s3_bucket.storage_options
    nodes, out = str(tmp_path / "node{rank}"), str(tmp_path / "r")
    saved = _launch(
        "tiers_die_at", url, tmp_path / "r", options=options, local_dir=nodes, out=out, point="local_write"
    )
    assert (tmp_path / "node0" / "step_3").exists() and not (tmp_path / "node1" / "step_3").exists()
    restored = _launch("tiers_restore", url, tmp_path / "r", options=options, local_dir=nodes)
    assert [r["step"] for r in restored] == [2, 2]
    assert [r["weights"] for r in restored] == [s["weights_2"] for s in saved]
    keys = s3_bucket.keys()  # every key of the bucket
    assert "ranks/kill-local/step_3/metadata.json" not in keys
    assert any("not every node holds its part" in m for m in restored[0]["said"]), restored[0]["said"]


def test_a_save_one_node_fails_to_commit_fails_everywhere_and_the_other_nodes_part_is_withdrawn(
    s3_bucket, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # Node 1's local commit of step 3 fails (a full disk) after node 0 committed its part: the save
    # fails on both ranks, node 0's part goes to its trash (alone it is no checkpoint, and never goes
    # up), and the next save commits and goes up as usual.
    url, options = s3_bucket.url("ranks/commit-fails"), s3_bucket.storage_options
    nodes = str(tmp_path / "node{rank}")
    saved = _launch("tiers_commit_fails", url, tmp_path / "r", options=options, local_dir=nodes)
    assert [s["failed"][0] for s in saved] == ["SaveFailedError", "SaveFailedError"], saved
    assert "still names step 2" in saved[0]["failed"][1], saved[0]["failed"]
    assert [s["local_after_3"] for s in saved] == [["step_1", "step_2"], ["step_1", "step_2"]], saved
    assert [s["latest_after_3"] for s in saved] == [2, 2]
    assert [s["pointer_after_3"] for s in saved] == ["step_2", "step_2"]  # on each node's disk
    assert [s["latest"] for s in saved] == [4, 4]
    keys = set(s3_bucket.keys())  # every key of the bucket
    assert {f"ranks/commit-fails/step_{s}/metadata.json" for s in (1, 2, 4)} <= keys
    assert not [k for k in keys if k.startswith("ranks/commit-fails/step_3")]
    restored = _launch("tiers_restore", url, tmp_path / "r", options=options, local_dir=nodes)
    assert [r["step"] for r in restored] == [4, 4]
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]


def test_a_save_again_that_another_node_fails_puts_back_the_copy_its_part_replaced(
    tmp_path: Path,
) -> None:
    # Step 2 saved again; node 1 fails its local commit after node 0's part replaced node 0's copy
    # of step 2: that copy goes back into place (withdrawing the part alone would lose it there).
    root, nodes = tmp_path / "shared", str(tmp_path / "node{rank}")
    saved = _launch("tiers_resave_fails", str(root), tmp_path / "r", options={}, local_dir=nodes)
    assert [s["failed"] for s in saved] == ["SaveFailedError", "SaveFailedError"], saved
    assert [s["seq_after"] for s in saved] == [s["seq_before"] for s in saved]  # the first copy
    assert [s["latest"] for s in saved] == [2, 2]
    assert [s["staging"] for s in saved] == [[], []]  # nothing held back, nothing left
    # Saved once more, on every node: the new parts stand, and the old copies are gone.
    assert all(s["seq_resaved"] > s["seq_before"] for s in saved)
    assert [s["staging_resaved"] for s in saved] == [[], []]
    restored = _launch("tiers_restore", str(root), tmp_path / "r", options={}, local_dir=nodes)
    assert [r["step"] for r in restored] == [2, 2]
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]


def test_a_copy_put_back_after_its_upload_was_tried_in_between_still_goes_up(tmp_path: Path) -> None:
    # Step 2's first copy is still going up when step 2 is saved again and node 1 fails: rank 0's
    # upload finds node 0's new part in place and drops the copy; the put-back queues it again.
    root, nodes = tmp_path / "shared", str(tmp_path / "node{rank}")
    saved = _launch("tiers_resave_while_uploading", str(root), tmp_path / "r", options={}, local_dir=nodes)
    assert [s["failed"] for s in saved] == ["SaveFailedError", "SaveFailedError"], saved
    assert [s["seq_kept"] for s in saved] == [True, True]
    assert all(s["uploaded"] is not None for s in saved), saved  # marked: its upload committed
    assert [s["pinned"] for s in saved] == [True, False]  # node 0's new part was pinned meanwhile
    durable = json.loads((root / "step_2" / "metadata.json").read_text())
    assert durable["uploaded"]["id"] == saved[0]["part_id"] == saved[1]["part_id"]
    restored = _launch("tiers_restore", str(root), tmp_path / "r", options={}, local_dir=nodes)
    assert [r["step"] for r in restored] == [2, 2]
    assert [r["weights"] for r in restored] == [s["weights_2"] for s in saved]


def test_a_process_killed_while_a_step_is_saved_again_leaves_the_first_copy_the_next_start_puts_back(
    tmp_path: Path,
) -> None:
    # Step 2 is committed on both nodes, not up yet. Saved again: node 1 fails its commit, and rank 0
    # dies right after committing its part (its first copy held aside), before the nodes agree. The
    # next start finds the first save whole (node 1's copy, node 0's held one), puts node 0's back,
    # uploads it and resumes at it; the new part, on node 0 alone, goes.
    root, nodes, out = tmp_path / "shared", str(tmp_path / "node{rank}"), str(tmp_path / "r")
    saved = _launch("tiers_die_resaving", str(root), tmp_path / "r", options={}, local_dir=nodes, out=out)
    assert (root / "latest").exists() and not (root / "step_2").exists()  # step 2 never went up
    restored = _launch("tiers_restore", str(root), tmp_path / "r", options={}, local_dir=nodes)
    assert [r["step"] for r in restored] == [2, 2]
    assert [r["weights"] for r in restored] == [s["weights_2"] for s in saved]
    assert any("put back the earlier copy of step 2" in m for m in restored[0]["said"]), restored[0]["said"]
    durable = json.loads((root / "step_2" / "metadata.json").read_text())
    assert durable["uploaded"]["id"] == saved[0]["part_id"] == saved[1]["part_id"]
    assert not list((tmp_path / "node0" / ".staging").iterdir())  # nothing held any more


def test_a_nodes_full_local_disk_removes_its_oldest_uploaded_parts_first(tmp_path: Path) -> None:
    # Node 1's local disk is a 4 MiB tmpfs, two of its parts at most; node 0's is large. Every save
    # still commits and goes up: node 1 removes its oldest uploaded parts early, node 0 keeps all.
    small = tmp_path / "node1"
    small.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)]
    mounted = subprocess.run(mount, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        root, nodes = tmp_path / "shared", str(tmp_path / "node{rank}")
        saved = _launch("tiers_full_disk", str(root), tmp_path / "r", options={}, local_dir=nodes)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    assert [s["latest"] for s in saved] == [6, 6]
    assert saved[0]["kept"] == [1, 2, 3, 4, 5, 6]
    assert saved[1]["kept"][-1] == 6 and len(saved[1]["kept"]) < 6, saved[1]["kept"]
    assert any("is full" in m for m in saved[1]["said"]), saved[1]["said"]
    assert sorted(int(p.name.split("_")[1]) for p in root.glob("step_*")) == [1, 2, 3, 4, 5, 6]


def test_each_nodes_parts_wait_while_the_root_refuses_writes_and_go_up_once_it_is_back(
    s3_proxy, s3_bucket, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # Every write to the prefix answers 503 for a while: each node commits locally and keeps its
    # parts; once the prefix is back, the backlog goes up and every step is committed there.
    url, nodes = s3_bucket.url("ranks/down"), str(tmp_path / "node{rank}")
    options = {**s3_bucket.storage_options, "endpoint_url": s3_proxy.endpoint, "max_attempts": 1}
    refusals = 100_000
    s3_proxy.fail_next(refusals, status=503, code="SlowDown", method="PUT")
    done = threading.Event()

    def back_once_refused() -> None:
        # Back some seconds after the uploads met the outage (not after a fixed time: on a busy
        # machine the jobs may not reach their first upload for a while).
        while not done.is_set() and refusals - s3_proxy.pending() < 4:
            done.wait(0.2)
        done.wait(8.0)
        s3_proxy.clear()

    back = threading.Thread(target=back_once_refused, daemon=True)
    back.start()
    try:
        saved = _launch("tiers_root_down", url, tmp_path / "r", options=options, local_dir=nodes)
    finally:
        done.set()
        back.join()
    assert [s["latest"] for s in saved] == [3, 3]
    assert saved[0]["failures"] >= 1  # wait(durable=True) said so while the prefix was down
    keys = s3_bucket.keys()  # every key of the bucket
    assert {f"ranks/down/step_{s}/metadata.json" for s in (2, 3)} <= set(keys)
    restored = _launch("tiers_restore", url, tmp_path / "r", options=options, local_dir=nodes)
    assert [r["step"] for r in restored] == [3, 3]
    assert [r["weights"] for r in restored] == [s["weights"] for s in saved]
