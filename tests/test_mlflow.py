"""MlflowRegistrar against a real MLflow: a server on 127.0.0.1 (one per session) and plain sqlite:///.

Unity Catalog (``registry_uri="databricks-uc"``) cannot be reached from here:
only its argument mapping and name validation are tested.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import safeckpt
from safeckpt import (
    CheckpointError,
    CheckpointManager,
    CommitInfo,
    ConfigError,
    Record,
    Retention,
    read_record,
    register_pending,
)
from toy import make_state, same_weights, train_step, weights

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

from safeckpt.mlflow import MlflowRegistrar  # noqa: E402

pytestmark = pytest.mark.mlflow

_HANG = 120.0  # generous bound on waits, never a speed assertion


@pytest.fixture(autouse=True)
def _fail_fast_http(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow retries a refused connection for minutes by default; an outage test wants the failure.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A plain sqlite:/// store, no server; shared by the module (creating its tables takes seconds).

    With no server, MLflow puts artifacts under ``./mlruns`` of the working directory: the module
    runs in the store's directory, so nothing lands in the repository.
    """
    base = tmp_path_factory.mktemp("mlflow_sqlite")
    previous = os.getcwd()
    os.chdir(base)
    try:
        yield f"sqlite:///{base / 'mlflow.db'}"
    finally:
        os.chdir(previous)


@pytest.fixture(params=["server", "sqlite"])
def tracking_uri(request: pytest.FixtureRequest) -> str:
    if request.param == "server":
        return str(request.getfixturevalue("mlflow_server").uri)
    return str(request.getfixturevalue("sqlite_uri"))


def versions(client: Any, name: str) -> dict[int, Any]:
    """step -> the one version tagged with it (asserts there is exactly one per step)."""
    by_step: dict[int, list[Any]] = {}
    for v in client.search_model_versions(f"name='{name}'"):
        by_step.setdefault(int(v.tags["step"]), []).append(v)
    assert all(len(vs) == 1 for vs in by_step.values()), {s: len(vs) for s, vs in by_step.items()}
    return {s: vs[0] for s, vs in by_step.items()}


def train_and_save(
    mgr: CheckpointManager, steps: range, losses: dict[int, float], *, registered: bool = False
) -> dict[int, Any]:
    """Save ``steps``; with ``registered``, wait for each registration before the next save.

    (The next commit may prune the previous checkpoint; one pruned before its
    upload finished is, by design, not registered.)
    """
    state = make_state()
    saved = {}
    for step in steps:
        train_step(state)
        mgr.save(step, state, metrics={"loss": losses.get(step, float(step))})
        saved[step] = weights(state)
        if registered:
            mgr.wait()
            assert first_status(mgr.root, step) == "registered"
    return saved


def load_downloaded(directory: Path) -> dict[str, torch.Tensor]:
    """Load a downloaded version into a fresh state; its model weights."""
    state = make_state(seed=99)
    with CheckpointManager(directory.parent / "reader") as reader:
        restored = reader.restore(state, path=directory)
    assert restored.step is not None
    return weights(state)


