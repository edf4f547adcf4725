"""Regenerate the tables of ``benchmarks/results.md`` with one command.

    .venv/bin/python benchmarks/run_all.py                 # every section (also: make bench)
    .venv/bin/python benchmarks/run_all.py --only bench_save --quick
    .venv/bin/python benchmarks/run_all.py --dry-run       # list the commands

Each section is one benchmark command whose standard output is Markdown (its
progress goes to standard error). A section of tables (``runs=3``, the default)
is run 3 times, interleaved with the other sections (run 1 of every section,
then run 2, then run 3), each run writing its report with ``--json``; the block
shows the runs together: the median of the 3 medians, their spread, "vs best
peer", and verdicts that stand only when all 3 runs agree (``bench_tables``).
A section with ``runs=1`` is run once and its Markdown used as it is.
The result replaces the block between
``<!-- bench:<key>:start -->`` and ``<!-- bench:<key>:end -->`` in the document;
a section not in the document yet is appended under its title. Everything
outside the markers is left as it is. ``docs/performance.md``, the page for
users, takes its figures from the blocks by hand. A
section that fails or cannot run (no FUSE, no second rank) keeps its previous
block, with a line saying why it was not refreshed; a section that exits with
status 77 (``SKIPPED``: it cannot run on this machine, e.g. no FUSE) does not
make ``run_all`` fail, any other non-zero status does. A run that exits with
status 3 (``BEATEN``: a peer beats a limit) still counts; ``run_all`` fails when,
over the runs, a peer's median of medians beats a limit (the block says which).

To add a section, append a :class:`Section` to ``SECTIONS``; a multi-rank
benchmark gives its launcher in ``command`` (``torchrun --nproc-per-node 2 ...``)
and prints its Markdown on rank 0 only.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import filesystem_of, machine
from bench_tables import BEATEN, Report, beaten_limits, merged_markdown

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "benchmarks" / "results.md"
PYTHON = ".venv/bin/python"
SKIPPED = 77  # exit status of a benchmark that cannot run here (the automake convention)


@dataclass(frozen=True)
class Section:
    """One benchmark command and where its Markdown goes."""

    key: str
    title: str
    command: tuple[str, ...]
    """Run from the repository root; prints Markdown on stdout."""
    quick: tuple[str, ...] = field(default=())
    """Extra arguments for ``--quick``."""
    runs: int = 3
    """Interleaved runs merged into one block; the command must take ``--json PATH`` and write a
    :class:`bench_tables.Report` there. 1: run once, its Markdown used as printed."""

    def argv(self, quick: bool) -> list[str]:
        return [*self.command, *(self.quick if quick else ())]


SECTIONS: tuple[Section, ...] = (
    Section(
        key="bench_checksum",
        title="Checksum throughput",
        command=(PYTHON, "benchmarks/bench_checksum.py"),
        quick=("--mib", "64", "--reps", "3"),
        runs=1,  # prints its own Markdown (no report)
    ),
    Section(
        key="bench_save",
        title="Single process: save, restore, step time, cleanup",
        command=(PYTHON, "benchmarks/bench_save.py"),
        quick=("--size-gib", "0.25", "--reps", "3"),
    ),
    Section(
        key="bench_ranks",
        title="Two ranks: sharded saves",
        command=(PYTHON, "benchmarks/bench_ranks.py"),
        quick=("--size-gib", "0.25", "--reps", "3"),
    ),
    Section(
        key="bench_nfs_prune",
        title="Pruning on emulated NFS",
        command=(PYTHON, "benchmarks/bench_nfs_prune.py"),
        quick=("--seeds", "0"),
        runs=1,  # counts, not timings
    ),
    Section(
        key="bench_s3",
        title="Object storage: s3:// on a moto server",
        command=(PYTHON, "benchmarks/bench_s3.py"),
        quick=("--size-mib", "64", "--reps", "3"),
        runs=1,  # its rounds pair each row with its limit; prints its own Markdown
    ),
    Section(
        key="bench_tiers",
        title="Two tiers: a local directory, then s3:// on a moto server",
        command=(PYTHON, "benchmarks/bench_tiers.py"),
        quick=("--size-mib", "64", "--reps", "3"),
        runs=1,  # rounds of both managers in one run; prints its own Markdown
    ),
    Section(
        key="bench_overlap",
        title="Overlapped staging: what save() blocks, and the step after it",
        command=(PYTHON, "benchmarks/bench_overlap.py"),
        quick=("--width", "1024", "--reps", "5"),
        runs=1,  # rotated rounds in one run; prints its own Markdown
    ),
    Section(
        key="bench_state",
        title="Nested state: state dicts, Stateful wrappers, 10,000 tensors",
        command=(PYTHON, "benchmarks/bench_state.py"),
        quick=("--size-gib", "0.1", "--reps", "3"),
    ),
    Section(
        key="bench_restart",
        title="A job killed with -9 and restarted: time to its first commit",
        command=(PYTHON, "benchmarks/bench_restart.py"),
        quick=("--rounds", "1"),
        runs=1,  # rounds in one run, against the targets; prints its own Markdown
    ),
    Section(
        key="bench_outage",
        title="Object storage that goes away: how long each call takes to end",
        command=(PYTHON, "benchmarks/bench_outage.py"),
        runs=1,  # one pass of each scenario, against the bounds; prints its own Markdown
    ),
    Section(
        key="bench_startup",
        title="Start-up of the command",
        command=(PYTHON, "benchmarks/bench_startup.py"),
        quick=("--reps", "3"),
        runs=1,  # rotated repetitions in one run, each against `import torch`; prints its own Markdown
    ),
)


def begin(key: str) -> str:
    return f"<!-- bench:{key}:start -->"


def end(key: str) -> str:
    return f"<!-- bench:{key}:end -->"


def replace_block(doc: str, key: str, title: str, body: str) -> str:
    """``doc`` with the block of ``key`` replaced by ``body`` (appended under ``title`` if absent)."""
    block = f"{begin(key)}\n{body.rstrip()}\n{end(key)}"
    pattern = re.compile(re.escape(begin(key)) + r".*?" + re.escape(end(key)), re.DOTALL)
    if pattern.search(doc):
        return pattern.sub(lambda _: block, doc, count=1)
    return doc.rstrip() + f"\n\n## {title}\n\n{block}\n"


def current_block(doc: str, key: str) -> str | None:
    match = re.search(re.escape(begin(key)) + r"\n(.*?)\n" + re.escape(end(key)), doc, re.DOTALL)
    return match.group(1) if match else None


def machine_block() -> str:
    info = machine() | {"filesystem (benchmark files)": filesystem_of(Path(tempfile.gettempdir()))}
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in info.items())]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"Last regenerated {stamp} on:\n\n" + "\n".join(lines)


@dataclass(frozen=True)
class Outcome:
    markdown: str | None
    why_not: str = ""
    failed: bool = False
    report: Report | None = None
    """The run's report (sections with ``runs > 1``)."""


