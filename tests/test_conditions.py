"""Servers that are not moto: conditional writes checked, not assumed (safeckpt._objstore.conditions),
and the optional calls some servers lack taking a documented, degraded path.

Two servers that ignore ``If-None-Match``/``If-Match``: moto behind the fault proxy stripping
both headers, and s3rver (a real S3 server from npm, which also answers 501 to
``list_multipart_uploads``).
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

import safeckpt
from safeckpt import CheckpointManager, ConfigError

PROBE = ".probe-"


def state(n: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), float(n))}


def _open_as_a_new_job(url: str) -> tuple[str, str]:
    """A writer opened by a new process (the check is made once per process): the error's class
    name and message, or ``("", "")``."""
    done = subprocess.run([sys.executable, "-c", _OPEN, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kind, _, message = done.stdout.strip().partition(" ")
    return kind, message


_OPEN = """
import sys
from safeckpt import CheckpointError, CheckpointManager
try:
    CheckpointManager(sys.argv[1]).close()
    print("")
except CheckpointError as e:
    print(type(e).__name__, " ".join(str(e).split()))
"""


def _save_steps(url: str, *steps: int) -> None:
    with CheckpointManager(url, async_save=False) as mgr:
        for step in steps:
            mgr.save(step, state(step))


def test_a_server_that_ignores_conditions_is_refused_to_a_writer_and_read_by_a_reader(
    s3_proxy, s3_bucket
) -> None:  # type: ignore[no-untyped-def]
    url = s3_bucket.url("run")
    _save_steps(url, 1)
    before = sorted(s3_bucket.keys())
    s3_proxy.strip_conditions()
    leases = len(s3_proxy.seen(method="PUT", path_contains=".lock"))
    kind, message = _open_as_a_new_job(url)
    assert len(s3_proxy.seen(method="PUT", path_contains=".lock")) == leases, (
        "a refused writer took the lease"
    )
    assert kind == "ConfigError" and "ignores If-None-Match" in message, message
    assert s3_proxy.endpoint in message and "read_only=True" in message
    assert sorted(s3_bucket.keys()) == before, "the probe left nothing behind, and nothing was written"
    probes = len(s3_proxy.seen(method="PUT", path_contains=PROBE))
    restored = state(0)
    with CheckpointManager(url, read_only=True) as reader:  # readers write nothing: no probe
        assert reader.restore(restored).step == 1 and float(restored["w"][0]) == 1.0
    assert float(safeckpt.load(url)["w"][0]) == 1.0
    assert len(s3_proxy.seen(method="PUT", path_contains=PROBE)) == probes, "a reader probed"


def test_a_server_whose_if_match_check_is_missing_is_named_in_the_refusal(s3_proxy, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    """If-None-Match honoured, If-Match ignored (a server half right is still refused)."""
    url = s3_bucket.url("run")
    s3_proxy.strip_headers(("if-match",))
    kind, message = _open_as_a_new_job(url)
    assert kind == "ConfigError" and "ignores If-Match" in message, message
    stored = s3_bucket.keys()
    assert not [k for k in stored if PROBE in k]


def test_s3rver_is_refused_to_a_writer_and_listed_by_a_reader(s3rver_bucket, caplog) -> None:  # type: ignore[no-untyped-def]
    url = s3rver_bucket.url("run")
    with pytest.raises(ConfigError, match="ignores If-None-Match") as info:
        CheckpointManager(url)
    assert s3rver_bucket.endpoint_url in str(info.value)
    stored = s3rver_bucket.keys()
    assert not [k for k in stored if PROBE in k or k.endswith(".owner")]
    # A reader lists it (no probe; the unfinished-upload listing it lacks is said once, not raised).
    with caplog.at_level(logging.WARNING, logger="safeckpt"):
        with CheckpointManager(url, read_only=True) as reader:
            assert reader.restore(state(0)).step is None
        done = subprocess.run(
            [sys.executable, "-m", "safeckpt", "ls", url], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stderr


def test_a_server_without_the_unfinished_upload_listing_takes_the_degraded_path(
    s3_proxy, s3_bucket, caplog
) -> None:  # type: ignore[no-untyped-def]
    s3_proxy.fail_next(10_000, status=501, code="NotImplemented", method="GET", query_contains="uploads")
    url = s3_bucket.url("run")
    with caplog.at_level(logging.WARNING, logger="safeckpt"):
        _save_steps(url, 1, 2)
        assert float(safeckpt.load(url)["w"][0]) == 2.0
    said = [r.getMessage() for r in caplog.records if "unfinished multipart uploads" in r.getMessage()]
    assert len(said) == 1 and "lifecycle rule" in said[0], said


def test_a_lease_is_released_without_a_conditional_delete(s3_proxy, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    """Some servers answer 501 to a conditional DELETE: a release that needed one failed, and the
    lease outlived every process by a whole lease. The release is a conditional PUT."""
    s3_proxy.fail_next(10_000, status=501, code="NotImplemented", method="DELETE", path_contains=".lock")
    url = s3_bucket.url("run")
    _save_steps(url, 1)
    assert not s3_proxy.seen(method="DELETE", path_contains=".lock")
    taker = subprocess.run(
        [sys.executable, "-c", _TAKE_AT_ONCE, url], capture_output=True, text=True, timeout=120
    )
    assert taker.stdout.strip() == "taken", taker.stderr


_TAKE_AT_ONCE = """
import sys
from safeckpt._store.registry import open_store
store = open_store(sys.argv[1])
with store.lock(timeout=1.0):
    print("taken")
"""
