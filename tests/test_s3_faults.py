"""An ``s3://`` root under server faults (503 SlowDown, connections reset mid-part or mid-body,
slow replies, bytes corrupted in flight), injected by a real proxy in front of a real S3 server."""

from __future__ import annotations

import logging

import pytest
import torch

import safeckpt
from safeckpt.errors import SaveFailedError

pytestmark = pytest.mark.timeout(300)

PART = 5 << 20  # S3's smallest part: a 24 MiB file goes up in five (four would be one request)
OPTIONS = {"part_size": PART, "max_concurrency": 3}


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((6 << 20,), value)}  # 24 MiB


def _data_requests(proxy, method: str):  # type: ignore[no-untyped-def]
    return [r for r in proxy.seen(method=method) if ".distcp" in r.path]


def test_slowdown_and_a_part_reset_mid_upload_are_retried_and_the_save_commits(s3_proxy, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("retry")
    s3_proxy.fail_next(3, status=503, code="SlowDown", method="PUT", path_contains=".distcp")
    s3_proxy.reset_next(1, method="PUT", query_contains="partNumber=2")
    with safeckpt.CheckpointManager(root, async_save=True, storage_options=OPTIONS) as mgr:
        mgr.save(1, _state(1.0))
        mgr.wait()
    assert s3_proxy.pending() == 0  # every fault was met
    faults = [r.fault for r in _data_requests(s3_proxy, "PUT") if r.fault]
    assert faults.count("fail") == 3 and faults.count("reset") == 1
    assert torch.equal(safeckpt.load(root, storage_options=OPTIONS)["w"], _state(1.0)["w"])


def test_every_data_upload_carries_the_crc32_of_its_bytes(s3_proxy, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    with safeckpt.CheckpointManager(s3_bucket.url("crc"), async_save=False, storage_options=OPTIONS) as mgr:
        mgr.save(1, _state(2.0))
    uploads = [r for r in s3_proxy.seen(method="PUT") if r.fault is None]
    assert len([r for r in uploads if "partNumber=" in r.query]) == 5  # the 24 MiB file, in 5 parts
    assert uploads and all(r.checksum_ok for r in uploads), [(r.path, r.checksum_ok) for r in uploads]


def test_a_byte_corrupted_in_flight_never_reaches_the_state(s3_proxy, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    # Real S3 refuses the part (its CRC32 header no longer matches); moto stores it, and the read checks it.
    root = s3_bucket.url("corrupt")
    with safeckpt.CheckpointManager(root, async_save=False, storage_options=OPTIONS) as mgr:
        mgr.save(1, _state(1.0))
        s3_proxy.corrupt_next(1, method="PUT", query_contains="partNumber=2")
        mgr.save(2, _state(2.0))
    corrupted = [r for r in s3_proxy.seen(method="PUT") if r.fault == "corrupt"]
    assert len(corrupted) == 1 and corrupted[0].checksum_ok is False  # the header named the true bytes
    target = _state(0.0)
    with safeckpt.CheckpointManager(root, storage_options=OPTIONS) as mgr:
        assert mgr.restore(target).step == 1  # step 2 fails its checksum: resume falls back
    assert torch.equal(target["w"], _state(1.0)["w"])


def test_reads_cut_mid_body_or_slower_than_the_timeout_are_read_again(s3_proxy, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("reads")
    options = {**OPTIONS, "read_timeout": 2.0}
    with safeckpt.CheckpointManager(root, async_save=False, storage_options=options) as mgr:
        mgr.save(1, _state(3.0))
    s3_proxy.reset_response_next(2, method="GET", path_contains=".distcp")
    s3_proxy.delay_next(1, seconds=5.0, method="GET", path_contains=".distcp")
    target = _state(0.0)
    with safeckpt.CheckpointManager(root, storage_options=options) as mgr:
        assert mgr.restore(target).step == 1
    assert s3_proxy.pending() == 0
    assert torch.equal(target["w"], _state(3.0)["w"])


def test_a_server_that_keeps_failing_fails_the_save_on_time_and_loses_nothing(
    s3_proxy, s3_bucket, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    root = s3_bucket.url("down")
    options = {**OPTIONS, "max_attempts": 3}
    with safeckpt.CheckpointManager(root, async_save=False, storage_options=options) as mgr:
        mgr.save(1, _state(1.0))
        s3_proxy.fail_next(1000, status=503, code="SlowDown", method="PUT", path_contains=".distcp")
        with pytest.raises(SaveFailedError, match="step 2"):
            mgr.save(2, _state(2.0))
        s3_proxy.clear()
        attempts = [r for r in _data_requests(s3_proxy, "PUT") if r.fault == "fail"]
        assert 1 <= len(attempts) <= 3 * 5  # each of the 5 parts tried max_attempts times, then given up
        with caplog.at_level(logging.WARNING):
            mgr.save(3, _state(3.0))  # the server is back: saving goes on
    with safeckpt.CheckpointManager(root, storage_options=options) as mgr:
        assert [c.step for c in mgr.checkpoints()] == [1, 3]
    keys = [k for k in s3_bucket.keys() if k.startswith("down/.staging/step_2.")]  # noqa: SIM118
    assert keys == []  # the failed save's bytes were collected