def run_section(section: Section, quick: bool, report_path: Path | None = None) -> Outcome:
    """One run: the section's Markdown (and report), or why there is none (and whether that fails)."""
    argv = section.argv(quick)
    if argv[0] == PYTHON and not (REPO / argv[1]).exists():
        return Outcome(None, f"{argv[1]} does not exist", failed=True)
    if report_path is not None:
        argv += ["--json", str(report_path)]
    print(f"[run_all] {shlex.join(argv)}", file=sys.stderr, flush=True)
    done = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, text=True, check=False)
    shown = shlex.join(section.argv(quick))
    if done.returncode == SKIPPED:
        return Outcome(None, f"`{shown}` cannot run on this machine (see its message)")
    ok = (0, BEATEN) if report_path is not None else (0,)
    if done.returncode not in ok:
        return Outcome(None, f"`{shown}` exited with status {done.returncode}", failed=True)
    if not done.stdout.strip():
        return Outcome(None, f"`{shown}` printed nothing", failed=True)
    if report_path is None:
        return Outcome(done.stdout)
    if done.returncode == BEATEN:
        print(f"[run_all] {section.key}: a peer beats a limit in this run", file=sys.stderr)
    try:
        return Outcome(done.stdout, report=Report.load(report_path))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return Outcome(None, f"`{shown}` wrote no readable report ({exc})", failed=True)


