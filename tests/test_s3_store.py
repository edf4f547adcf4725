"""``s3://`` roots against a real S3 server (moto, over HTTP): the same API and guarantees as a
local root, through the storage seam (``safeckpt._s3``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import safeckpt
from other_host import needs_other_host, on_host
from safeckpt._objstore import lease as s3_lease
from safeckpt._objstore.aliases import AREA, CLAIMS
from safeckpt._objstore.client import PreconditionFailed
from safeckpt._objstore.lease import LeaseLock
from safeckpt._objstore.spread import shard
from safeckpt._store.registry import open_store
from safeckpt.cli import main
from safeckpt.errors import CheckpointError, ConfigError, LockTimeoutError, RootUnreachableError

pytestmark = pytest.mark.timeout(300)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    return model, optim


def _keys_under(bucket, prefix: str) -> list[str]:  # type: ignore[no-untyped-def]
    listed = bucket.keys()  # every key of the bucket (S3Bucket.keys lists them)
    return sorted(k for k in listed if k.startswith(prefix))


# --- the API on a URL -------------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_save_prune_and_restore_bit_exact_on_a_prefix(s3_bucket, async_save: bool) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("team/run1")
    model, optim = _model()
    with safeckpt.CheckpointManager(
        root, async_save=async_save, retention=safeckpt.Retention(keep_last=2)
    ) as mgr:
        for step in (10, 20, 30):
            model[0].weight.data += 1
            mgr.save(step, {"model": model, "optim": optim, "extra": {"step": step, "ids": [1, 2]}})
    keys = _keys_under(s3_bucket, "team/run1/")
    assert "team/run1/step_30/metadata.json" in keys and "team/run1/step_20/metadata.json" in keys
    assert not any("step_10" in k for k in keys), keys  # pruned: its marker, area and claim are gone
    assert not any(k.startswith("team/run1/.trash/") for k in keys)
    assert not [
        k for k in _keys_under(s3_bucket, "") if not k.startswith("team/run1/")
    ]  # nothing outside the prefix

    fresh, fresh_optim = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), None
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    state = {"model": fresh, "optim": fresh_optim, "extra": {"step": 0, "ids": []}}
    with safeckpt.CheckpointManager(root) as mgr:
        restored = mgr.restore(state)
    assert restored.step == 30 and state["extra"] == {"step": 30, "ids": [1, 2]}
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        optim.state_dict()["state"][0]["exp_avg"], fresh_optim.state_dict()["state"][0]["exp_avg"]
    )
    loaded = safeckpt.load(root, step=20)
    assert loaded["extra"]["step"] == 20
    assert safeckpt.load(f"{root}/step_20")["extra"]["step"] == 20  # a checkpoint by its own URL


def test_storage_options_as_fsspec_writes_them(s3_bucket, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # wrong: storage_options win
    options = {"key": s3_bucket.access_key, "secret": s3_bucket.secret_key, "region_name": s3_bucket.region}
    options["client_kwargs"] = {"endpoint_url": s3_bucket.endpoint_url}
    root = s3_bucket.url("opts")
    with safeckpt.CheckpointManager(root, async_save=False, storage_options=options) as mgr:
        mgr.save(1, {"w": torch.arange(5.0)})
    assert torch.equal(safeckpt.load(root, storage_options=options)["w"], torch.arange(5.0))


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"nonsense": 1}, "has no setting 'nonsense'"),
        ({"part_size": 1024}, "at least"),
        ({"client_kwargs": {"verify": False}}, "takes endpoint_url and region_name"),
        ({"max_attempts": 0}, "positive int"),
    ],
)
def test_bad_storage_options_are_a_config_error(s3_bucket, options: dict, words: str) -> None:  # type: ignore[no-untyped-def,type-arg]
    with pytest.raises(ConfigError, match=words):
        safeckpt.CheckpointManager(s3_bucket.url("x"), storage_options=options)


@pytest.mark.parametrize("url", ["s3://", "s3://Bad_Bucket/x", "s3://b/x", "s3://bucket/a/../b"])
def test_a_malformed_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError):
        safeckpt.CheckpointManager(url)


def test_storage_options_on_a_local_path_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="local path"):
        safeckpt.CheckpointManager(tmp_path / "run", storage_options={"key": "k"})


def test_an_unreachable_server_is_a_checkpoint_error_that_says_where(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    options = {"endpoint_url": "http://127.0.0.1:1", "max_attempts": 2}
    with pytest.raises(RootUnreachableError, match="cannot be reached") as info:
        safeckpt.CheckpointManager(s3_bucket.url("gone"), storage_options=options)
    assert "AWS_ENDPOINT_URL" in str(info.value)


def test_a_missing_bucket_is_named(s3_bucket, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CheckpointError, match="does not exist"):
        safeckpt.CheckpointManager(f"s3://{s3_bucket.name}-missing/run")
    # The command says it as the library does: the server's code, what it means, what to do.
    assert main(["ls", f"s3://{s3_bucket.name}-missing/run"]) == 1
    said = capsys.readouterr().err
    assert "does not exist" in said and "create it" in said and said.count("\n") == 1, said


# --- the commit protocol ----------------------------------------------------------------------------


def test_the_record_is_the_commit_object_and_names_the_area_its_bytes_are_in(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("p")
    with safeckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(5, {"w": torch.ones(3)})
    client = s3_bucket.client()
    commit = client.get_object(Bucket=s3_bucket.name, Key="p/step_5/metadata.json")
    area = commit["Metadata"][AREA]
    assert area.startswith(".staging/step_5.")
    record = json.loads(commit["Body"].read())
    assert record["step"] == 5 and record["status"] == "committed"
    data_keys = _keys_under(s3_bucket, f"p/{area}/")
    assert {k.rsplit("/", 1)[1] for k in data_keys} >= set(record["files"])
    # The only object under step_5/ is the commit object: a LIST proves nothing about completeness.
    assert _keys_under(s3_bucket, "p/step_5/") == ["p/step_5/metadata.json"]
    assert client.get_object(Bucket=s3_bucket.name, Key="p/latest")["Body"].read() == b"step_5"


def test_a_commit_never_overwrites_a_commit_object_it_did_not_read(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    store = open_store(s3_bucket.url("c"))
    for area in ("a1", "a2"):
        store.write_atomic(f".staging/{area}/metadata.json", json.dumps({"area": area}).encode())
        store.write_atomic(f".staging/{area}/data", area.encode())
    assert store.commit_dir(".staging/a1", "step_1", displaced="unused", retired=".trash/r1") is False
    # Someone else's commit object at step_2: If-None-Match refuses to write over it.
    s3_bucket.client().put_object(Bucket=s3_bucket.name, Key="c/step_2/metadata.json", Body=b"theirs")
    real_put = store.client.put
    conflicts = []

    def put(key, data, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return real_put(key, data, **kwargs)
        except PreconditionFailed:
            if kwargs.get("create_only"):
                conflicts.append(key)
            raise

    store.client.put = put  # type: ignore[method-assign]
    assert store.commit_dir(".staging/a2", "step_2", displaced="unused", retired=".trash/r2") is True
    assert conflicts == ["c/step_2/metadata.json"]  # the conditional PUT saw it ...
    # ... and the replacement went through If-Match on the ETag read (a record with no area: no retiring).
    assert store.read_small("step_2/data", limit=100, what="x") == b"a2"
    assert store.read_small("step_1/data", limit=100, what="x") == b"a1"


def test_replacing_a_commit_retires_the_old_bytes_to_the_trash(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    store = open_store(s3_bucket.url("r"))
    for area in ("old", "new"):
        store.write_atomic(f".staging/{area}/metadata.json", b"{}")
        store.write_atomic(f".staging/{area}/f", area.encode())
    store.commit_dir(".staging/old", "step_3", displaced="unused", retired=".trash/step_3.r")
    assert [e.name for e in store.entries(".staging")] == ["new"]  # old is committed: hidden
    assert store.commit_dir(".staging/new", "step_3", displaced="unused", retired=".trash/step_3.r") is True
    assert store.read_small("step_3/f", limit=10, what="x") == b"new"
    assert store.read_small(".trash/step_3.r/f", limit=10, what="x") == b"old"
    assert [e.name for e in store.entries(".staging")] == []
    store.remove(".trash/step_3.r")
    assert (
        not _keys_under(s3_bucket, "r/.staging/old/")
        and store.read_small("step_3/f", limit=10, what="x") == b"new"
    )


def test_a_removal_of_a_stale_alias_never_deletes_bytes_another_alias_holds(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    store = open_store(s3_bucket.url("m"))
    store.write_atomic(".staging/a/metadata.json", b"{}")
    store.write_atomic(".staging/a/f", b"bytes")
    store.commit_dir(".staging/a", "step_1", displaced="unused", retired="unused2")
    # A move cut short after the new marker was written leaves two aliases; the claim names one.
    client = s3_bucket.client()
    marker = client.get_object(Bucket=s3_bucket.name, Key="m/step_1/metadata.json")
    client.put_object(
        Bucket=s3_bucket.name, Key="m/.trash/x/metadata.json", Body=b"{}", Metadata=marker["Metadata"]
    )
    store.remove(".trash/x")  # not the claim's alias: only its marker goes
    assert store.read_small("step_1/f", limit=10, what="x") == b"bytes"
    with pytest.raises(OSError):  # the area by its own name: committed bytes, refused
        store.remove(".staging/a")
    assert store.read_small("step_1/f", limit=10, what="x") == b"bytes"


DATA = f"{shard('__0_0.distcp')}/__0_0.distcp"  # where rank 0's data object is, in its area


def test_a_save_cut_before_its_commit_is_collected_with_its_unfinished_uploads(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("left")
    with safeckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    client = s3_bucket.client()
    # What a writer killed mid-save leaves: data objects without a commit, and an upload never completed.
    client.put_object(Bucket=s3_bucket.name, Key=f"left/.staging/step_2.0123456789ab/{DATA}", Body=b"x" * 10)
    upload = client.create_multipart_upload(
        Bucket=s3_bucket.name, Key=f"left/.staging/step_3.0123456789ab/{DATA}"
    )
    client.upload_part(
        Bucket=s3_bucket.name, Key=upload["Key"], UploadId=upload["UploadId"], PartNumber=1, Body=b"y" * 10
    )
    with safeckpt.CheckpointManager(root) as mgr:  # the next writer takes the root: collects both
        assert mgr.restore({"w": torch.zeros(2)}).step == 1
        mgr.flush()
    assert not _keys_under(s3_bucket, "left/.staging/step_2.")
    assert not client.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads")
    assert not _keys_under(s3_bucket, "left/.trash/")


def test_latest_moved_by_someone_else_is_not_silently_undone(
    s3_bucket, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("ptr")
    with safeckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        s3_bucket.client().put_object(Bucket=s3_bucket.name, Key="ptr/latest", Body=b"step_0")
        with caplog.at_level(logging.WARNING):
            mgr.save(2, {"w": torch.ones(2)})  # committed; the If-Match on `latest` loses
        assert "moving `latest` to it failed" in caplog.text
    assert safeckpt.load(root)["w"].sum() == 2  # resume takes the newest commit, whatever latest says


def test_a_flipped_byte_on_the_server_is_caught_and_resume_falls_back(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("flip")
    with safeckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.full((64,), 1.0)})
        mgr.save(2, {"w": torch.full((64,), 2.0)})
    client = s3_bucket.client()
    key = next(k for k in _keys_under(s3_bucket, "") if "step_2." in k and k.endswith(".distcp"))
    data = bytearray(client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=s3_bucket.name, Key=key, Body=bytes(data))
    target = {"w": torch.zeros(64)}
    with safeckpt.CheckpointManager(root) as mgr:
        assert mgr.restore(target).step == 1
    assert torch.equal(target["w"], torch.full((64,), 1.0))


def test_large_files_go_up_in_parallel_parts_and_come_back_in_ranges(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    options = {"part_size": 5 << 20, "max_concurrency": 4}
    root = s3_bucket.url("big")
    big = torch.randn(6 << 20)  # 24 MiB: five parts, more than one request takes (four)
    with safeckpt.CheckpointManager(root, async_save=True, storage_options=options) as mgr:
        mgr.save(1, {"w": big})
    key = next(k for k in _keys_under(s3_bucket, "") if k.endswith("__0_0.distcp"))
    head = s3_bucket.client().head_object(Bucket=s3_bucket.name, Key=key)
    assert head["ETag"].strip('"').endswith("-5")  # a multipart upload of 5 parts
    assert torch.equal(safeckpt.load(root, storage_options=options)["w"], big)


def test_a_restore_reads_each_small_file_and_lists_its_checkpoint_once(s3_proxy, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    # Chosen and verified, checked by its rank, loaded: three looks at .metadata, the train-state
    # file and the listing, each a round trip on S3, kept for the restore by the recorded checksums.
    root = s3_bucket.url("once")
    model, optim = _model()
    with safeckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"model": model, "optim": optim})
    s3_proxy.requests.clear()
    target, _ = _model()
    with safeckpt.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore({"model": target}, strict=False).step == 1
    gets = [r.path.rpartition("/")[2] for r in s3_proxy.seen(method="GET") if r.status in (200, 206)]
    assert gets.count(".metadata") == 1 and gets.count("train_state.rank0.safetensors") == 1, gets
    # The checkpoint's own listing (its area's prefix, e.g. ``.staging/step_1.<token>/``).
    listings = [r.query for r in s3_proxy.seen(method="GET") if "list-type=2" in r.query]
    assert len([q for q in listings if "step_1." in q]) == 1, listings
    loaded, saved = target.state_dict(), model.state_dict()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_a_saves_data_objects_are_spread_over_prefixes_and_listed_at_their_names(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    store = open_store(s3_bucket.url("spread"))
    names = [f"__{rank}_0.distcp" for rank in range(64)]
    for name in names:
        store.write_stream(f".staging/a/{name}", lambda stream, name=name: stream.write(name.encode()))
    store.write_atomic(".staging/a/metadata.json", b"{}")
    store.write_atomic(".staging/a/.metadata", b"dcp")
    keys = [k.removeprefix("spread/.staging/a/") for k in _keys_under(s3_bucket, "spread/.staging/a/")]
    data = [k.split("/") for k in keys if k.endswith(".distcp")]
    # Every data object one level down, under its name's hash: the 64 ranks' uploads go to many prefixes.
    assert sorted(leaf for _, leaf in data) == sorted(names) and all(len(k) == 2 for k in data)
    assert len({hashed for hashed, _ in data}) >= 40
    assert sorted(k for k in keys if not k.endswith(".distcp")) == [".metadata", "metadata.json"]
    # Names, listings and reads know nothing of it, before and after the commit.
    expected = sorted([*names, ".metadata", "metadata.json"])
    assert [e.name for e in store.entries(".staging/a")] == expected
    store.commit_dir(".staging/a", "step_9", displaced="unused", retired="unused2")
    listed = store.entries("step_9")
    assert [e.name for e in listed] == expected and all(e.kind == "file" for e in listed)
    assert {e.name: e.size for e in listed}["__7_0.distcp"] == len(b"__7_0.distcp")
    with store.open_read("step_9/__63_0.distcp") as handle:
        assert bytes(handle.read(0, 13)) == b"__63_0.distcp"
    store.remove("step_9")
    assert not _keys_under(s3_bucket, "spread/.staging/")
    # Outside a save's area (a DCP checkpoint some other tool wrote), keys are as named.
    store.write_stream("theirs/__0_0.distcp", lambda stream: stream.write(b"x"))
    assert _keys_under(s3_bucket, "spread/theirs/") == ["spread/theirs/__0_0.distcp"]


# --- the lock ------------------------------------------------------------------------------------------


def test_the_lease_excludes_another_holder_and_frees_itself_when_its_holder_dies(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    store = open_store(s3_bucket.url("lock"))
    key = store.aliases.key(".lock")
    first = LeaseLock(store.client, key, url="first", timeout=0.5, lease=1.5)
    with first:
        with first:  # reentrant
            pass
        # Another process: its own lease state (another registry entry), the same object on S3.
        other = subprocess.run(
            [sys.executable, "-c", _OTHER_HOLDER, s3_bucket.url("lock"), "0.5"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert other.stdout.strip() == "timeout", other.stderr
    # Released by a conditional PUT of a released body (servers without a conditional DELETE
    # take it): the next holder takes it at once.
    assert json.loads(store.client.get(key).data)["released"] is True
    with LeaseLock(store.client, key, url="next", timeout=0.5, lease=1.5):
        pass
    # A holder killed with the lock held, on this machine: its pid is gone, taken over at once.
    died = subprocess.run([sys.executable, "-c", _DIE_HOLDING, s3_bucket.url("lock")], timeout=120)
    assert died.returncode in (9, -9)
    with LeaseLock(store.client, key, url="x", timeout=1.0, lease=1.5) as taken:
        assert taken.held()


@needs_other_host
def test_a_lease_held_by_a_dead_process_on_another_machine_frees_itself_when_it_expires(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    store = open_store(s3_bucket.url("lock"))
    key = store.aliases.key(".lock")
    dying = on_host("node-b", [sys.executable, "-c", _DIE_HOLDING, s3_bucket.url("lock")])
    died = subprocess.run(dying, timeout=120)
    assert died.returncode in (9, -9)
    assert json.loads(store.client.get(key).data)["host"] == "node-b"
    # Its pid means nothing here: only the lease running out (3 s) frees it.
    with pytest.raises(LockTimeoutError):
        LeaseLock(store.client, key, url="x", timeout=0.3, lease=1.5).acquire()
    taker = LeaseLock(store.client, key, url="taker", timeout=30, lease=1.5)
    started = time.monotonic()
    with taker:
        assert taker.held()
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    "body,age,seen_for,free",
    [
        ({"released": True}, 0.0, 0.0, True),
        ({}, 2.0, 100.0, False),  # the server says it was renewed 2 s ago: held, however long watched
        ({}, 22.5, 0.0, True),  # the server says it ran out
        ({}, None, 5.0, False),  # no usable date: held until seen unchanged for a whole lease
        ({}, None, 22.5, True),
        ({"host": "elsewhere", "boot_id": "b", "pid_ns": "n", "pid": 1}, 0.0, 0.0, False),
    ],
)
def test_when_a_lease_is_free(body: dict, age: float | None, seen_for: float, free: bool) -> None:  # type: ignore[type-arg]
    assert (s3_lease._free(body, age, 20.0, seen_for) is not None) is free


_OTHER_HOLDER = """
import sys
from safeckpt._store.registry import open_store
from safeckpt._objstore import lease as s3_lease
from safeckpt._objstore.lease import LeaseLock
from safeckpt._objstore.spread import shard
from safeckpt.errors import LockTimeoutError
store = open_store(sys.argv[1])
try:
    lock = LeaseLock(store.client, store.aliases.key(".lock"), url="other", timeout=float(sys.argv[2]))
    lock.acquire()
    print("taken")