def test_three_commits_make_versions_with_tags_and_aliases_and_a_pruned_one_loads(
    tracking_uri: str, root: Path, tmp_path: Path
) -> None:
    name = f"toy-{tmp_path.name}"
    registrar = MlflowRegistrar(
        name, tracking_uri=tracking_uri, aliases=("latest", "best"), tags={"team": "x"}
    )
    retention = Retention(keep_last=1, keep_best=1, metric="loss")
    with CheckpointManager(root, retention=retention, registrar=registrar) as mgr:
        saved = train_and_save(mgr, range(1, 4), {1: 3.0, 2: 1.0, 3: 2.0}, registered=True)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_2", "step_3"]  # best + last

    client = MlflowClient(tracking_uri)
    by_step = versions(client, name)
    assert sorted(by_step) == [1, 2, 3]
    v1 = by_step[1]
    assert v1.tags["metric.loss"] == "3.0"
    assert v1.tags["safeckpt.root"] == str(root.absolute())
    assert v1.tags["team"] == "x" and v1.tags["safeckpt.version"]
    assert client.get_run(v1.tags["safeckpt.run_id"]).info.status == "FINISHED"
    assert str(client.get_model_version_by_alias(name, "newest").version) == str(by_step[3].version)
    assert str(client.get_model_version_by_alias(name, "best").version) == str(by_step[2].version)
    for step in (2, 3):  # step 1's record went with its directory
        record = read_record(root / f"step_{step}")
        assert record is not None and record.registration is not None
        assert record.registration["status"] == "registered"
        assert record.registration["version"] == str(by_step[step].version)

    # Step 1 is pruned locally; its version still holds the whole checkpoint.
    mlflow.set_tracking_uri(tracking_uri)
    try:
        downloaded = Path(
            mlflow.artifacts.download_artifacts(f"models:/{name}/{v1.version}", dst_path=str(tmp_path / "v1"))
        )
    finally:
        mlflow.set_tracking_uri(None)
    assert (downloaded / "metadata.json").exists(), sorted(str(p) for p in downloaded.parent.rglob("*"))
    assert same_weights(safeckpt.load(downloaded)["model"], saved[1])
    assert same_weights(load_downloaded(downloaded), saved[1])


def test_keep_last_1_with_saves_back_to_back_registers_every_commit(
    mlflow_server: Any, root: Path, tmp_path: Path
) -> None:
    """The seed scenario: with keep_last=1, each commit's prune meets the previous commit while it
    uploads. A commit whose registration has not ended is kept until it ends, then pruned."""
    name = f"race-{tmp_path.name}"
    registrar = MlflowRegistrar(name, tracking_uri=mlflow_server.uri, aliases=())
    with CheckpointManager(root, retention=Retention(keep_last=1), registrar=registrar) as mgr:
        saved = train_and_save(mgr, range(1, 4), {})  # no waiting between the saves
    by_step = versions(MlflowClient(mlflow_server.uri), name)
    assert sorted(by_step) == [1, 2, 3]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_3"]  # held back, then pruned at close
    record = read_record(root / "step_3")
    assert record is not None and record.registration["version"] == str(by_step[3].version)
    mlflow.set_tracking_uri(mlflow_server.uri)
    try:
        uri = f"models:/{name}/{by_step[1].version}"
        v1 = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "v1")))
    finally:
        mlflow.set_tracking_uri(None)
    assert same_weights(safeckpt.load(v1)["model"], saved[1])  # uploaded whole before it was pruned


def test_registering_twice_creates_no_second_version(sqlite_uri: str, root: Path, tmp_path: Path) -> None:
    name = f"twice-{tmp_path.name}"
    registrar = MlflowRegistrar(name, tracking_uri=sqlite_uri, experiment=name)
    with CheckpointManager(root, registrar=registrar) as mgr:
        train_and_save(mgr, range(1, 3), {})
    assert register_pending(root, step=1) == [(1, "registered")]  # rebuilt from the record
    again = MlflowRegistrar(name, tracking_uri=sqlite_uri, experiment=name)
    record = read_record(root / "step_2")
    assert record is not None
    assert again.register(2, root.absolute() / "step_2", record)["version"] == "2"
    client = MlflowClient(sqlite_uri)
    by_step = versions(client, name)
    assert sorted(by_step) == [1, 2]
    experiment = client.get_experiment_by_name(name)
    assert {client.get_run(v.run_id).info.experiment_id for v in by_step.values()} == {
        experiment.experiment_id
    }


