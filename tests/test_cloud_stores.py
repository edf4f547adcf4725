"""``gs://`` and ``az://`` roots on their emulators (fake-gcs-server, Azurite): every entry point
takes them, a kill -9 at a request of a save resumes the newest commit, server faults are
retried, two gloo ranks save to one prefix and resume at one, a GCS server that ignores
preconditions is refused, and ``import safeckpt`` imports none of their libraries.

The conformance suite (test_conformance.py) runs the store's own contract on both."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import safeckpt
from s3_proxy import S3FaultProxy
from s3_ranks_launch import launch
from safeckpt._store.registry import open_store
from safeckpt._util.reachability import PROBE_EVERY

pytestmark = pytest.mark.timeout(600)

WORKER = Path(__file__).parent / "support" / "cloud_crash_worker.py"
SMALL_PARTS = {"part_size": 256 << 10, "max_concurrency": 2}


@dataclass
class Cloud:
    """One store's root URLs and the options that reach its emulator (a spawned rank may not see
    the test's environment, so the options say it all)."""

    name: str
    base: str
    options: dict[str, Any]

    def url(self, prefix: str) -> str:
        return f"{self.base}/{prefix}"

    def keys(self, prefix: str) -> list[str]:
        store = open_store(self.base, options=self.options)
        return [k for k, _ in store.client.list(prefix, delimiter=None)[0]]


@pytest.fixture(params=["gcs", "azure"])
def cloud(request: pytest.FixtureRequest) -> Cloud:
    if request.param == "gcs":
        bucket = request.getfixturevalue("gcs_bucket")
        return Cloud("gcs", bucket.url(), bucket.storage_options)
    container = request.getfixturevalue("azure_container")
    return Cloud("azure", container.url(), container.storage_options)


def _state(value: float) -> dict[str, Any]:
    # 1.2 MB: five parts of 256 KiB, more than one request takes (four)
    return {"w": torch.full((300_000,), value), "step": int(value)}


# --- every entry point ---------------------------------------------------------------------------


def test_manager_load_and_cli_take_the_root(cloud: Cloud) -> None:
    url = cloud.url("entry")
    with safeckpt.CheckpointManager(url, async_save=False, storage_options=SMALL_PARTS) as mgr:
        mgr.save(1, _state(1.0))
        mgr.save(2, _state(2.0))
    assert torch.equal(safeckpt.load(url)["w"], _state(2.0)["w"])
    from safeckpt.cli import main

    assert main(["ls", url]) == 0
    assert main(["verify", url]) == 0


def test_a_local_dir_in_front_of_the_root_uploads_every_commit(cloud: Cloud, tmp_path: Path) -> None:
    url = cloud.url("tiers")
    with safeckpt.CheckpointManager(url, local_dir=tmp_path / "node", async_save=False) as mgr:
        mgr.save(1, _state(1.0))
        mgr.flush()
    assert any(k.endswith("step_1/metadata.json") for k in cloud.keys("tiers/"))
    target = _state(0.0)
    with safeckpt.CheckpointManager(url, read_only=True) as reader:  # from the durable copy alone
        assert reader.restore(target).step == 1 and torch.equal(target["w"], _state(1.0)["w"])


def test_a_missing_bucket_or_container_is_one_clear_error(cloud: Cloud) -> None:
    url = cloud.base.replace(cloud.base.split("://")[1], "no-such-place-42") + "/run"
    with (
        pytest.raises(safeckpt.CheckpointError, match="does not exist"),
        safeckpt.CheckpointManager(url, async_save=False, storage_options=cloud.options) as mgr,
    ):
        mgr.save(1, _state(1.0))


# --- a kill -9 at a request of a save ------------------------------------------------------------------


