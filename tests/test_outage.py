"""Object storage that goes away: every call ends within its bound, with a CheckpointError, and
training catches up when the storage is back (safeckpt._util.reachability, the S3 client).

The outage is played by the fault proxy in front of the test server (tests/support/s3_proxy.py): its port
closed (refused), each connection reset as it comes (drop), or accepted and never answered (hang).
The tests set a short ``timeout`` (storage_options) so that each takes seconds; the bound with the
defaults is measured by benchmarks/bench_outage.py.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from email.utils import formatdate

import pytest
import torch

import safeckpt
from safeckpt import CheckpointError, CheckpointManager, Retention, RootUnreachableError

SHORT = {"timeout": 2.0, "connect_timeout": 1.0, "read_timeout": 2.0}
BOUND = SHORT["timeout"] + SHORT["read_timeout"] + 4.0  # the promise, plus a loaded machine's slack


def state(n: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), float(n))}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Timer:
    def __enter__(self) -> Timer:
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.took = time.monotonic() - self.started


def test_a_closed_port_at_open_is_root_unreachable_not_a_config_error(s3_bucket, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    with Timer() as t, pytest.raises(RootUnreachableError, match="cannot be reached") as info:
        CheckpointManager(s3_bucket.url("run"))  # the defaults: refused is not retried for long
    assert t.took < 15, t.took
    assert not isinstance(info.value, safeckpt.ConfigError)
    assert "storage_options" in str(info.value)  # what to check: the endpoint and the network
    with Timer() as t, pytest.raises(RootUnreachableError):
        safeckpt.load(s3_bucket.url("run"))
    assert t.took < 15, t.took
    done = subprocess.run(
        [sys.executable, "-m", "safeckpt", "ls", s3_bucket.url("run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "cannot be reached" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("how", ["refuse", "drop", "hang"])
def test_an_outage_mid_run_ends_every_call_within_the_bound_and_loses_nothing(
    s3_proxy, s3_bucket, how: str, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    url = s3_bucket.url("run")
    mgr = CheckpointManager(url, storage_options=SHORT, retention=Retention(keep_last=1))
    try:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
        mgr.wait()
        s3_proxy.go_down(how)
        with Timer() as t:
            mgr.save(4, state(4))  # staged: the write fails in the background
        assert t.took < BOUND
        with Timer() as t, pytest.raises(CheckpointError) as info:
            mgr.wait()
        assert t.took < BOUND, t.took
        assert "cannot be reached" in str(info.value) or "has not answered" in str(info.value), info.value
        tried = len(s3_proxy.seen())
        with Timer() as t:  # while it is down, further calls fail at once, never hang
            for step in (5, 6, 7):
                with pytest.raises(CheckpointError):
                    mgr.save(step, state(step))
                    mgr.wait()
        assert t.took < BOUND, t.took
    finally:
        with Timer() as t:
            mgr.close()  # no raw error from the trash, the lease or the owner record
    assert t.took < BOUND, t.took
    if how != "refuse":  # (a closed port records nothing) known down: no more than a probe or two
        assert len(s3_proxy.seen()) - tried <= 3, s3_proxy.seen()[tried:]
    background = [
        r for r in caplog.records if r.threadName.startswith("safeckpt-") and r.levelno >= logging.WARNING
    ]
    kinds = [r.getMessage().split(":")[1] for r in background]
    assert len(kinds) == len(set(kinds)), kinds  # one line per kind of failure, not one per try
    assert not [r for r in caplog.records if r.exc_info], "no traceback in the log"
    s3_proxy.come_back()
    with reopened(url) as again:  # nothing committed was lost
        restored = state(0)
        assert again.restore(restored).step == 3 and float(restored["w"][0]) == 3.0
        again.save(4, state(4))


def reopened(url: str) -> CheckpointManager:
    """A manager of ``url`` once the storage answers again: this process found it down moments
    ago, and tries it again at the next probe (a few seconds), saying RootUnreachableError until."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return CheckpointManager(url, storage_options=SHORT)
        except RootUnreachableError:
            assert time.monotonic() < deadline, "the storage is back, but the root stays unreachable"
            time.sleep(0.5)


