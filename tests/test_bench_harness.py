"""The benchmark harness: limits that move the right bytes, verdicts across runs, run_all merging."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import run_all
from bench_common import interleaved
from bench_limits import (
    CLONE,
    COPY_INTO,
    CREATED_WRITEV,
    DIRECT,
    DIRECT_READS,
    DIRECT_WRITES,
    FRESH_PER_TENSOR,
    MMAP,
    PREADV2,
    READV,
    MemcpyLimit,
    ReadLimit,
    Scratch,
    WriteLimit,
    byte_views,
    combined,
    slots,
    split_views,
    strategy_of,
    transfer,
)
from bench_tables import BEATEN, Report, Row, Table, beaten, merged_markdown, public_command, render


def tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    # odd sizes: nothing is a multiple of the O_DIRECT block
    return [torch.randn(1001), torch.randn(33, 17), torch.randint(0, 255, (4097,), dtype=torch.uint8)]


def concat(ts: list[torch.Tensor]) -> bytes:
    return b"".join(bytes(v) for v in byte_views(ts))


# --- limits ----------------------------------------------------------------------------------


def test_transfer_resumes_after_partial_transfers() -> None:
    views = byte_views(tensors())
    sink = bytearray()

    def trickle(batch: list[memoryview], done: int) -> int:
        assert done == len(sink)
        chunk = bytes(batch[0][:7])  # at most 7 bytes of the first buffer per call
        sink.extend(chunk)
        return len(chunk)

    assert transfer(views, trickle) == len(concat(tensors()))
    assert bytes(sink) == concat(tensors())


def test_split_views_cuts_the_concatenation() -> None:
    views = byte_views(tensors())
    whole = b"".join(bytes(v) for v in views)
    for at in (0, 1, 4004, 4005, len(whole) // 2, len(whole)):
        head, tail = split_views(views, at)
        assert b"".join(bytes(v) for v in head) == whole[:at]
        assert b"".join(bytes(v) for v in tail) == whole[at:]


@pytest.mark.parametrize("make", ["tensors", "large_tensors"])
def test_every_write_strategy_writes_the_bytes_to_a_new_file(tmp_path: Path, make: str) -> None:
    sources = globals()[make]()
    scratch = Scratch(tmp_path)
    taken = [tmp_path / f"write-limit.{i}" for i in range(1, 20)]
    for path in taken:
        path.write_bytes(b"an earlier file")  # a strategy must not reuse (truncate) it
    limit = WriteLimit(sources, scratch)
    result = limit.measure(0)
    assert set(result.times) >= {CREATED_WRITEV, *limit.strategies} - set(DIRECT_WRITES)
    assert result.seconds == min(result.times.values())
    assert (DIRECT in limit.strategies) != any("O_DIRECT" in n for n in limit.notes)
    assert all(path.read_bytes() == b"an earlier file" for path in taken)
    written = sorted(p for p in tmp_path.glob("write-limit.*") if p not in taken)
    assert len(written) == len(limit.strategies)
    expected = concat(sources)
    for path in written:
        data = path.read_bytes()
        assert data[: len(expected)] == expected
        assert data[len(expected) :] == bytes(len(data) - len(expected))  # O_DIRECT pads with zeros
        assert len(data) - len(expected) < 4096
    scratch.purge()
    assert sorted(tmp_path.glob("write-limit.*")) == sorted(taken)


def large_tensors() -> list[torch.Tensor]:
    # More than one 64 MiB O_DIRECT chunk, odd sizes so chunks cut tensors and the end is unaligned.
    torch.manual_seed(1)
    return [
        torch.randn(5_000_001),
        torch.randint(0, 255, (60 * 2**20 + 4097,), dtype=torch.uint8),
        torch.randn(3),
    ]


@pytest.mark.parametrize("strategy", [READV, PREADV2, MMAP, FRESH_PER_TENSOR, *DIRECT_READS])
@pytest.mark.parametrize("make", [tensors, large_tensors])
def test_read_strategies_fill_the_buffers(tmp_path: Path, strategy: str, make: Any) -> None:
    sources = make()
    buffers = [torch.zeros_like(t) for t in sources]
    limit = ReadLimit(sources, Scratch(tmp_path))  # writes the file from the sources
    if strategy not in limit.strategies:
        assert strategy in DIRECT_READS and any("O_DIRECT" in n for n in limit.notes)
        pytest.skip(limit.notes[0])
    limit.views = byte_views(buffers)  # ...and reads it into the zeroed buffers
    limit.strategies[strategy]()
    if strategy == FRESH_PER_TENSOR:  # into tensors of its own, one per buffer
        assert [bytes(v) for v in byte_views(limit.fresh)] == [bytes(v) for v in byte_views(sources)]
        assert all(torch.equal(buf, torch.zeros_like(buf)) for buf in buffers)
    else:
        for src, buf in zip(sources, buffers, strict=True):
            assert torch.equal(src, buf)
    assert set(limit.measure(1).times) == set(limit.strategies) >= {READV, PREADV2, MMAP, FRESH_PER_TENSOR}
    assert limit.time(READV) > 0 and limit.fresh == []


def test_limit_slots_name_their_strategies_and_nothing_else() -> None:
    entries = slots([READV, DIRECT])
    assert [strategy_of(e) for e in entries] == [READV, DIRECT]
    assert strategy_of("safeckpt") is None and strategy_of("torch.load") is None
    assert not set(entries) & {"safeckpt", READV, DIRECT}  # a slot never collides with a variant's name


def test_a_strategy_timed_alone_writes_a_file_of_its_own(tmp_path: Path) -> None:
    scratch = Scratch(tmp_path)
    limit = WriteLimit(tensors(), scratch)
    assert limit.time(CREATED_WRITEV) > 0
    written = list(tmp_path.glob("write-limit.*"))
    assert len(written) == 1 and written[0].read_bytes() == concat(tensors())
    scratch.purge()
    assert not list(tmp_path.glob("write-limit.*"))


def test_memcpy_limit_copies(tmp_path: Path) -> None:
    sources = tensors()
    buffers = [torch.zeros_like(t) for t in sources]
    result = MemcpyLimit(sources, buffers).measure(0)
    assert set(result.times) == {COPY_INTO, CLONE}
    assert all(torch.equal(s, b) for s, b in zip(sources, buffers, strict=True))


# --- tables across runs -------------------------------------------------------------------------


def table(ours: list[float], peer: list[float], *, bound: bool = False, seconds: float = 2.0) -> Table:
    t = Table("k", "Title", "time / limit", limit="a limit", bound=bound)
    t.row("safeckpt", target=1.1)
    for value in ours:
        t.add_ratio("safeckpt", value * seconds, seconds)
    for value in peer:
        t.add_ratio("torch.save", value * seconds, seconds)
    t.limit_seconds += [seconds] * len(ours)
    return t


@pytest.mark.parametrize(
    ("runs", "verdict"),
    [
        pytest.param([[1.0], [1.05], [0.9]], "met", id="all-met"),
        pytest.param([[1.2], [1.3], [1.25]], "**missed** by 13.6%", id="all-missed"),
        pytest.param([[1.0], [1.2], [1.0]], "**unstable** (met in 2 of 3 runs)", id="disagree"),
    ],
)
def test_a_verdict_stands_only_when_every_run_agrees(runs: list[list[float]], verdict: str) -> None:
    markdown = render([table(values, [1.5]) for values in runs])
    (line,) = [line for line in markdown.splitlines() if line.startswith("| safeckpt |")]
    assert line.rstrip(" |").endswith(verdict)


def test_median_of_medians_and_spread() -> None:
    runs = [table([1.0, 1.2, 5.0], [2.0]), table([1.1], [2.0]), table([1.4], [2.0])]
    (line,) = [line for line in render(runs).splitlines() if line.startswith("| safeckpt |")]
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[1] == "1.20x"  # medians 1.2, 1.1, 1.4
    assert cells[2] == "1.10x\N{EN DASH}1.40x"


def test_vs_best_peer_pairs_each_repetition_with_the_fastest_peer() -> None:
    t = table([1.0, 1.0], [2.0, 4.0])
    t.add_ratio("dcp.save", 8.0, 1.0)
    t.add_ratio("dcp.save", 8.0, 1.0)
    best = t.best_peer()
    assert best is not None and best.name == "torch.save"
    assert t.vs_best_peer(t.rows[0]) == pytest.approx((0.5 + 0.25) / 2)
    assert math.isnan(t.vs_best_peer(best))
    assert "| 0.38x |" in render([t])


def test_rows_of_different_states_are_compared_with_the_peers_of_their_own_state() -> None:
    t = Table("k", "T", "time")
    for name, group, seconds in [
        ("safeckpt, big", "big", 2.0),
        ("big: torch.load", "big", 4.0),
        ("safeckpt, small", "small", 1.0),
        ("small: torch.load", "small", 0.5),
    ]:
        t.row(name, role="ours" if name.startswith("safeckpt") else "peer", group=group)
        t.add_ratio(name, seconds, 1.0)
    assert t.vs_best_peer(t.find("safeckpt, big")) == pytest.approx(0.5)  # not against small's 0.5 s
    assert t.vs_best_peer(t.find("safeckpt, small")) == pytest.approx(2.0)
    assert t.best_peer() is None  # no peer outside a group
    text = render([t])
    assert "| safeckpt, big |" in text and "| 0.50x |" in text and "| 2.00x |" in text
    assert "(fastest peer, by median time: big: torch.load in 1 of 1; small: torch.load in 1 of 1)" in text


def test_a_peer_below_a_bound_limit_is_reported() -> None:
    assert beaten([table([1.0], [0.9], bound=False)]) == []
    assert beaten([table([0.5], [1.0], bound=True)]) == []  # ours below the limit is not a peer
    runs = [table([1.0], [v], bound=True) for v in (0.9, 1.1, 0.95)]
    (message,) = beaten(runs)
    assert "peer torch.save beats the limit (0.95x)" in message
    assert "the limit is not a limit" in render(runs)


def test_roles() -> None:
    assert Row("safeckpt, X").kind == "ours"
    assert Row("SafeCheckpointIO", target=1.3).kind == "ours"
    assert Row("torch.save").kind == "peer"
    assert Row("floor", role="reference").kind == "reference"


def test_report_round_trip_and_public_command(tmp_path: Path) -> None:
    t = table([1.0], [1.0])
    t.add_limit({"a": 1.0, "b": 0.5})
    report = Report("s", "py b.py --reps 2 --json /tmp/x.json", {}, {"reps": 2}, [t], 1.0)
    report.save(tmp_path / "r.json")
    again = Report.load(tmp_path / "r.json")
    assert again == report
    assert public_command(report.command) == "py b.py --reps 2"
    assert "`py b.py --reps 2`, run 2 times" in merged_markdown([report, again])
    assert "fastest in 2 of 2" in merged_markdown([report, again])


def test_the_limit_is_the_strategy_fastest_by_median_not_the_lowest_draw_of_each_repetition() -> None:
    t = Table("k", "Title", "time / limit", limit="a limit", bound=True)
    t.row("safeckpt", target=1.2)
    # b is faster once, by luck; a is faster typically.
    for a, b, ours, peer in [(1.0, 0.5, 1.1, 1.5), (1.0, 2.0, 1.1, 1.5), (1.0, 2.0, 1.1, 1.5)]:
        t.add_limit({"a": a, "b": b})
        t.add_ratio("safeckpt", ours)
        t.add_ratio("torch.save", peer)
    t.resolve()
    assert t.fastest == "a" and t.limit_seconds == [1.0, 1.0, 1.0]
    ours = t.find("safeckpt")
    assert ours is not None and ours.values == pytest.approx([1.1, 1.1, 1.1])
    assert ours.vs_fastest_draw == pytest.approx([2.2, 1.1, 1.1])
    markdown = render([t])
    assert "a 1.00 s (the limit in 1 of 1 run; fastest in 2 of 3 repetitions)" in markdown
    assert "b 2.00 s (fastest in 1 of 3 repetitions)" in markdown
    assert "Against the lowest strategy time of each repetition instead" in markdown
    assert "safeckpt 1.10x" in markdown  # the median of 2.2, 1.1, 1.1
    t.resolve()  # idempotent
    assert ours.values == pytest.approx([1.1, 1.1, 1.1])


@pytest.mark.parametrize("n", [3, 4, 7, 12])
def test_interleaved_balances_positions_and_neighbours(n: int) -> None:
    items = [f"v{i}" for i in range(n)]
    rows = [interleaved(items, rep) for rep in range(2 * n if n % 2 else n)]
    assert all(sorted(row) == sorted(items) for row in rows)
    per_position = {(row.index(item), item) for row in rows for item in items}
    assert len(per_position) == n * n  # every item in every position
    pairs = [(row[j], row[j + 1]) for row in rows for j in range(n - 1)]
    assert len(set(pairs)) == n * (n - 1) == len(pairs) / (2 if n % 2 else 1)  # every neighbour, as often
    assert interleaved(["a", "b"], 0) == ["a", "b"] and interleaved(["a", "b"], 1) == ["b", "a"]


def test_rows_with_their_own_limits_and_misuse() -> None:
    t = Table("k", "Title", "time / limit")
    for rep in range(3):
        t.add_limit({"copy": 1.0 + rep / 2, "clone": 2.0}, row="small")
        t.add_ratio("small", 3.0)
        t.add_limit({"copy": 10.0, "clone": 5.0}, row="large")
        t.add_ratio("large", 10.0)
    report = Report("s", "cmd", {}, {}, [t])  # resolves
    small, large = t.find("small"), t.find("large")
    assert small is not None and large is not None
    assert (small.fastest, large.fastest) == ("copy", "clone")  # by median: 1.5 < 2.0, 5.0 < 10.0
    assert small.values == pytest.approx([3.0, 2.0, 1.5])
    assert large.values == pytest.approx([2.0, 2.0, 2.0])
    assert "Each row has its own limit" in report.to_markdown()
    with pytest.raises(ValueError, match="same strategies"):
        t.add_limit({"copy": 1.0}, row="small")
    with pytest.raises(ValueError, match="add_limit"):
        Table("x", "X", "m").add_ratio("row", 1.0)
    assert combined({"c": 1.0}, {"w1": 2.0, "w2": 3.0}) == {"c + w1": 3.0, "c + w2": 4.0}


# --- run_all --------------------------------------------------------------------------------------

SCRIPT = """
import sys
sys.path.insert(0, {benchmarks!r})
from bench_tables import BEATEN, Report, Table
args = sys.argv[1:]
value = float(args[0])
t = Table("k", "A table", "time / limit", limit="a limit", bound=True)
t.row("safeckpt", target=1.1)
t.add_ratio("safeckpt", 1.0, 1.0)
t.add_ratio("peer", value, 1.0)
report = Report("fake", "fake " + " ".join(args), {{}}, {{}}, [t], 0.1)
report.save(__import__("pathlib").Path(args[args.index("--json") + 1]))
print(report.to_markdown())
sys.exit(BEATEN if report.beaten() else 0)
"""


@pytest.mark.parametrize(("values", "fails"), [((0.9, 1.2, 1.3), False), ((0.9, 0.8, 1.3), True)])
def test_run_all_merges_real_runs(tmp_path: Path, values: tuple[float, ...], fails: bool) -> None:
    script = tmp_path / "fake_bench.py"
    script.write_text(SCRIPT.format(benchmarks=str(Path(run_all.__file__).parent)))
    outcomes = []
    for i, value in enumerate(values):
        section = run_all.Section("fake", "Fake", (sys.executable, str(script), str(value)))
        outcome = run_all.run_section(section, False, tmp_path / f"run{i}.json")
        assert outcome.report is not None and not outcome.failed  # a beaten run still counts
        outcomes.append(outcome)
    result = run_all.merged(section, outcomes)
    assert result.failed == fails
    assert result.markdown is not None and "3 runs of 1 interleaved repetition each" in result.markdown
    assert ("beats the limit" in result.markdown) == fails


def test_run_all_fails_a_run_that_crashes(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text("raise SystemExit(2)\n")
    outcome = run_all.run_section(run_all.Section("c", "C", (sys.executable, str(script))), False, None)
    assert outcome.failed and outcome.markdown is None


def test_interleaved_order() -> None:
    a = run_all.Section("a", "A", ("x",))
    b = run_all.Section("b", "B", ("y",), runs=1)
    order = [(r, s.key) for r, s in run_all.interleaved([a, b], {"a": 3, "b": 1})]
    assert order == [(0, "a"), (0, "b"), (1, "a"), (2, "a")]


def test_make_bench_sections_take_json() -> None:
    # Every merged section's script must accept --json (else its 3 runs cannot be merged).
    for section in run_all.SECTIONS:
        if section.runs > 1 and section.command[0] == run_all.PYTHON:
            source = (run_all.REPO / section.command[1]).read_text()
            assert '"--json"' in source, section.key


def test_o_direct_probe_is_honest(tmp_path: Path) -> None:
    limit = WriteLimit(tensors(), Scratch(tmp_path))
    if DIRECT not in limit.strategies:
        assert not hasattr(os, "O_DIRECT") or limit.notes
    assert not list(tmp_path.glob("o-direct-probe.*"))
    assert BEATEN == 3


def test_held_keeps_the_previous_checkpoint_until_the_timing_ends(tmp_path: Path) -> None:
    from bench_common import held
    from safeckpt import CheckpointManager, Retention

    with CheckpointManager(tmp_path / "root", async_save=False, retention=Retention(keep_last=1)) as mgr:
        mgr.save(1, {"w": torch.zeros(4)})
        with held(mgr):
            mgr.save(2, {"w": torch.ones(4)})
            assert (tmp_path / "root" / "step_1").is_dir()  # the timed save pruned nothing
        assert not (tmp_path / "root" / "step_1").exists()  # pruned and deleted after it
        assert not any((tmp_path / "root" / ".trash").glob("*"))
        assert mgr.latest_step == 2
