"""Benchmark results: rows, tables, reports, and verdicts that hold across runs.

A script measures one run: a :class:`Table` per measurement, a :class:`Row` per
variant, one value per repetition. ``run_all.py`` runs every script several times
(3), interleaved with the other scripts, and renders the runs of a table together
(:func:`render`): the median of the runs' medians, their spread (lowest-highest
run median), each safeckpt row's time against the fastest peer's, and a verdict
that stands only when every run agrees ("met", "missed"), else "unstable".

A limit is the fastest of several strategies, each measured once per repetition:
the strategy with the lowest median time in the run (:meth:`Table.resolve`), and
each row divided by that strategy's time in the same repetition. Not the
lowest time of each repetition: where strategies do the same work (three
``O_DIRECT`` writes of different sizes) that is the lowest of several draws of
one noisy quantity, below what any strategy does typically; each table also
reports its rows against it, for comparison.

A table whose limit is a lower bound (``bound=True``: raw memcpy, write, read)
says so when a peer beats it (median below 1.0x), and the script exits with
:data:`BEATEN` after printing: such a limit is not one.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BEATEN = 3
"""Exit status of a benchmark that printed its tables but where a peer beats a limit."""

OURS, PEER, REFERENCE = "ours", "peer", "reference"


@dataclass
class Row:
    """One variant of a measurement: a value per repetition (a ratio, or milliseconds)."""

    name: str
    values: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    target: float | None = None
    """Upper bound on the median value (None: no verdict)."""
    note: str = ""
    role: str = ""
    """``"ours"`` (verdict and "vs best peer"), ``"peer"`` (compared against), ``"reference"``
    (neither, e.g. a floor); empty: ours when it has a target or its name starts with safeckpt."""
    limit_reps: list[int] = field(default_factory=list)
    """For a row measured against the table's strategies: the repetition of each of ``seconds``."""
    vs_fastest_draw: list[float] = field(default_factory=list)
    """Each of ``seconds`` against the lowest strategy time of its repetition (for comparison)."""
    limit_times: dict[str, list[float]] = field(default_factory=dict)
    """The row's own limit strategies (rows of one table measuring different bytes), else empty."""
    fastest: str = ""
    group: str = ""
    """Where the rows of one table measure different states: the state this row measured. Its
    "vs best peer" is against the fastest peer of its own group."""

    @property
    def kind(self) -> str:
        if self.role:
            return self.role
        return OURS if self.target is not None or self.name.lower().startswith("safeckpt") else PEER

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    @property
    def max(self) -> float:
        return max(self.values) if self.values else math.nan

    @property
    def median_seconds(self) -> float:
        finite = [s for s in self.seconds if not math.isnan(s)]
        return statistics.median(finite) if finite else math.nan

    @property
    def met(self) -> bool | None:
        """Whether this run's median meets the target (None: no target or no values)."""
        if self.target is None or not self.values:
            return None
        return self.median <= self.target

    @property
    def verdict(self) -> str:
        return _verdict([self])


