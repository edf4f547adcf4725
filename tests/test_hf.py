"""safeckpt.hf: a real ``transformers`` Trainer (a tiny GPT-2 built from a config, random tokens,
dropout on) saving and resuming through a CheckpointManager. Resumes are compared bit for bit with
a run that never stopped."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainerCallback

import hf_toy
import safeckpt
import safeckpt.hf
from safeckpt._util import hf_private
from safeckpt.hf import trainer as hf_trainer

WORKER = Path(__file__).parent / "support" / "hf_worker.py"


class StopAt(TrainerCallback):
    """Ends ``train()`` after step ``at`` (and its save, if one is due), as a crash then would."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.at:
            control.should_training_stop = True
        return control


_references: dict[tuple[Any, ...], tuple[dict[str, torch.Tensor], int]] = {}


def reference(tmp_path: Path, **overrides: Any) -> tuple[dict[str, torch.Tensor], int]:
    """The weights (and rows read) of the run that never stopped, not attached; once per setting."""
    key = tuple(sorted(overrides.items()))
    if key not in _references:
        trainer = hf_toy.trainer(tmp_path / "reference", **overrides)
        trainer.train()
        _references[key] = (hf_toy.weights(trainer), trainer.train_dataset.reads)
    return _references[key]


def attached(tmp_path: Path, root: Any, name: str, *, stop_at: int | None = None, **overrides: Any) -> Any:
    manager_options = overrides.pop("manager_options", {})
    trainer = hf_toy.trainer(tmp_path / name, **overrides)
    if stop_at is not None:
        trainer.add_callback(StopAt(stop_at))
    safeckpt.hf.attach(trainer, root, **manager_options)
    return trainer


def binding(trainer: Any) -> Any:
    return hf_trainer._bindings[trainer]


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))


def close(trainer: Any) -> None:
    manager = safeckpt.hf.manager_of(trainer)
    if manager is not None:
        manager.close()


# --- the door ---------------------------------------------------------------------------


def test_trainer_internals_are_as_written() -> None:
    """A transformers upgrade that renames or changes an internal safeckpt.hf routes fails here."""
    assert hf_private.differences(Trainer) == []

    class Changed(Trainer):
        def _save_checkpoint(self, model: Any) -> None:  # type: ignore[override]
            pass

        _load_rng_state = None  # type: ignore[assignment]

    found = hf_private.differences(Changed)
    assert any("_save_checkpoint(model), not _save_checkpoint(model, trial)" in f for f in found), found
    assert any("_load_rng_state" in f for f in found), found


def test_attach_refuses_what_it_cannot_serve(tmp_path: Path) -> None:
    with pytest.raises(safeckpt.ConfigError, match=r"transformers\.Trainer"):
        safeckpt.hf.attach(object(), tmp_path / "root")
    trainer = hf_toy.trainer(tmp_path / "out")
    safeckpt.hf.attach(trainer, tmp_path / "root")
    with pytest.raises(safeckpt.ConfigError, match="attached already"):
        safeckpt.hf.attach(trainer, tmp_path / "other")
    with pytest.raises(safeckpt.ConfigError, match="resume_from_checkpoint"):
        trainer.train(resume_from_checkpoint=2.5)
    close(trainer)