def _run(root: str, kill_at: int, log: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WORKER), root, str(kill_at), str(log)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _kill_and_resume(cloud: Cloud, tmp_path: Path, points: int | None) -> None:
    whole = _run(cloud.url("count"), 0, tmp_path / "count.log")
    assert whole.returncode == 0, whole.stderr
    total = int(whole.stdout.split()[-1])
    assert total > 20
    # Sampled: the first request (the lease), one mid-run (inside a save's uploads) and the last.
    kills = (
        range(1, total + 1)
        if points is None
        else sorted({1, *range(total // points, total, total // points), total})
    )
    for kill_at in kills:
        root, log = cloud.url(f"k{kill_at}"), tmp_path / f"k{kill_at}.log"
        killed = _run(root, kill_at, log)
        assert killed.returncode == -9, (kill_at, killed.stderr)
        lines = log.read_text().split() if log.exists() else []
        known = int(lines[-1]) if lines else 0
        state = _state(-1.0)
        with safeckpt.CheckpointManager(root, storage_options=SMALL_PARTS) as mgr:  # collects leftovers
            restored = mgr.restore(state).step or 0
            assert restored in (known, known + 1), (kill_at, known, restored)
            if restored:
                assert state["step"] == restored and bool((state["w"] == float(restored)).all())
            mgr.save(restored + 10, state)
        parts = [k.split("/") for k in cloud.keys(f"k{kill_at}/")]
        commits = {
            p[1] for p in parts if len(p) == 3 and p[1].startswith("step_") and p[2] == "metadata.json"
        }
        areas = {p[2] for p in parts if p[1] == ".staging"}
        assert len(areas) == len(commits), (kill_at, sorted(areas), sorted(commits))  # no leftover area
        assert not [p for p in parts if p[1] == ".trash"], kill_at


def test_a_kill_at_sampled_requests_of_a_run_resumes_the_newest_commit(cloud: Cloud, tmp_path: Path) -> None:
    _kill_and_resume(cloud, tmp_path, points=2)


@pytest.mark.slow
def test_a_kill_at_every_request_of_a_run_resumes_the_newest_commit(cloud: Cloud, tmp_path: Path) -> None:
    _kill_and_resume(cloud, tmp_path, points=None)


# --- server faults ------------------------------------------------------------------------------------


@pytest.fixture
def faulty(
    cloud: Cloud, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Cloud, S3FaultProxy]]:
    """A fault proxy in front of the store's emulator, and the store reached through it."""
    if cloud.name == "azure":
        azurite = request.getfixturevalue("azurite")
        with S3FaultProxy(f"http://127.0.0.1:{azurite.port}") as proxy:
            string = azurite.connection_string.replace(azurite.endpoint, f"{proxy.endpoint}/devstoreaccount1")
            yield Cloud("azure", cloud.base, {"connection_string": string}), proxy
        return
    # GCS names where an upload's chunks go: a server of its own, told to name the proxy.
    from gcs_server import FakeGcs, _binary

    gcs = FakeGcs(tmp_path, _binary())  # type: ignore[arg-type]
    with S3FaultProxy(gcs.endpoint) as proxy:
        gcs.external = proxy.endpoint
        gcs.start()
        try:
            gcs.make_bucket("faults")
            yield Cloud("gcs", "gs://faults", {"endpoint_url": proxy.endpoint, "token": "anon"}), proxy
        finally:
            gcs.kill()


def test_503_a_reset_mid_upload_and_slow_replies_are_retried_and_the_save_commits(faulty) -> None:  # type: ignore[no-untyped-def]
    cloud, proxy = faulty
    url, options = cloud.url("faults"), {**cloud.options, **SMALL_PARTS}
    data = "comp=block" if cloud.name == "azure" else "upload_id="
    proxy.fail_next(2, status=503, code="ServerBusy", method="PUT")
    proxy.reset_next(1, method="PUT", query_contains=data)  # a part cut mid-body
    proxy.delay_next(2, seconds=1.0, method="GET")
    with safeckpt.CheckpointManager(url, async_save=True, storage_options=options) as mgr:
        mgr.save(1, _state(1.0))
        mgr.wait()
    assert proxy.pending() == 0  # every fault was met
    faults = [r.fault for r in proxy.requests if r.fault]
    assert faults.count("fail") == 2 and faults.count("reset") == 1 and faults.count("delay") == 2
    assert torch.equal(safeckpt.load(url, storage_options=options)["w"], _state(1.0)["w"])


def test_a_server_that_stays_down_fails_the_save_within_the_deadline(faulty) -> None:  # type: ignore[no-untyped-def]
    cloud, proxy = faulty
    options = {**cloud.options, "timeout": 2.0, "connect_timeout": 1.0, "read_timeout": 1.0}
    url = cloud.url("down")
    with safeckpt.CheckpointManager(url, async_save=False, storage_options=options) as mgr:
        mgr.save(1, _state(1.0))
        proxy.go_down("refuse")
        with pytest.raises(safeckpt.CheckpointError, match="not available"):
            mgr.save(2, _state(2.0))
        proxy.come_back()
    # The process marked the service down: a request goes out again after the next probe is due.
    time.sleep(PROBE_EVERY)
    assert safeckpt.load(url, storage_options=options)["step"] == 1  # nothing committed was lost


# --- many ranks ---------------------------------------------------------------------------------------


def test_two_ranks_save_to_one_prefix_and_resume_at_one(cloud: Cloud, tmp_path: Path) -> None:
    from torch import nn

    url = cloud.url("ranks")
    saved = launch("save", url, tmp_path / "r", options=cloud.options)
    assert [s["latest"] for s in saved] == [3, 3] and all(not s["errors"] for s in saved)
    leaves = {k.rsplit("/", 1)[-1] for k in cloud.keys("ranks/") if k.endswith(".distcp")}
    assert leaves == {"__0_0.distcp", "__1_0.distcp"}
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    with safeckpt.CheckpointManager(url, storage_options=cloud.options) as mgr:
        assert mgr.restore({"model": model}, strict=False).step == 3
    for name, tensor in model.state_dict().items():
        whole = torch.cat([torch.tensor(s["weights"][name]) for s in saved]).reshape(tensor.shape)
        assert torch.equal(tensor, whole), name


# --- a server that ignores preconditions, and configuration ------------------------------------------


def test_a_gcs_server_that_ignores_preconditions_is_refused_and_still_read(gcp_storage_emulator) -> None:  # type: ignore[no-untyped-def]
    gcp_storage_emulator.make_bucket("ignored")
    options = {"endpoint_url": gcp_storage_emulator.endpoint, "token": "anon"}
    with (
        pytest.raises(safeckpt.ConfigError, match="ignores If-None-Match"),
        safeckpt.CheckpointManager("gs://ignored/run", async_save=False, storage_options=options) as mgr,
    ):
        mgr.save(1, _state(1.0))
    store = open_store("gs://ignored/run", options=options)
    assert [k for k, _ in store.client.list("run/", delimiter=None)[0]] == []  # nothing was written


def test_importing_safeckpt_imports_no_cloud_library() -> None:
    code = (
        "import sys, safeckpt, safeckpt.storage;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'urllib3', 'google', 'azure', 'requests'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_azure_takes_an_account_name_and_key_as_adlfs_does(azure_container, azurite, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from azurite_server import ACCOUNT, KEY

    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    options = {"account_name": ACCOUNT, "account_key": KEY, "endpoint_url": azurite.endpoint}
    url = azure_container.url("keyed")
    with safeckpt.CheckpointManager(url, async_save=False, storage_options=options) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
    assert float(safeckpt.load(url, storage_options=options)["w"].sum()) == 4.0
    wrong = {**options, "account_key": KEY[:-4] + "AAA="}
    with pytest.raises(safeckpt.CheckpointError, match=r"access denied|403"):
        safeckpt.load(url, storage_options=wrong)


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("gs://Bad_Bucket/x", {}, "not a GCS bucket name"),
        ("gs://bucket/x", {"nope": 1}, "no setting 'nope'"),
        ("gs://bucket/x", {"part_size": 1000}, "multiple of 256 KiB"),
        ("az://ab/x", {"connection_string": "UseDevelopmentStorage=true"}, "not an Azure container name"),
        ("az://acct@ctr/x", {}, "account_name"),
        ("az://ctr/x", {"connection_string": "AccountKey=abc"}, "no AccountName"),
        ("az://ctr/x", {"connection_string": "UseDevelopmentStorage=true", "timeout": 0}, "timeout"),
    ],
    ids=[
        "gs bucket",
        "gs option",
        "gs part size",
        "az container",
        "az account in url",
        "az string",
        "az timeout",
    ],
)
def test_bad_urls_and_options_are_refused_with_what_to_write(
    url: str, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(safeckpt.ConfigError, match=match):
        open_store(url, options=options)


def test_gcs_reads_the_emulator_from_storage_emulator_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from safeckpt._gcs.location import settings

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "localhost:9023")
    chosen = settings({})
    assert (chosen.endpoint, chosen.token, chosen.emulator) == ("http://localhost:9023", "anon", True)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    assert settings({"token": "anon"}).endpoint == "https://storage.googleapis.com"