except LockTimeoutError:
    print("timeout")
"""

_DIE_HOLDING = """
import os, signal, sys
from safeckpt._store.registry import open_store
from safeckpt._objstore import lease as s3_lease
from safeckpt._objstore.lease import LeaseLock
from safeckpt._objstore.spread import shard
store = open_store(sys.argv[1])
LeaseLock(store.client, store.aliases.key(".lock"), url="dying", timeout=5, lease=3).acquire()
os.kill(os.getpid(), signal.SIGKILL)
"""


# --- the tools ---------------------------------------------------------------------------------------


def test_every_cli_command_takes_an_s3_url(s3_bucket, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("cli/run")
    with safeckpt.CheckpointManager(root, async_save=False, retention=safeckpt.Retention(keep_last=3)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": {"w": torch.full((4,), float(step))}})

    def cli(*args: str) -> str:  # in this process: each command's own start costs seconds
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        assert code == 0, (args, out, err)
        return out

    done = subprocess.run(  # one through the installed command, as a user runs it
        [sys.executable, "-m", "safeckpt", "ls", root], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0 and "latest" in done.stdout, (done.stdout, done.stderr)
    assert "3 checked, 0 broken" in cli("verify", root)
    assert json.loads(cli("inspect", root, "--json"))["step"] == 3
    cli("prune", root, "--keep-last", "1")
    commits = [k for k in _keys_under(s3_bucket, "cli/run/step_") if k.endswith("/metadata.json")]
    assert commits == ["cli/run/step_3/metadata.json"]
    cli("gc", root)
    out = tmp_path / "w.safetensors"
    cli("export", root, "--to", str(out))
    assert out.stat().st_size > 0
    assert CLAIMS not in cli("ls", root)
    index = tmp_path / "index.jsonl"
    cli("register", root, "--registrar", json.dumps({"kind": "jsonl", "index_path": str(index)}))
    registered = [json.loads(line) for line in index.read_text().splitlines()]
    assert [r["step"] for r in registered] == [3] and registered[0]["path"].startswith("s3://")


# --- what a cut-short commit, a tampered marker and a lost lease leave ---------------------------


@pytest.mark.parametrize("again", [False, True], ids=["first_save", "saved_again"])
def test_a_save_cut_short_after_its_commit_object_landed_stays_committed(
    s3_bucket, monkeypatch: pytest.MonkeyPatch, again: bool
) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C (or any error) between the commit PUT's success and its return: the step is committed,
    so its area must not be discarded as a failed save's (which would delete its bytes)."""
    from safeckpt._s3.client import S3Client

    root = s3_bucket.url("cut")
    mgr = safeckpt.CheckpointManager(root, async_save=False)
    mgr.save(1, {"w": torch.ones(4)})
    if again:
        mgr.save(2, {"w": torch.full((4,), 2.0)})
    real = S3Client.put

    def interrupted(self, key, *args, **kwargs):  # type: ignore[no-untyped-def]
        etag = real(self, key, *args, **kwargs)
        if key.endswith("step_2/metadata.json"):
            raise KeyboardInterrupt("right after the commit object landed")
        return etag

    monkeypatch.setattr(S3Client, "put", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, {"w": torch.full((4,), 3.0)})
    monkeypatch.undo()
    mgr.close()
    with safeckpt.CheckpointManager(root) as reopened:  # the next start collects leftovers
        state = {"w": torch.zeros(4)}
        assert reopened.restore(state).step == 2
    assert torch.equal(state["w"], torch.full((4,), 3.0))
    assert safeckpt.load(root, step=1)["w"].sum() == 4