def test_the_core_package_does_not_import_transformers() -> None:
    code = (
        "import sys, safeckpt, safeckpt.cli; "
        "assert not {'transformers', 'accelerate'} & set(sys.modules), 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- saving and resuming ------------------------------------------------------------------


class CountingTrainer(Trainer):
    """A user's subclass (as TRL's are): its override calls super(), which reaches the manager."""

    saves = 0

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        type(self).saves += 1
        super()._save_checkpoint(model, trial)


def test_saves_go_through_the_manager(tmp_path: Path) -> None:
    root = tmp_path / "root"
    trainer = attached(tmp_path, root, "run", stop_at=5, trainer_class=CountingTrainer)
    trainer.train()
    assert CountingTrainer.saves == 2
    assert committed(root) == [2, 4]
    assert not any(p.name.startswith("checkpoint-") for p in (tmp_path / "run").glob("*"))
    record = safeckpt.read_record(root / "step_4")
    assert record.status == "committed"
    assert "loss" in record.metrics  # what the Trainer logged at that step ranks checkpoints
    restored = safeckpt.load(root / "step_4")
    assert {"model", "optimizer", "scheduler", "trainer"} <= set(restored)
    close(trainer)


@pytest.mark.parametrize(
    ("stop_at", "rows"),
    [(5, 48), (4, 16)],
    ids=["mid-epoch", "epoch-boundary"],
)
def test_resume_is_bit_exact_and_reads_no_skipped_row(tmp_path: Path, stop_at: int, rows: int) -> None:
    """Stopped after ``stop_at`` (saved at 4), resumed without being told: the same bits as a run
    that never stopped, and the rows of the 4 steps already trained are never read again."""
    weights, reads = reference(tmp_path, train_rows=rows)
    root = tmp_path / "root"
    first = attached(tmp_path, root, "first", stop_at=stop_at, train_rows=rows)
    first.train()
    close(first)
    second = attached(tmp_path, root, "second", train_rows=rows)
    second.train()
    assert binding(second).restored_step == 4
    assert second.state.global_step == 8
    assert hf_toy.same(weights, hf_toy.weights(second))
    assert second.train_dataset.reads == reads - 4 * 4  # 4 steps of 4 rows skipped by index
    # the Trainer's state went on: one log entry per step, none twice
    steps = [e["step"] for e in second.state.log_history if "loss" in e]
    assert steps == list(range(1, 9))
    close(second)


def test_manager_options_win_two_tiers_and_overlapped_staging(tmp_path: Path) -> None:
    """``attach``'s options go to the manager: a local first tier uploaded to the root, the copy
    overlapped with the next steps, the user's retention (with the latest kept); bit-exact still."""
    weights, _ = reference(tmp_path)
    root, local = tmp_path / "root", tmp_path / "local"
    options = {"local_dir": local, "overlap_staging": True, "retention": safeckpt.Retention(keep_last=1)}
    first = attached(tmp_path, root, "first", stop_at=5, manager_options=dict(options))
    first.train()
    manager = safeckpt.hf.manager_of(first)
    assert manager is not None
    manager.wait(durable=True)
    close(first)
    assert committed(root) == [4] and (local / "step_4").is_dir()
    second = attached(tmp_path, root, "second", manager_options=dict(options))
    second.train()
    assert binding(second).restored_step == 4
    assert hf_toy.same(weights, hf_toy.weights(second))
    close(second)


def test_a_schedule_saves_besides_the_trainers_strategy(tmp_path: Path) -> None:
    root = tmp_path / "root"
    schedule = safeckpt.SaveSchedule(every=3)
    options = {"schedule": schedule}
    trainer = attached(tmp_path, root, "run", stop_at=7, save_strategy="no", manager_options=options)
    trainer.train()
    assert committed(root) == [3, 6]
    close(trainer)


def _damage(path: Path, how: str) -> None:
    data = max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    if how == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    else:
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_resume_falls_back_past_a_damaged_checkpoint(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    weights, _ = reference(tmp_path)
    root = tmp_path / "root"
    first = attached(tmp_path, root, "first", stop_at=5)
    first.train()
    close(first)
    _damage(root / "step_4", how)
    second = attached(tmp_path, root, "second")
    with caplog.at_level(logging.WARNING):
        second.train()
    assert binding(second).restored_step == 2
    assert "step_4" in caplog.text or "step 4" in caplog.text
    assert hf_toy.same(weights, hf_toy.weights(second))
    assert committed(root)[-1] == 8
    close(second)


def test_explicit_resume_by_step_and_fresh_start(tmp_path: Path) -> None:
    root = tmp_path / "root"
    first = attached(tmp_path, root, "first", stop_at=5)
    first.train()
    close(first)
    second = attached(tmp_path, root, "second", stop_at=3)
    second.train(resume_from_checkpoint=2)
    assert binding(second).restored_step == 2
    with pytest.raises(safeckpt.CheckpointNotFoundError):
        second.train(resume_from_checkpoint=3)
    second.train(resume_from_checkpoint=False)  # from step 0, whatever the root holds
    assert binding(second).restored_step is None
    assert second.state.global_step == 3
    second.train(resume_from_checkpoint=str(root / "step_4"))
    assert binding(second).restored_step == 4
    close(second)


def test_retention_keeps_the_latest_and_the_best_across_restarts(tmp_path: Path) -> None:
    """``save_total_limit=1`` with ``load_best_model_at_end``: the Trainer alone deletes the latest
    (transformers #35070); here the best and the latest both stay, and the best is loaded at the end.
    ``greater_is_better`` on the loss makes an early step the best."""
    options: dict[str, Any] = {
        "eval_strategy": "steps",
        "eval_steps": 2,
        "save_total_limit": 1,
        "load_best_model_at_end": True,
        "metric_for_best_model": "loss",
        "greater_is_better": True,
    }
    root = tmp_path / "root"
    first = attached(tmp_path, root, "first", stop_at=6, **options)
    first.train()
    best = first.state.best_global_step
    assert best is not None and best < 6
    assert set(committed(root)) == {best, 6}
    close(first)
    second = attached(tmp_path, root, "second", **options)
    second.train()
    assert binding(second).restored_step == 6
    assert second.state.best_global_step == best  # the best stayed right across the restart
    assert second.state.best_model_checkpoint == f"{root}/step_{best}"
    assert set(committed(root)) == {best, 8}
    saved_best = safeckpt.load(root / f"step_{best}", )["model"]
    assert hf_toy.same(saved_best, hf_toy.weights(second))  # load_best_model_at_end loaded it
    close(second)


def test_the_trainers_best_step_is_kept_on_a_tie() -> None:
    """The Trainer keeps the first of tied best scores, KeepBest the newest: both stay."""
    from types import SimpleNamespace

    from safeckpt import CheckpointInfo
    from safeckpt.hf.retention import trainer_retention

    args = SimpleNamespace(save_total_limit=1, metric_for_best_model="accuracy", greater_is_better=True)
    policy = trainer_retention(args, None, lambda: 2)
    infos = [CheckpointInfo(step=s, metrics={"eval_accuracy": 0.5}, time=float(s)) for s in (2, 4, 6, 8)]
    assert policy.keep(infos) == {2, 8}  # without the Trainer's best: {8}
    user = trainer_retention(args, safeckpt.Retention(keep_last=1), lambda: 2)
    assert user.keep(infos) == {2, 8}


def test_export_format_hf_loads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from safeckpt.cli import main

    root = tmp_path / "root"
    trainer = attached(tmp_path, root, "run", max_steps=4)
    trainer.train()
    close(trainer)
    out = tmp_path / "exported"
    assert main(["export", str(root), "--format", "hf", "--to", str(out)]) == 0
    assert (out / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(trainer.model)
    assert hf_toy.same(hf_toy.weights(trainer), {k: v for k, v in loaded.state_dict().items()})


def test_import_of_an_hf_checkpoint_folder_happens_once(tmp_path: Path) -> None:
    weights, _ = reference(tmp_path)
    plain = hf_toy.trainer(tmp_path / "hf")
    plain.add_callback(StopAt(5))
    plain.train()  # the Trainer's own checkpoint-2 and checkpoint-4
    folder = tmp_path / "hf" / "checkpoint-4"
    assert folder.is_dir()
    root = tmp_path / "root"
    second = attached(tmp_path, root, "second")
    second.train(resume_from_checkpoint=str(folder))
    assert binding(second).restored_step is None  # the Trainer loaded its own folder
    assert hf_toy.same(weights, hf_toy.weights(second))
    assert committed(root) == [6, 8]
    assert safeckpt.load(root / "step_8")["trainer"]["imported_from"] == str(folder)
    close(second)
    third = attached(tmp_path, root, "third", max_steps=10)
    third.train(resume_from_checkpoint=str(folder))  # the same script again: goes on from the root
    assert binding(third).restored_step == 8
    close(third)


# --- real processes -----------------------------------------------------------------------


def _run(args: list[str], *, kill_at: int | None = None, how: int = signal.SIGKILL) -> tuple[int, list[str]]:
    """Run the worker; send ``how`` once it printed ``step kill_at``. (exit status, lines printed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(safeckpt.__file__).parents[1])]))
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.strip())
        if kill_at is not None and line.strip() == f"step {kill_at}":
            proc.send_signal(how)
            kill_at = None
    return proc.wait(timeout=300), lines


def test_kill_9_then_sigterm_then_done_is_bit_exact(tmp_path: Path) -> None:
    """A real process killed with -9 at a random step, resumed, preempted with SIGTERM (it saves that
    step, waits until it is durable, exits 143), resumed again: the same bits as one that never
    stopped."""
    rng = random.Random(os.environ.get("SAFECKPT_TEST_SEED", "54"))
    root, out = tmp_path / "root", tmp_path / "out"
    common = ["--steps", "12", "--pace", "0.05"]
    weights, _ = reference(tmp_path, max_steps=12)  # in this process: the same bits, one start less
    kill_at = rng.randint(3, 6)
    status, lines = _run([str(root), str(out / "a"), str(tmp_path / "a.pt"), *common], kill_at=kill_at)
    assert status == -signal.SIGKILL and "done" not in lines
    left = committed(root)  # the step saved last may still have been in flight: then the one before
    term_at = rng.randint(8, 10)
    status, lines = _run(
        [str(root), str(out / "b"), str(tmp_path / "b.pt"), *common], kill_at=term_at, how=signal.SIGTERM
    )
    assert status == 128 + signal.SIGTERM, lines
    resumed_b = int(next(line for line in lines if line.startswith("resumed")).split()[1])
    assert resumed_b == (left[-1] if left else 0)
    stopped = int([line for line in lines if line.startswith("step")][-1].split()[1])
    assert stopped >= term_at
    assert committed(root)[-1] == stopped  # the preempted step itself was saved
    assert safeckpt.read_record(root / f"step_{stopped}").status == "committed"
    status, lines = _run([str(root), str(out / "c"), str(tmp_path / "c.pt"), *common])
    assert status == 0 and f"resumed {stopped}" in lines
    assert hf_toy.same(weights, torch.load(tmp_path / "c.pt", weights_only=True))


@pytest.mark.slow
def test_killed_at_random_points_and_resumed_three_times(tmp_path: Path) -> None:
    rng = random.Random(os.environ.get("SAFECKPT_TEST_SEED", "5454"))
    root, out = tmp_path / "root", tmp_path / "out"
    common = ["--steps", "24", "--rows", "40", "--pace", "0.02"]
    status, _ = _run([str(root), str(out / "ref"), str(tmp_path / "ref.pt"), *common, "--plain"])
    assert status == 0
    at = 0
    for i in range(3):
        at = rng.randint(at + 2, at + 7)
        status, lines = _run([str(root), str(out / f"k{i}"), str(tmp_path / f"k{i}.pt"), *common], kill_at=at)
        assert status == -signal.SIGKILL and "done" not in lines
    status, lines = _run([str(root), str(out / "end"), str(tmp_path / "end.pt"), *common])
    assert status == 0
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert hf_toy.same(ref, torch.load(tmp_path / "end.pt", weights_only=True))


# --- S3 -----------------------------------------------------------------------------------


@pytest.mark.s3
def test_s3_root_resumes_bit_exact(tmp_path: Path, s3_bucket: Any) -> None:
    weights, _ = reference(tmp_path)
    root = s3_bucket.url("run")
    first = attached(tmp_path, root, "first", stop_at=5)
    first.train()
    close(first)
    assert any(key.startswith("run/step_4/") for key in s3_bucket.keys())  # noqa: SIM118 - a method
    second = attached(tmp_path, root, "second")
    second.train()
    assert binding(second).restored_step == 4
    assert second.state.best_model_checkpoint is None
    assert hf_toy.same(weights, hf_toy.weights(second))
    close(second)
