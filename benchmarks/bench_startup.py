"""Start-up of the ``safeckpt`` command, against ``python -c "import torch"`` (not a test).

    .venv/bin/python benchmarks/bench_startup.py [--reps 10]
    .venv/bin/python benchmarks/bench_startup.py --before /tmp/before/src   # another checkout beside it

Wall time of whole processes, as a person at a shell feels them: ``safeckpt
--help``, a bad argument (exit 2), ``safeckpt ls`` of a local root with three
committed checkpoints, ``import safeckpt``, ``from safeckpt import
CheckpointManager`` and ``import torch``. In each repetition every command runs
once, in the order :func:`bench_common.interleaved` gives it (every command in
every position, after every other), after one warm-up run of each; the table gives the
median, the lowest and highest, and for ``ls`` the median of its ratios to
``import torch`` in the same repetition. Targets (issue 52, item 8): help and a
bad argument under 0.5 s, ``ls`` under 0.6x ``import torch``.

``--before SRC`` runs the same commands with ``PYTHONPATH=SRC`` too (the
``src`` folder of another checkout, e.g. ``git worktree add /tmp/before
<rev>``), in the same repetitions, so before and after share the machine's
load. Prints Markdown on stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import interleaved

HELP_LIMIT_S = 0.5
LS_LIMIT = 0.6  # of `import torch`


@dataclass(frozen=True)
class Variant:
    label: str
    argv: tuple[str, ...]
    src: str | None = None  # PYTHONPATH: another checkout's code
    expect: int = 0


def safeckpt_command() -> list[str]:
    script = Path(sys.executable).parent / "safeckpt"
    return [str(script)] if script.exists() else [sys.executable, "-m", "safeckpt"]


def make_root(parent: Path) -> Path:
    """A local root with three committed checkpoints (made in a child: this process stays light)."""
    root = parent / "root"
    code = (
        "import sys, torch\n"
        "from safeckpt import CheckpointManager\n"
        "state = {'model': torch.nn.Linear(64, 64)}\n"
        "with CheckpointManager(sys.argv[1], async_save=False) as mgr:\n"
        "    for step in (100, 200, 300):\n"
        "        mgr.save(step, state, metrics={'loss': 1.0 / step})\n"
    )
    subprocess.run([sys.executable, "-c", code, str(root)], check=True)
    return root


def variants(root: Path, before: str | None) -> list[Variant]:
    cli = safeckpt_command()
    py = sys.executable
    ours = [
        Variant("`safeckpt --help`", (*cli, "--help")),
        Variant("`safeckpt lss` (a bad argument)", (*cli, "lss"), expect=2),
        Variant("`safeckpt ls ROOT`", (*cli, "ls", str(root))),
        Variant('`python -c "import safeckpt"`', (py, "-c", "import safeckpt")),
        Variant(
            '`python -c "from safeckpt import CheckpointManager"`',
            (py, "-c", "from safeckpt import CheckpointManager"),
        ),
    ]
    torch = [Variant('`python -c "import torch"`', (py, "-c", "import torch"))]
    if before is None:
        return ours + torch
    theirs = [Variant(v.label, v.argv, src=before, expect=v.expect) for v in ours]
    return [v for pair in zip(theirs, ours, strict=True) for v in pair] + torch


def run_once(variant: Variant) -> float:
    env = dict(os.environ)
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    env["COLUMNS"] = "80"
    if variant.src is not None:
        env["PYTHONPATH"] = variant.src
    start = time.perf_counter()
    done = subprocess.run(variant.argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    took = time.perf_counter() - start
    if done.returncode != variant.expect:
        raise SystemExit(f"{' '.join(variant.argv)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return took


def check_source(before: str) -> None:
    """The ``--before`` code is what runs (not this checkout's, installed in the venv)."""
    code = "import safeckpt; print(safeckpt.__file__)"
    env = {**os.environ, "PYTHONPATH": before}
    where = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    if not where.stdout.strip().startswith(str(Path(before).resolve())):
        raise SystemExit(f"--before {before}: safeckpt is imported from {where.stdout.strip()}, not there")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--before", metavar="SRC", help="another checkout's src folder, run beside this one")
    args = parser.parse_args()
    if args.before:
        check_source(args.before)
    with tempfile.TemporaryDirectory(prefix="bench_startup-") as tmp:
        root = make_root(Path(tmp))
        chosen = variants(root, args.before)
        for variant in chosen:  # warm-up: the page cache holds every module afterwards
            run_once(variant)
        times: dict[Variant, list[float]] = {v: [] for v in chosen}
        for rep in range(args.reps):
            for variant in interleaved(chosen, rep):
                times[variant].append(run_once(variant))
            print(f"rep {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
    torch_times = times[chosen[-1]]
    print(
        f"Produced by `.venv/bin/python benchmarks/bench_startup.py --reps {args.reps}"
        + (" --before SRC`" if args.before else "`")
        + f": wall time of each command, {args.reps} repetitions in an interleaved order after a warm-up; "
        "median (lowest-highest). *vs import torch*: the median of the ratios to `import torch` in "
        "the same repetition."
    )
    print()
    side = args.before is not None  # a column saying whose code ran
    print("| command |" + (" code |" if side else "") + " median | range | vs import torch | target |")
    print("|---|" + ("---|" if side else "") + "---:|---:|---:|---|")
    for variant in chosen:
        samples = times[variant]
        ratios = [t / base for t, base in zip(samples, torch_times, strict=True)]
        target = ""
        if "--help" in variant.label or "bad argument" in variant.label:
            met = sum(t < HELP_LIMIT_S for t in samples)
            target = f"< {HELP_LIMIT_S} s: {_verdict(met, len(samples))}"
        elif "ls ROOT" in variant.label:
            met = sum(r < LS_LIMIT for r in ratios)
            target = f"< {LS_LIMIT}x: {_verdict(met, len(samples))}"
        code = "before" if variant.src is not None else ("this" if variant is not chosen[-1] else "")
        print(
            f"| {variant.label} |" + (f" {code} |" if side else "") + f" {statistics.median(samples):.2f} s "
            f"| {min(samples):.2f}-{max(samples):.2f} s | {statistics.median(ratios):.2f}x | {target} |"
        )
    return 0


def _verdict(met: int, reps: int) -> str:
    return "met" if met == reps else ("not met" if met == 0 else f"met in {met} of {reps}")


if __name__ == "__main__":
    sys.exit(main())
