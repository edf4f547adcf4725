"""A rank's tensors as several objects, read back through one window of GETs (``_objstore.fetch``),
on moto: fewer, larger GETs, every byte still checked, and the bytes held by a restore bounded."""

from __future__ import annotations

import pytest
import torch

import safeckpt
from safeckpt._objstore.fetch import Fetch, Get, plan
from safeckpt._store.registry import open_store

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20
OPTIONS = {"part_size": 5 * MIB, "max_concurrency": 4}


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(6 * MIB // 4, generator=gen) for i in range(4)}  # 4 x 6 MiB


def _data_keys(s3_bucket, step: int) -> list[str]:  # type: ignore[no-untyped-def]
    found = [k for k in s3_bucket.keys() if f"step_{step}." in k and k.endswith(".distcp")]  # noqa: SIM118
    return sorted(found, key=lambda k: k.rpartition("/")[2])  # by name: keys start with a shard


def test_a_rank_writes_several_objects_and_a_restore_gets_each_once(s3_proxy, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("several")
    state = _state(0)
    with safeckpt.CheckpointManager(root, async_save=True, storage_options=OPTIONS) as mgr:
        mgr.save(1, state)
    keys = _data_keys(s3_bucket, 1)
    # 24 MiB, parts of 5 MiB, 4 at once: one object per thread, each at least a part.
    assert [k.rpartition("/")[2] for k in keys] == [f"__0_{i}.distcp" for i in range(4)], keys
    s3_proxy.requests.clear()
    target = {name: torch.zeros_like(t) for name, t in state.items()}
    with safeckpt.CheckpointManager(root, read_only=True, storage_options=OPTIONS) as mgr:
        assert mgr.restore(target).step == 1
    data_gets = [r for r in s3_proxy.seen(method="GET") if r.path.endswith(".distcp")]
    assert len(data_gets) == 4, [r.path for r in data_gets]  # 6 MiB objects, 6 MiB GETs
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_a_small_state_stays_one_object(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("one")
    with safeckpt.CheckpointManager(root, async_save=False, storage_options=OPTIONS) as mgr:
        mgr.save(1, {"w": torch.randn(MIB)})  # 4 MiB: less than a part
    assert len(_data_keys(s3_bucket, 1)) == 1


def test_a_flipped_byte_in_one_of_several_objects_is_caught(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("flip-several")
    with safeckpt.CheckpointManager(root, async_save=False, storage_options=OPTIONS) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    key = _data_keys(s3_bucket, 2)[2]
    client = s3_bucket.client()
    data = bytearray(client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=s3_bucket.name, Key=key, Body=bytes(data))
    target = {name: torch.zeros_like(t) for name, t in _state(0).items()}
    with safeckpt.CheckpointManager(root, storage_options=OPTIONS) as mgr:
        assert mgr.restore(target).step == 1  # step 2 is damaged: resume falls back
    assert all(torch.equal(target[k], v) for k, v in _state(1).items())


def test_gets_are_as_large_as_the_pool_allows_and_never_span_objects() -> None:
    # 4 objects of 6 MiB, 4 at once: one GET each (not two of a 5 MiB part and a 1 MiB tail).
    gets = plan([(f"k{i}", [(0, 6 * MIB)]) for i in range(4)], part_size=5 * MIB, concurrency=4)
    assert gets == [Get(f"k{i}", 0, 6 * MIB) for i in range(4)]
    # One object of 40 MiB, 8 at once: 8 GETs of 5 MiB (at least a part each), back to back.
    gets = plan([("big", [(0, 40 * MIB)])], part_size=5 * MIB, concurrency=8)
    assert [(g.start, g.end) for g in gets] == [(i * 5 * MIB, (i + 1) * 5 * MIB) for i in range(8)]
    # Far more than the pool: GETs of at most 4 parts.
    gets = plan([("huge", [(0, 1000 * MIB)])], part_size=5 * MIB, concurrency=2)
    assert max(g.end - g.start for g in gets) == 20 * MIB and gets[-1].end == 1000 * MIB
    # Ranges of one object closer than 1 MiB are one GET; farther apart, two.
    gets = plan([("k", [(0, 10), (100, 200), (5 * MIB, 5 * MIB + 10)])], part_size=5 * MIB, concurrency=1)
    assert [(g.start, g.end) for g in gets] == [(0, 200), (5 * MIB, 5 * MIB + 10)]


def test_a_fetch_holds_no_more_than_its_window(s3_bucket) -> None:  # type: ignore[no-untyped-def]
    store = open_store(s3_bucket.url("window"))
    blobs = {f"window/obj{i}": bytes([i]) * 1000 for i in range(12)}
    for key, data in blobs.items():
        store.client.put(key, data)  # type: ignore[attr-defined]
    gets = plan([(key, [(0, 1000)]) for key in blobs], part_size=5 * MIB, concurrency=2)
    assert len(gets) == 12
    with Fetch(store.client, gets, concurrency=2, window=3) as fetch:  # type: ignore[attr-defined]
        for n, (key, data) in enumerate(blobs.items()):
            assert bytes(fetch.wait(key, 0, 1000)) == data
            assert fetch._submitted <= n + 1 + 3  # never more than the window past the reader
            assert len(fetch._replies) <= 1 + 3  # replies the reader is past are dropped