def test_saves_catch_up_once_the_storage_is_back(s3_proxy, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    url = s3_bucket.url("run")
    with CheckpointManager(url, storage_options=SHORT) as mgr:
        mgr.save(1, state(1))
        mgr.wait()
        s3_proxy.go_down("refuse")
        mgr.save(2, state(2))
        with pytest.raises(CheckpointError):
            mgr.wait()
        s3_proxy.come_back()
        deadline = time.monotonic() + 30
        while True:  # the next save after a probe found the server back commits
            try:
                mgr.save(3, state(3))
                mgr.wait()
                break
            except CheckpointError:
                assert time.monotonic() < deadline, "the storage is back, but saves still fail"
                time.sleep(0.5)
        assert mgr.latest_step == 3
    assert float(safeckpt.load(url)["w"][0]) == 3.0


def test_with_a_local_tier_saves_commit_locally_through_an_outage_and_go_up_after(
    s3_proxy, s3_bucket, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    url = s3_bucket.url("run")
    with CheckpointManager(url, local_dir=tmp_path / "local", storage_options=SHORT) as mgr:
        mgr.save(1, state(1))
        mgr.wait(durable=True)
        s3_proxy.go_down("hang")
        for step in (2, 3):
            with Timer() as t:
                mgr.save(step, state(step))
                mgr.wait()  # committed locally: training goes on
            assert t.took < BOUND
        assert mgr.latest_step == 3
        with Timer() as t, pytest.raises(CheckpointError, match="3"):
            mgr.wait(durable=True)
        assert t.took < BOUND + SHORT["timeout"], t.took
        s3_proxy.come_back()
        deadline = time.monotonic() + 60
        while True:
            try:
                mgr.wait(durable=True)  # caught up: both local commits went up
                break
            except CheckpointError:
                assert time.monotonic() < deadline, "the storage is back, but nothing goes up"
                time.sleep(0.5)
    assert float(safeckpt.load(url)["w"][0]) == 3.0


def _date_editor(kind: str):  # type: ignore[no-untyped-def]
    def edit(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        rest = [(k, v) for k, v in headers if k.lower() != "date"]
        now = formatdate(usegmt=True)
        if kind == "duplicated":
            return [*rest, ("Date", now), ("Date", now)]
        if kind == "minus-zero":
            return [*rest, ("Date", formatdate())]  # "... -0000": a naive time to Python
        return [*rest, ("Date", "yesterday, around noon")]

    return edit


@pytest.mark.parametrize("kind", ["duplicated", "minus-zero", "garbage"])
def test_a_servers_date_header_is_untrusted_input(s3_proxy, s3_bucket, kind: str) -> None:  # type: ignore[no-untyped-def]
    url = s3_bucket.url("run")
    with CheckpointManager(url, async_save=False) as mgr:
        mgr.save(1, state(1))
    s3_proxy.edit_responses(_date_editor(kind))
    with CheckpointManager(url, async_save=False) as mgr:  # reads the lease's and records' ages
        restored = state(0)
        assert mgr.restore(restored).step == 1 and float(restored["w"][0]) == 1.0
        mgr.save(2, state(2))
    assert float(safeckpt.load(url)["w"][0]) == 2.0


@pytest.mark.parametrize(
    "status,code,raised",
    [(503, "ServiceUnavailable", RootUnreachableError), (403, "AccessDenied", safeckpt.ConfigError)],
    ids=["failing", "refused"],
)
def test_a_restore_cut_off_by_the_storage_is_not_taken_for_damage(  # type: ignore[no-untyped-def]
    s3_proxy, s3_bucket, status: int, code: str, raised: type
) -> None:
    """A storage failure or refusal mid-restore is said as such (try again; fix the credentials):
    no fallback to an older step, and the newest one is not moved aside as damaged."""
    url = s3_bucket.url("run")
    with CheckpointManager(url, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
    with CheckpointManager(url, storage_options=SHORT) as mgr:
        # Its data cannot be read (a server failing, after every retry) while the rest can: the
        # fallback rules see one checkpoint that failed to load, and must not take it for damage.
        s3_proxy.fail_next(10_000, status=status, code=code, method="GET", path_contains=".distcp")
        with Timer() as t, pytest.raises(raised):
            mgr.restore(state(0))
        assert t.took < BOUND, t.took
        s3_proxy.clear()
    with reopened(url) as again:
        restored = state(0)
        assert again.restore(restored).step == 2 and float(restored["w"][0]) == 2.0
    assert not [k for k in s3_bucket.keys() if "/.damaged/" in k]  # noqa: SIM118
