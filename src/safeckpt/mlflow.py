"""MLflow model registry integration: each chosen commit becomes a model version.

``pip install safeckpt[mlflow]``; mlflow is imported only when a registration
runs. Use it as any registrar::

    mgr = CheckpointManager(root, retention=Retention(keep_last=2, keep_best=1, metric="val_loss"),
                            registrar=MlflowRegistrar("my-model", tracking_uri="http://mlflow:5000"))

A version holds the whole checkpoint directory (DCP files, train state, the
record), logged as artifacts of a run, so it outlives local pruning and loads
with ``safeckpt.load`` after ``mlflow.artifacts.download_artifacts("models:/my-model/3")``.
Registration runs on the manager's registration thread, rank 0 only; an
MLflow that is down costs only the registration (see ``docs/registry.md``).
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._format.layout import RECORD_NAME
from ._format.record import Record
from ._registration.worker import CommitInfo, best_metric
from ._store.registry import local_path
from ._version import __version__
from .errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

WHICH = ("every", "best", "final")
ROLES = ("latest", "best")
ALIAS_NAMES = {"latest": "newest", "best": "best"}
"""The MLflow alias each role sets. MLflow reserves the alias ``latest`` (its
``models:/name/latest`` is the highest version number), so the newest commit is
``models:/name@newest``."""

UNITY_CATALOG = "databricks-uc"
# Unity Catalog names are catalog.schema.model; each part a plain identifier.
_UC_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")

TAG_STEP = "step"
TAG_TIME = "safeckpt.time"
TAG_ROOT = "safeckpt.root"
TAG_RUN = "safeckpt.run_id"
TAG_VERSION = "safeckpt.version"
TAG_METRIC = "metric."


class MlflowRegistrar:
    """Registers chosen commits as versions of the registered model ``model_name``.

    Args:
        model_name: the registered model (created if missing). With
            ``registry_uri="databricks-uc"`` it must be ``catalog.schema.model``.
        tracking_uri: where runs and artifacts go (default: MLflow's own
            default, e.g. ``MLFLOW_TRACKING_URI``).
        registry_uri: the model registry (default: the tracking URI).
        experiment: the experiment of the runs this registrar opens (when no
            MLflow run is active); default: MLflow's default experiment.
        which: ``"every"`` commit, ``"best"`` (only a commit that is the new
            best by retention's ``keep_best`` metric), ``"final"`` (the
            checkpoint ``latest`` names at ``close()``), or a callable
            ``(CommitInfo) -> bool``.
        aliases: roles to maintain: ``"latest"`` moves the alias ``newest`` to
            the newest commit registered; ``"best"`` moves the alias ``best`` to
            the best version by the retention metric (when one is configured).
        tags: extra tags for every version.

    Each version is tagged ``step``, ``metric.<name>`` for each metric,
    ``safeckpt.root``, ``safeckpt.run_id``, ``safeckpt.time`` and
    ``safeckpt.version``. Registering a commit twice (a retry, ``safeckpt
    register``) finds the version tagged with its step, root and time and
    creates no second one. An MLflow run that is active (on the thread that
    built the registrar, or the registration thread) receives the artifacts;
    otherwise each registration opens and ends its own run.
    """

    def __init__(
        self,
        model_name: str,
        *,
        tracking_uri: str | None = None,
        registry_uri: str | None = None,
        experiment: str | None = None,
        which: str | Callable[[CommitInfo], bool] = "every",
        aliases: Sequence[str] = ("latest",),
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        _check_model_name(model_name, registry_uri)
        if not (callable(which) or which in WHICH):
            raise ConfigError(
                f"MlflowRegistrar(which={which!r}): use 'every', 'best', 'final' or a callable "
                "(info) -> bool."
            )
        if isinstance(aliases, str):
            aliases = (aliases,)
        unknown = [a for a in aliases if a not in ROLES]
        if unknown:
            raise ConfigError(
                f"MlflowRegistrar(aliases={tuple(aliases)!r}): {unknown[0]!r} is not a role; use "
                "'latest' and/or 'best'."
            )
        self.model_name = model_name
        self.tracking_uri = tracking_uri
        self.registry_uri = registry_uri
        self.experiment = experiment
        self.which = which
        self.aliases = tuple(dict.fromkeys(aliases))
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self._client: Any = None
        self._model_ready = False
        self._best_hints: set[tuple[int, str]] = set()
        # MLflow's active run is thread-local and registration runs on its own thread:
        # remember the run active where the registrar is built (mlflow imported means one may be).
        self._run_id: str | None = None
        if "mlflow" in sys.modules:
            run = sys.modules["mlflow"].active_run()
            self._run_id = run.info.run_id if run is not None else None

    # --- the optional registrar methods -------------------------------------------

    def should_register(self, info: CommitInfo) -> bool:
        if not _is_rank0():
            return False
        if info.is_best:  # for `best` when the record's retention is a policy it cannot rebuild
            self._best_hints.add((info.step, repr(info.record.time)))
        if callable(self.which):
            return bool(self.which(info))
        if self.which == "final":
            return info.final
        if info.final:
            return False  # registered at its commit already
        return self.which == "every" or info.is_best

    def to_json(self) -> dict[str, Any]:
        tracking_uri = self.tracking_uri
        if tracking_uri is None and "mlflow" in sys.modules:
            tracking_uri = sys.modules["mlflow"].get_tracking_uri()  # the effective default
        return {
            "kind": "mlflow",
            "model_name": self.model_name,
            "tracking_uri": tracking_uri,
            "registry_uri": self.registry_uri,
            "experiment": self.experiment,
            "which": self.which if isinstance(self.which, str) else "callable",
            "aliases": list(self.aliases),
            "tags": dict(self.tags),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MlflowRegistrar:
        which = data.get("which", "every")
        return cls(
            str(data["model_name"]),
            tracking_uri=data.get("tracking_uri"),
            registry_uri=data.get("registry_uri"),
            experiment=data.get("experiment"),
            # A callable cannot be rebuilt; `safeckpt register` registers what it is told to.
            which=which if which in WHICH else "every",
            aliases=tuple(data.get("aliases", ("latest",))),
            tags=data.get("tags") or None,
        )

    def client_kwargs(self) -> dict[str, str | None]:
        """The arguments of the ``MlflowClient`` this registrar uses."""
        return {"tracking_uri": self.tracking_uri, "registry_uri": self.registry_uri}

    def close(self) -> None:
        self._client = None

    # --- registering ------------------------------------------------------------------

    def register(self, step: int, path: Path | str, record: Record) -> dict[str, Any]:
        """Create (or find) the version of this commit and move the aliases. Raises on MLflow errors,
        and with :class:`ConfigError` for a checkpoint on object storage (``path`` a URL): MLflow
        logs the files of a local directory."""
        local = local_path(path)
        if local is None:
            raise ConfigError(
                f"MlflowRegistrar uploads a checkpoint's files from a local directory, and {path} is "
                "on object storage: register the checkpoints of a local root, or log this one to "
                "MLflow from a local copy.",
                path=str(path),
                step=step,
            )
        client = self._get_client()
        directory = Path(local)
        root = str(directory.parent)
        time_tag = repr(record.time)
        version = self._find(client, step, root, time_tag)
        if version is None:
            version = self._create(client, step, directory, record, root, time_tag)
        else:
            logger.info(
                "safeckpt: step %d is already version %s of %s", step, version.version, self.model_name
            )
        moved = self._move_aliases(client, version, record)
        return {
            "model_name": self.model_name,
            "version": str(version.version),
            "run_id": version.run_id,
            "model_uri": f"models:/{self.model_name}/{version.version}",
            "aliases": moved,
        }

    def _get_client(self) -> Any:
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(**self.client_kwargs())
        return self._client

    def _find(self, client: Any, step: int, root: str, time_tag: str) -> Any:
        """The version already made of this commit (same step, root and record time), or None."""
        from mlflow.exceptions import MlflowException

        try:
            found = client.search_model_versions(f"name='{self.model_name}' and tags.{TAG_STEP}='{step}'")
        except MlflowException:
            # Some registries (Unity Catalog) filter by name only: filter the tags here.
            found = client.search_model_versions(f"name='{self.model_name}'")
        mine = [v for v in found if v.tags.get(TAG_ROOT) == root and v.tags.get(TAG_TIME) == time_tag]
        return min(mine, key=lambda v: int(v.version)) if mine else None

    def _create(self, client: Any, step: int, path: Path, record: Record, root: str, time_tag: str) -> Any:
        run_id, own = self._run(client, step, root)
        try:
            # A run shared by several commits (an active one) gets a path per commit, so a
            # re-save of a step never overwrites the files of the version made before it.
            artifact_path = (
                f"safeckpt/{path.name}" if own else f"safeckpt/{path.name}-{int(record.time * 1e3)}"
            )
            client.log_artifacts(run_id, str(path), artifact_path)
            _check_uploaded(client, run_id, artifact_path, step, path, record)
            source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
            self._ensure_model(client)
            tags = {
                **self.tags,
                TAG_STEP: str(step),
                TAG_TIME: time_tag,
                TAG_ROOT: root,
                TAG_RUN: run_id,
                TAG_VERSION: __version__,
            }
            for name, value in record.metrics.items():
                if value is not None:
                    tags[TAG_METRIC + name] = repr(float(value))
            version = client.create_model_version(self.model_name, source, run_id=run_id, tags=tags)
        except BaseException:
            if own:
                _quietly(client.set_terminated, run_id, "FAILED")
            raise
        if own:
            client.set_terminated(run_id)
        logger.info("safeckpt: step %d is version %s of %s", step, version.version, self.model_name)
        return version

    def _run(self, client: Any, step: int, root: str) -> tuple[str, bool]:
        """The run to log into: an active one, or a new one of our own (ended after use)."""
        import mlflow

        active = mlflow.active_run()
        if active is not None:
            return active.info.run_id, False
        if self._run_id is not None:
            return self._run_id, False
        run = client.create_run(
            self._experiment_id(client),
            run_name=f"safeckpt-step-{step}",
            tags={TAG_ROOT: root, TAG_STEP: str(step), TAG_VERSION: __version__},
        )
        return run.info.run_id, True

    def _experiment_id(self, client: Any) -> str:
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return str(experiment.experiment_id)
        return str(client.create_experiment(name))

    def _ensure_model(self, client: Any) -> None:
        if self._model_ready:
            return
        from mlflow.exceptions import MlflowException

        try:
            client.create_registered_model(self.model_name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        self._model_ready = True

    def _move_aliases(self, client: Any, version: Any, record: Record) -> list[str]:
        """Move each configured alias to ``version`` if it is the newer (or better) one; those moved."""
        moved = []
        for role in self.aliases:
            alias = ALIAS_NAMES[role]
            current = _by_alias(client, self.model_name, alias)
            if current is not None and str(current.version) == str(version.version):
                moved.append(alias)
                continue
            move: bool | None
            if role == "latest":
                move = current is None or not _tag_float(current, TAG_TIME) > record.time
            else:
                move = self._is_better(version, current, record)
                if move is None:  # no metric to compare: trust the manager's word at the commit
                    move = (record.step, repr(record.time)) in self._best_hints
            if move:
                client.set_registered_model_alias(self.model_name, alias, str(version.version))
                moved.append(alias)
        return moved

    def _is_better(self, version: Any, current: Any, record: Record) -> bool | None:
        """Whether ``version`` beats ``current`` by the retention metric; None without one."""
        found = best_metric(_retention(record))
        if found is None:
            return None
        metric, mode = found
        value = record.metrics.get(metric)
        if value is None or math.isnan(value):
            return False
        if current is None:
            return True
        theirs = _tag_float(current, TAG_METRIC + metric)
        if math.isnan(theirs):
            return True
        if value == theirs:  # a tie goes to the newer commit, as in KeepBest
            return not _tag_float(current, TAG_TIME) > record.time
        return value < theirs if mode == "min" else value > theirs


def _check_uploaded(
    client: Any, run_id: str, artifact_path: str, step: int, path: Path, record: Record
) -> None:
    """Raise unless every file of ``record`` (and the record) reached the run with its size.

    Retention may prune the checkpoint while it uploads (registration never
    holds pruning up), and ``log_artifacts`` of a vanished directory uploads
    nothing without an error: a version must never point at a partial copy.
    """
    uploaded = _artifact_sizes(client, run_id, artifact_path)
    expected = {**record.files, RECORD_NAME: None}
    missing = [
        rel
        for rel, size in expected.items()
        if rel not in uploaded or (size is not None and uploaded[rel] != size)
    ]
    if missing:
        raise CheckpointError(
            f"step {step}: {len(missing)} file(s) of {path} did not reach MLflow whole (e.g. {missing[0]}); "
            "it was probably pruned while it uploaded. No version was created for it.",
            step=step,
            path=str(path),
        )


def _artifact_sizes(client: Any, run_id: str, top: str) -> dict[str, int | None]:
    sizes: dict[str, int | None] = {}
    pending = [top]
    while pending:
        for item in client.list_artifacts(run_id, pending.pop()):
            if item.is_dir:
                pending.append(item.path)
            else:
                sizes[item.path[len(top) + 1 :]] = item.file_size
    return sizes


def _check_model_name(name: Any, registry_uri: str | None) -> None:
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"MlflowRegistrar(model_name={name!r}): give the registered model's name.")
    if "'" in name or "\n" in name:
        raise ConfigError(f"MlflowRegistrar(model_name={name!r}): quotes and newlines are not allowed.")
    if registry_uri is not None and registry_uri.split(":")[0] == UNITY_CATALOG:
        parts = name.split(".")
        if len(parts) != 3 or not all(_UC_PART.match(p) for p in parts):
            raise ConfigError(
                f"MlflowRegistrar(model_name={name!r}, registry_uri={registry_uri!r}): Unity Catalog "
                "needs a three-level name 'catalog.schema.model' (letters, digits, '_' and '-')."
            )


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _by_alias(client: Any, name: str, alias: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def _tag_float(version: Any, key: str) -> float:
    try:
        return float(version.tags.get(key, "nan"))
    except (TypeError, ValueError):
        return math.nan


def _retention(record: Record) -> Any:
    from ._policy.retention import Retention

    if not record.retention:
        return None
    try:
        return Retention.from_json(record.retention)
    except Exception:  # a custom policy (not rebuildable), or a record from another version
        return None


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as e:
        logger.debug("safeckpt: %s failed while handling another error: %s", fn, e)