def interleaved(sections: list[Section], runs: dict[str, int]) -> list[tuple[int, Section]]:
    """``(run, section)`` in the order they run: run 1 of every section, then run 2, ..."""
    most = max(runs.values(), default=0)
    return [(r, s) for r in range(most) for s in sections if r < runs[s.key]]


def merged(section: Section, outcomes: list[Outcome]) -> Outcome:
    """One block from a section's runs; a failure when a peer beats a limit over the runs."""
    reports = [o.report for o in outcomes if o.report is not None]
    if not reports:
        return outcomes[-1]
    markdown = merged_markdown(reports)
    if beaten := beaten_limits(reports):
        print(f"[run_all] {section.key}: FAILED: {'; '.join(beaten)}", file=sys.stderr)
    return Outcome(markdown, failed=bool(beaten))


def main(argv: list[str] | None = None) -> int:
    keys = [s.key for s in SECTIONS]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=keys, default=keys, help="sections to run")
    p.add_argument("--quick", action="store_true", help="smaller, faster runs (not for the published table)")
    p.add_argument("--doc", type=Path, default=DOC, help="the document to update")
    p.add_argument("--dry-run", action="store_true", help="print the commands and change nothing")
    p.add_argument(
        "--runs", type=int, default=None, help="runs of every table section (default: 3; 1 for a check)"
    )
    args = p.parse_args(argv)
    chosen = [s for s in SECTIONS if s.key in args.only]
    runs = {s.key: s.runs if s.runs == 1 or args.runs is None else args.runs for s in chosen}
    order = interleaved(chosen, runs)
    if args.dry_run:
        for r, section in order:
            extra = " --json RUN.json" if section.runs > 1 else ""
            print(f"# run {r + 1}: {shlex.join(section.argv(args.quick))}{extra}")
        return 0
    doc = args.doc.read_text() if args.doc.exists() else "# Performance\n"
    failed = 0
    done: dict[str, list[Outcome]] = {s.key: [] for s in chosen}
    stopped: set[str] = set()
    scratch = Path(tempfile.mkdtemp(prefix="run_all-"))  # kept: every run's report, for the analysis
    print(f"[run_all] per-run reports go to {scratch}", file=sys.stderr)
    for r, section in order:
        if section.key in stopped:
            continue
        report_path = scratch / f"{section.key}.{r + 1}.json" if section.runs > 1 else None
        outcome = run_section(section, args.quick, report_path)
        done[section.key].append(outcome)
        if outcome.markdown is not None and len(done[section.key]) < runs[section.key]:
            continue  # more runs to come
        stopped.add(section.key)
        if outcome.markdown is not None and section.runs > 1:
            outcome = merged(section, done[section.key])
        body = outcome.markdown
        if body is None:
            failed += outcome.failed
            previous = current_block(doc, section.key) or "_Not measured yet._"
            previous = re.sub(r"\n*_Not refreshed in the last run: .*_$", "", previous)
            body = f"{previous}\n\n_Not refreshed in the last run: {outcome.why_not}._"
            print(f"[run_all] {section.key}: not refreshed: {outcome.why_not}", file=sys.stderr)
        else:
            failed += outcome.failed
            if args.quick:
                body += "\n_Quick run (`run_all.py --quick`): smaller state, fewer repetitions._\n"
        doc = replace_block(doc, section.key, section.title, body)
        args.doc.write_text(doc)  # after each section: a later failure keeps what is done
    doc = replace_block(doc, "machine", "Machine", machine_block())
    args.doc.write_text(doc)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