def test_an_active_run_receives_the_artifacts(sqlite_uri: str, root: Path, tmp_path: Path) -> None:
    name = f"active-{tmp_path.name}"
    mlflow.set_tracking_uri(sqlite_uri)
    try:
        with mlflow.start_run() as run:
            registrar = MlflowRegistrar(name, tracking_uri=sqlite_uri)  # on the thread of the run
            with CheckpointManager(root, registrar=registrar) as mgr:
                train_and_save(mgr, range(1, 3), {})
        client = MlflowClient(sqlite_uri)
        by_step = versions(client, name)
        assert {v.run_id for v in by_step.values()} == {run.info.run_id}
        assert client.get_run(run.info.run_id).info.status == "FINISHED"  # ours to end, not the registrar's
        logged = [a.path for a in client.list_artifacts(run.info.run_id, "safeckpt")]
        assert len(logged) == 2 and all(p.startswith("safeckpt/step_") for p in logged)
    finally:
        mlflow.set_tracking_uri(None)


def test_a_checkpoint_that_did_not_upload_whole_gets_no_version(
    sqlite_uri: str, root: Path, tmp_path: Path
) -> None:
    with CheckpointManager(root, async_save=False) as mgr:
        train_and_save(mgr, range(1, 2), {})
    record = read_record(root / "step_1")
    assert record is not None
    damaged = tmp_path / "copy" / "step_1"
    shutil.copytree(root / "step_1", damaged)
    next(p for p in damaged.iterdir() if p.name.endswith(".distcp")).unlink()  # as if pruned mid-upload
    name = f"partial-{tmp_path.name}"
    with pytest.raises(CheckpointError, match="did not reach MLflow whole"):
        MlflowRegistrar(name, tracking_uri=sqlite_uri).register(1, damaged, record)
    assert versions(MlflowClient(sqlite_uri), name) == {}


def test_a_checkpoint_on_object_storage_is_refused_before_mlflow_is_asked() -> None:
    # MLflow logs a local directory's files: an s3:// URL taken for a path was a directory that is
    # not there, and the registration failed as an upload that "did not reach MLflow whole".
    registrar = MlflowRegistrar("m", tracking_uri="http://127.0.0.1:9")
    record = Record(step=5, time=1.0, files={})
    with pytest.raises(ConfigError, match="is on object storage") as info:
        registrar.register(5, "s3://bucket/run/step_5", record)
    assert info.value.path == "s3://bucket/run/step_5" and info.value.step == 5
    assert registrar._client is None  # no MLflow client made: nothing was sent


def first_status(root: Path, step: int) -> str | None:
    """Wait for the first registration outcome of ``step`` (nothing retries it before the next commit)."""
    deadline = time.monotonic() + _HANG
    while time.monotonic() < deadline:
        record = read_record(root / f"step_{step}")
        if record is not None and record.registration is not None:
            return str(record.registration["status"])
        time.sleep(0.05)
    return None


def wait_statuses(root: Path, expected: dict[int, str]) -> dict[int, str]:
    """Wait until the records' registration statuses are ``expected`` (or time out); the statuses."""
    deadline = time.monotonic() + _HANG
    while True:
        statuses = {}
        for step in expected:
            record = read_record(root / f"step_{step}")
            if record is not None and record.registration is not None:
                statuses[step] = str(record.registration["status"])
        if statuses == expected or time.monotonic() > deadline:
            return statuses
        time.sleep(0.05)