@dataclass
class Table:
    """One measurement: what is divided by what (or measured in ms), and a row per variant."""

    key: str
    title: str
    measure: str
    """What a value is, e.g. ``save() return time / memcpy``."""
    limit: str = ""
    limit_seconds: list[float] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    unit: str = "x"
    """``"x"``: values are ratios against the limit; ``"ms"``: values are milliseconds."""
    notes: list[str] = field(default_factory=list)
    bound: bool = False
    """The limit is a lower bound: a peer whose median is below 1.0x beats it, and the run fails."""
    limit_times: dict[str, list[float]] = field(default_factory=dict)
    """Seconds of each strategy the limit is the fastest of, per repetition."""
    fastest: str = ""
    """The strategy with the lowest median time (set by :meth:`resolve`)."""

    def row(
        self, name: str, *, target: float | None = None, note: str = "", role: str = "", group: str = ""
    ) -> Row:
        """The row called ``name``, created (with ``target``, ``role``, ``group``) on first use."""
        for row in self.rows:
            if row.name == name:
                return row
        row = Row(name, target=target, note=note, role=role, group=group)
        self.rows.append(row)
        return row

    def find(self, name: str) -> Row | None:
        return next((r for r in self.rows if r.name == name), None)

    def add_limit(self, times: Mapping[str, float], *, row: str | None = None) -> None:
        """Record one repetition of the limit's strategies (every strategy, every repetition);
        ``row``: of that row's own limit, where the rows of one table measure different bytes."""
        target = self.limit_times if row is None else self.row(row).limit_times
        if target and set(times) != set(target):
            raise ValueError(f"{self.key}: every repetition measures the same strategies")
        for name, seconds in times.items():
            target.setdefault(name, []).append(seconds)

    def add_ratio(self, name: str, seconds: float, limit: float | None = None) -> None:
        """A repetition of row ``name``: against ``limit`` seconds, or (None) against the strategies
        (the row's own, else the table's) of the last :meth:`add_limit`, resolved by :meth:`resolve`."""
        row = self.row(name)
        row.seconds.append(seconds)
        if limit is not None:
            row.values.append(seconds / limit)
            return
        strategies = row.limit_times or self.limit_times
        if not strategies:
            raise ValueError(f"{self.key}: add_limit() comes before add_ratio() without a limit")
        row.limit_reps.append(len(next(iter(strategies.values()))) - 1)

    def resolve(self) -> None:
        """Choose the fastest strategy (lowest median) and divide the rows measured against it.

        Idempotent; a :class:`Report` calls it. Rows given a limit in seconds are left as they are.
        """
        if self.limit_times and any(row.limit_reps for row in self.rows):  # not a report from before
            self.fastest, self.limit_seconds = _fastest(self.limit_times)
        own: list[float] = []
        for row in self.rows:
            if not row.limit_reps:
                continue
            strategies = row.limit_times or self.limit_times
            row.fastest, chosen = _fastest(strategies)
            lowest = [min(times) for times in zip(*strategies.values(), strict=True)]
            reps = list(zip(row.seconds, row.limit_reps, strict=True))
            row.values = [s / chosen[i] for s, i in reps]
            row.vs_fastest_draw = [s / lowest[i] for s, i in reps]
            if row.limit_times:
                own.extend(chosen)
        if own and not self.limit_times:
            self.limit_seconds = own

    def add_value(self, name: str, value: float, seconds: float = math.nan) -> None:
        row = self.row(name)
        row.values.append(value)
        row.seconds.append(seconds)

    def best_peer(self, group: str = "") -> Row | None:
        """The peer of ``group`` with the lowest median time in this run (None: the group has none)."""
        peers = [
            r for r in self.rows if r.kind == PEER and r.group == group and not math.isnan(r.median_seconds)
        ]
        return min(peers, key=lambda r: r.median_seconds) if peers else None

    def groups(self) -> list[str]:
        return list(dict.fromkeys(r.group for r in self.rows))

    def vs_best_peer(self, row: Row) -> float:
        """Median over repetitions of ``row``'s time / the best peer's time (of its group) in the
        same repetition."""
        best = self.best_peer(row.group)
        if best is None or row is best:
            return math.nan
        pairs = [
            a / b
            for a, b in zip(row.seconds, best.seconds, strict=False)
            if not (math.isnan(a) or math.isnan(b)) and b > 0
        ]
        return statistics.median(pairs) if pairs else math.nan

    def to_markdown(self) -> str:
        return render([self])

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Table:
        data = dict(data)
        rows = [Row(**r) for r in data.pop("rows")]
        return cls(**data, rows=rows)