def test_a_marker_naming_a_container_as_its_area_never_takes_other_checkpoints_bytes(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    """A commit object whose area (``x-amz-meta-safeckpt-area``) is ``.staging`` itself, written by
    hand or damaged: pruning it removes its marker only, never the areas of every other save."""
    root = s3_bucket.url("tamper")
    with safeckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        mgr.save(2, {"w": torch.full((4,), 2.0)})
    client = s3_bucket.client()
    body = client.get_object(Bucket=s3_bucket.name, Key="tamper/step_2/metadata.json")["Body"].read()
    client.put_object(
        Bucket=s3_bucket.name, Key="tamper/step_0/metadata.json", Body=body, Metadata={AREA: ".staging"}
    )
    store = open_store(root)
    store.move("step_0", ".trash/step_0.pruned.x")  # what a prune does
    store.remove(".trash/step_0.pruned.x")  # what the deleter does
    assert not _keys_under(s3_bucket, "tamper/step_0/") and not _keys_under(s3_bucket, "tamper/.trash/")
    for step in (1, 2):
        assert safeckpt.load(root, step=step)["w"].sum() == 4 * step


def test_a_holder_whose_lease_ran_out_writes_nothing_more_under_it(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    """The holder's renewals stall past its lease, another process takes the lock over: the first
    holder's next write under the lock is refused, not made beside the new holder's."""
    import threading
    import time

    from safeckpt._s3.client import S3Client
    from safeckpt._s3.location import parse_url, settings

    url = s3_bucket.url("lost")
    store = open_store(url)
    key = store.aliases.key(".lock")
    # Another process, in effect: a client whose endpoint is spelled differently has its own lease state.
    elsewhere = s3_bucket.endpoint_url.replace("127.0.0.1", "localhost")
    other = S3Client(parse_url(url), settings({"endpoint_url": elsewhere}))
    stalled = threading.Event()
    real_put = store.client.put

    def stalling_renewal(put_key, data, **kwargs):  # type: ignore[no-untyped-def]
        if put_key == key and kwargs.get("replacing"):  # this holder's renewal of its lease
            stalled.set()
            time.sleep(4)  # longer than the lease: retries and back-off on a slow server
        return real_put(put_key, data, **kwargs)

    holder = LeaseLock(store.client, key, url="holder", timeout=5, lease=1.5)
    with holder:
        store.write_pointer("latest", "step_1")  # while the lease holds: written
        store.client.put = stalling_renewal  # type: ignore[method-assign]
        assert stalled.wait(10)
        taker = LeaseLock(other, key, url="taker", timeout=10, lease=1.5)
        taker.acquire()  # the lease ran out: taken over
        try:
            with pytest.raises(LockTimeoutError, match="lost the lock"):
                store.write_pointer("latest", "step_2")
            with pytest.raises(LockTimeoutError, match="lost the lock"):
                store.remove("latest")
        finally:  # a failure here must not leave the taker renewing beside later tests
            store.client.put = real_put  # type: ignore[method-assign]
            taker.release()
    assert open_store(url).read_pointer("latest") == "step_1"