def test_server_killed_mid_run_then_restarted_registers_every_step_once(
    mlflow_server: Any, root: Path, tmp_path: Path
) -> None:
    name = f"outage-{tmp_path.name}"
    registrar = MlflowRegistrar(name, tracking_uri=mlflow_server.uri)
    state = make_state()
    try:
        with CheckpointManager(root, registrar=registrar, registration_timeout=60.0) as mgr:
            mgr.save(1, state, metrics={"loss": 1.0})
            mgr.wait()
            assert wait_statuses(root, {1: "registered"}) == {1: "registered"}
            mlflow_server.kill()
            for step in (2, 3):
                train_step(state)
                mgr.save(step, state, metrics={"loss": 1.0})  # saves go on during the outage
            mgr.wait()
            assert mgr.latest_step == 3
            failed = {2: "failed", 3: "failed"}
            assert wait_statuses(root, failed) == failed
            mlflow_server.start()
            mgr.save(4, state)  # retries 2 and 3 first, then registers 4
            mgr.wait()
        end = {1: "registered", 2: "registered", 3: "registered", 4: "registered"}
        assert wait_statuses(root, end) == end
        assert register_pending(root) == []  # nothing left over
    finally:
        if not mlflow_server.running:
            mlflow_server.start()
    client = MlflowClient(mlflow_server.uri)
    assert sorted(versions(client, name)) == [1, 2, 3, 4]  # each exactly once
    assert client.get_model_version_by_alias(name, "newest").tags["step"] == "4"


def test_a_raising_mlflow_costs_only_the_registration(root: Path, tmp_path: Path) -> None:
    # A tracking URI nothing listens on: every registration fails, nothing else does.
    registrar = MlflowRegistrar("down", tracking_uri="http://127.0.0.1:9", aliases=())
    with CheckpointManager(root, retention=Retention(keep_last=1), registrar=registrar) as mgr:
        train_and_save(mgr, range(1, 4), {})
        mgr.wait()
        assert mgr.latest_step == 3
    assert sorted(p.name for p in root.glob("step_*")) == ["step_3"]
    record = read_record(root / "step_3")
    assert record is not None and record.registration is not None
    assert record.registration["status"] == "failed"
    assert record.registration["registrar"]["tracking_uri"] == "http://127.0.0.1:9"


def _info(**kw: Any) -> CommitInfo:
    record = Record(step=1, time=1.0, files={})
    return CommitInfo(step=1, path=Path("/r/step_1"), record=record, root=Path("/r"), **kw)


@pytest.mark.parametrize(
    ("which", "info", "expected"),
    [
        pytest.param("every", dict(), True, id="every-commit"),
        pytest.param("every", dict(final=True), False, id="every-final"),
        pytest.param("best", dict(is_best=True), True, id="best-best"),
        pytest.param("best", dict(), False, id="best-not-best"),
        pytest.param("final", dict(), False, id="final-commit"),
        pytest.param("final", dict(final=True), True, id="final-final"),
        pytest.param(lambda info: info.step == 1, dict(), True, id="callable"),
    ],
)
def test_which_chooses_commits(which: Any, info: dict[str, Any], expected: bool) -> None:
    assert MlflowRegistrar("m", which=which).should_register(_info(**info)) is expected


def test_unity_catalog_names_are_validated_and_passed_through() -> None:
    registrar = MlflowRegistrar("main.ml.model", registry_uri="databricks-uc", tracking_uri="databricks")
    assert registrar.client_kwargs() == {"tracking_uri": "databricks", "registry_uri": "databricks-uc"}
    data = registrar.to_json()
    assert data["kind"] == "mlflow" and data["registry_uri"] == "databricks-uc"
    assert MlflowRegistrar.from_json(data).client_kwargs() == registrar.client_kwargs()
    for bad in ("model", "ml.model", "a.b.c.d", "a..c", "a.b c.d"):
        with pytest.raises(ConfigError, match="three-level"):
            MlflowRegistrar(bad, registry_uri="databricks-uc")
    MlflowRegistrar("plain-name", registry_uri="sqlite:///x.db")  # other registries take any name


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(which="sometimes"), id="which"),
        pytest.param(dict(aliases=("champion",)), id="alias"),
        pytest.param(dict(model_name=""), id="empty-name"),
        pytest.param(dict(model_name="it's"), id="quote"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs: dict[str, Any]) -> None:
    name = kwargs.pop("model_name", "m")
    with pytest.raises(ConfigError):
        MlflowRegistrar(name, **kwargs)