def render(runs: Sequence[Table]) -> str:
    """The Markdown of one table measured in ``runs`` (the same key, one :class:`Table` per run)."""
    for t in runs:
        t.resolve()
    first, n = runs[0], len(runs)
    lines = [f"#### {first.title}", "", f"Value: {first.measure}."]
    if first.limit:
        limit_s = _median([statistics.median(t.limit_seconds) for t in runs if t.limit_seconds])
        lines[-1] += f" Limit: {first.limit}, median {_fmt_s(limit_s)}."
    strategies = _strategies(runs)
    if strategies:
        lines += [
            "",
            "The limit is the fastest of these strategies, each measured once per repetition: the one "
            "with the lowest median time in a run (chosen per run), and each row is divided by its time "
            f"in the same repetition. Median times: {strategies}.",
        ]
    lines += [
        "",
        "| variant | median | spread | median time | vs best peer | target | verdict |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name in _names(runs):
        rows = [r for t in runs if (r := t.find(name)) is not None]
        medians = [r.median for r in rows]
        spread = medians if n > 1 else rows[0].values
        target = "" if rows[0].target is None else f"<= {_fmt_v(rows[0].target, first.unit)}"
        label = name + (f" ({rows[0].note})" if rows[0].note else "")
        lines.append(
            f"| {label} | {_fmt_v(_median(medians), first.unit)} | {_fmt_range(spread, first.unit)} | "
            f"{_fmt_s(_median([r.median_seconds for r in rows]))} | {_vs_cell(runs, name)} | {target} | "
            f"{_verdict(rows)} |"
        )
    lines += ["", *(f"- {note}" for note in _caption(runs)), *(f"- {note}" for note in first.notes)]
    return "\n".join(lines) + "\n"


def beaten(runs: Sequence[Table]) -> list[str]:
    """Peers of a bound table whose median (of the runs' medians) beats the limit."""
    if not runs or not runs[0].bound:
        return []
    out = []
    for name in _names(runs):
        rows = [r for t in runs if (r := t.find(name)) is not None]
        value = _median([r.median for r in rows])
        if rows[0].kind == PEER and value < 1.0:
            out.append(f"peer {name} beats the limit ({value:.2f}x) in '{runs[0].title}'")
    return out


def _counted(names: Sequence[str]) -> str:
    """'a in 2 of 3, b in 1 of 3': how often each name came out of the runs, in first-seen order."""
    return ", ".join(f"{k} in {names.count(k)} of {len(names)}" for k in dict.fromkeys(names))


def _caption(runs: Sequence[Table]) -> list[str]:
    n = len(runs)
    reps = max((len(r.values) for t in runs for r in t.rows), default=0)
    repetitions = f"{reps} interleaved repetition" + ("" if reps == 1 else "s")
    if n > 1:
        lines = [
            f"{n} runs of {repetitions} each. median: the median of the {n} runs' medians; "
            f"spread: the lowest and highest run median; a verdict stands only when all {n} runs agree."
        ]
    else:
        lines = [f"One run of {repetitions}; spread: the lowest and highest repetition."]
    groups = runs[0].groups()
    best = {g: [b.name if (b := t.best_peer(g)) else "" for t in runs] for g in groups}
    if any(any(names) for names in best.values()):
        # A group's peers are named "<group>: <peer>"; the group is said once, before its count.
        fastest = "; ".join(
            (f"{g}: " if g else "") + _counted([n.removeprefix(f"{g}: ") for n in names if n])
            for g, names in best.items()
            if any(names)
        )
        lines.append(
            "vs best peer: the row's time / the fastest peer's time in the same repetition, median over "
            f"repetitions (fastest peer, by median time: {fastest})."
        )
    lines += [f"**{b}**: the limit is not a limit; the benchmark fails." for b in beaten(runs)]
    own = []
    for name in _names(runs):
        # A peer of a group is measured against its group's limit, which the group's own row names.
        chosen = [
            r.fastest
            for t in runs
            if (r := t.find(name)) is not None and r.limit_times and not (r.group and r.kind == PEER)
        ]
        if chosen:
            own.append(f"{name}: {_counted(chosen)}")
    if own:
        lines.append(
            "Each row has its own limit (the same strategies over its own bytes); the fastest: "
            f"{'; '.join(own)}."
        )
    draws = []
    for name in _names(runs):
        rows = [r for t in runs if (r := t.find(name)) is not None and r.vs_fastest_draw]
        if rows and rows[0].kind == OURS:
            draws.append(
                f"{name} {_fmt_v(_median([statistics.median(r.vs_fastest_draw) for r in rows]), 'x')}"
            )
    if draws:
        lines.append(
            "Against the lowest strategy time of each repetition instead (the lowest of several draws, "
            f"below what any one strategy does typically): {'; '.join(draws)}."
        )
    return lines


def _strategies(runs: Sequence[Table]) -> str:
    names = list(dict.fromkeys(k for t in runs for k in t.limit_times))
    if len(names) < 2:
        return ""
    wins = dict.fromkeys(names, 0)
    total = 0
    for t in runs:
        per_rep = list(zip(*(t.limit_times[k] for k in names if k in t.limit_times), strict=True))
        present = [k for k in names if k in t.limit_times]
        for times in per_rep:
            wins[present[min(range(len(times)), key=times.__getitem__)]] += 1
            total += 1
    parts = []
    for k in names:
        seconds = _median([statistics.median(t.limit_times[k]) for t in runs if t.limit_times.get(k)])
        chosen = sum(t.fastest == k for t in runs)
        limit = f"the limit in {chosen} of {len(runs)} run{'s' if len(runs) > 1 else ''}; " if chosen else ""
        parts.append(f"{k} {_fmt_s(seconds)} ({limit}fastest in {wins[k]} of {total} repetitions)")
    return "; ".join(parts)


def _fastest(strategies: Mapping[str, list[float]]) -> tuple[str, list[float]]:
    name = min(strategies, key=lambda k: statistics.median(strategies[k]))
    return name, list(strategies[name])


def _names(runs: Sequence[Table]) -> list[str]:
    return list(dict.fromkeys(r.name for t in runs for r in t.rows))


def _vs_cell(runs: Sequence[Table], name: str) -> str:
    ratios = []
    for t in runs:
        row = t.find(name)
        if row is not None and row.kind == OURS:
            ratio = t.vs_best_peer(row)
            if not math.isnan(ratio):
                ratios.append(ratio)
    if not ratios:
        return ""
    cell = f"{_median(ratios):.2f}x"
    return cell + (f" ({_fmt_range(ratios, 'x')})" if len(ratios) > 1 else "")


def _verdict(rows: Sequence[Row]) -> str:
    met = [r.met for r in rows if r.met is not None]
    if not met:
        return ""
    target = rows[0].target
    assert target is not None
    if all(met):
        return "met"
    if not any(met):
        return f"**missed** by {_median([r.median for r in rows]) / target - 1:.1%}"
    return f"**unstable** (met in {sum(met)} of {len(met)} runs)"


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def _fmt_range(values: Sequence[float], unit: str) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "-"
    lo, hi = min(finite), max(finite)
    return f"{_fmt_v(lo, unit)}\N{EN DASH}{_fmt_v(hi, unit)}"


def _fmt_v(value: float, unit: str) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.2f}x" if unit == "x" else f"{value:.2f} {unit}"


def _fmt_s(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


@dataclass
class Report:
    """What one run of a benchmark script produced: its tables, the command, the machine."""

    section: str
    command: str
    machine: dict[str, str]
    parameters: dict[str, Any]
    tables: list[Table]
    wall_seconds: float = 0.0

    def __post_init__(self) -> None:
        for table in self.tables:
            table.resolve()

    def to_markdown(self) -> str:
        return merged_markdown([self])

    def beaten(self) -> list[str]:
        return beaten_limits([self])

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Report:
        data = json.loads(path.read_text())
        tables = [Table.from_json(t) for t in data.pop("tables")]
        return cls(**data, tables=tables)


def _by_key(reports: Sequence[Report]) -> list[list[Table]]:
    keys = list(dict.fromkeys(t.key for r in reports for t in r.tables))
    return [[t for r in reports for t in r.tables if t.key == key] for key in keys]


def public_command(command: str) -> str:
    """``command`` without ``--json PATH`` (where ``run_all`` put a run's report is no news)."""
    words = shlex.split(command)
    out = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word == "--json":
            skip = True
        elif not word.startswith("--json="):
            out.append(word)
    return shlex.join(out)


def merged_markdown(reports: Sequence[Report]) -> str:
    """Markdown of one or more runs of the same script: one table per key, the runs together."""
    first = reports[0]
    params = ", ".join(f"{k}={v}" for k, v in first.parameters.items())
    command = public_command(first.command)
    if len(reports) == 1:
        head = f"Produced by `{command}` in {first.wall_seconds:.0f} s; parameters: {params}."
    else:
        walls = ", ".join(f"{r.wall_seconds:.0f}" for r in reports)
        head = (
            f"Produced by `{command}`, run {len(reports)} times interleaved with the other sections "
            f"({walls} s); parameters: {params}."
        )
    lines = [head, ""]
    for runs in _by_key(reports):
        lines += [render(runs), ""]
    return "\n".join(lines).rstrip() + "\n"


def beaten_limits(reports: Sequence[Report]) -> list[str]:
    """Every peer that beats a limit, over the runs of one script (empty: every limit holds)."""
    return [msg for runs in _by_key(reports) for msg in beaten(runs)]
