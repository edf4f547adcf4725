"""Retention is pure policy: tables of histories in, survivors out, and properties over random histories."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from safeckpt._policy.retention import (
    CheckpointInfo,
    KeepAll,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPinned,
    Retention,
    explain,
    plan_removals,
)
from safeckpt.errors import CheckpointError, ConfigError

NAN = float("nan")


def history(
    steps: Iterable[int],
    metric: Mapping[int, float | None] | None = None,
    pinned: Iterable[int] = (),
    name: str = "loss",
) -> list[CheckpointInfo]:
    """Infos for ``steps``; a step absent from ``metric`` has no such metric in its record."""
    metric = metric or {}
    pins = set(pinned)
    return [
        CheckpointInfo(
            step=s,
            metrics={name: metric[s]} if s in metric else {"other": 1.0},
            time=float(s),
            pinned=s in pins,
        )
        for s in steps
    ]


def survivors(
    retention: Retention, infos: Sequence[CheckpointInfo], protected: Iterable[int] = ()
) -> list[int]:
    removed = plan_removals(infos, retention.policy(), protected)
    return sorted({i.step for i in infos} - removed)


def case(id: str, **fields: Any) -> Any:
    return pytest.param(fields, id=id)


# --- tables -------------------------------------------------------------------------------

KEEP_LAST = [
    case("3_of_5", keep_last=3, steps=[1, 2, 3, 4, 5], expected=[3, 4, 5]),
    case("1_of_3", keep_last=1, steps=[10, 20, 30], expected=[30]),
    case("more_than_there_are", keep_last=10, steps=[1, 2], expected=[1, 2]),
    case("exactly_as_many", keep_last=2, steps=[7, 8], expected=[7, 8]),
    case("unsorted_input", keep_last=2, steps=[5, 1, 30, 3], expected=[5, 30]),
    case("numeric_not_lexicographic", keep_last=2, steps=[9, 10, 100, 11], expected=[11, 100]),
    case("step_zero", keep_last=1, steps=[0], expected=[0]),
    case("empty", keep_last=3, steps=[], expected=[]),
]


@pytest.mark.parametrize("c", KEEP_LAST)
def test_keep_last(c: dict[str, Any]) -> None:
    assert survivors(Retention(keep_last=c["keep_last"]), history(c["steps"])) == c["expected"]


METRICS = {1: 0.5, 2: 0.3, 3: 0.9, 4: 0.1, 5: 0.7}

KEEP_BEST = [
    case("min_2", k=2, mode="min", metric=METRICS, expected=[2, 4]),
    case("max_2", k=2, mode="max", metric=METRICS, expected=[3, 5]),
    case("min_1", k=1, mode="min", metric=METRICS, expected=[4]),
    case("max_1", k=1, mode="max", metric=METRICS, expected=[3]),
    case("k_beyond_history", k=9, mode="min", metric=METRICS, expected=[1, 2, 3, 4, 5]),
    case(
        "min_tie_goes_to_newer",
        k=1,
        mode="min",
        steps=[1, 2, 3],
        metric={1: 0.5, 2: 0.5, 3: 0.5},
        expected=[3],
    ),
    case(
        "max_tie_goes_to_newer",
        k=1,
        mode="max",
        steps=[1, 2, 3],
        metric={1: 0.5, 2: 0.5, 3: 0.5},
        expected=[3],
    ),
    case(
        "min_tie_2_of_3", k=2, mode="min", steps=[1, 2, 3], metric={1: 0.2, 2: 0.2, 3: 0.2}, expected=[2, 3]
    ),
    case(
        "tie_at_the_cut",
        k=2,
        mode="min",
        steps=[1, 2, 3, 4],
        metric={1: 0.1, 2: 0.4, 3: 0.4, 4: 0.9},
        expected=[1, 3],
    ),
    case(
        "max_tie_at_the_cut",
        k=2,
        mode="max",
        steps=[1, 2, 3, 4],
        metric={1: 0.9, 2: 0.4, 3: 0.4, 4: 0.1},
        expected=[1, 3],
    ),
    case("signed_zero_ties", k=1, mode="min", steps=[1, 2], metric={1: -0.0, 2: 0.0}, expected=[2]),
    case(
        "infinities",
        k=1,
        mode="max",
        steps=[1, 2, 3],
        metric={1: math.inf, 2: 1e308, 3: -math.inf},
        expected=[1],
    ),
    case(
        "neg_inf_is_best_min", k=1, mode="min", steps=[1, 2], metric={1: -math.inf, 2: -1e308}, expected=[1]
    ),
    # A record without the metric (key absent), with None (a cleaned NaN) or with NaN: missing.
    case("missing_ranks_last", k=2, mode="min", metric={2: 0.9, 4: 0.8}, expected=[2, 4]),
    case("missing_fills_in_newest_first", k=3, mode="min", metric={2: 0.9, 4: 0.8}, expected=[2, 4, 5]),
    case("missing_ranks_last_max", k=1, mode="max", metric={1: -5.0}, expected=[1]),
    case("all_missing_newest_first", k=2, mode="min", metric={}, expected=[4, 5]),
    case("none_is_missing", k=1, mode="min", metric={1: 0.5, 5: None}, expected=[1]),
    case("nan_is_missing", k=1, mode="min", metric={1: 0.5, 5: NAN}, expected=[1]),
    case("nan_is_missing_max", k=1, mode="max", metric={1: -1e9, 5: NAN}, expected=[1]),
    case(
        "nan_not_best_min",
        k=2,
        mode="min",
        steps=[1, 2, 3, 4],
        metric={1: 3.0, 2: NAN, 3: 2.0, 4: 1.0},
        expected=[3, 4],
    ),
    case("missing_keep_1", k=1, mode="min", missing="keep", metric={2: 0.9, 4: 0.8}, expected=[1, 3, 4, 5]),
    case(
        "missing_keep_nan",
        k=1,
        mode="max",
        missing="keep",
        metric={1: 1.0, 2: NAN, 3: 2.0},
        expected=[2, 3, 4, 5],
    ),
    case(
        "missing_keep_none",
        k=1,
        mode="min",
        missing="keep",
        metric={1: 1.0, 2: None, 3: 2.0, 4: 3.0, 5: 4.0},
        expected=[1, 2],
    ),
]


@pytest.mark.parametrize("c", KEEP_BEST)
def test_keep_best(c: dict[str, Any]) -> None:
    retention = Retention(
        keep_best=c["k"], metric="loss", mode=c["mode"], missing_metric=c.get("missing", "rank_last")
    )
    infos = history(c.get("steps", [1, 2, 3, 4, 5]), c["metric"])
    assert survivors(retention, infos) == c["expected"]


def test_keep_best_reads_only_its_metric() -> None:
    infos = [
        CheckpointInfo(1, {"loss": 0.1, "acc": 0.1}),
        CheckpointInfo(2, {"loss": 0.9, "acc": 0.9}),
        CheckpointInfo(3, {"acc": 0.99}),
    ]
    assert KeepBest(1, "loss").keep(infos) == {1}
    assert KeepBest(1, "acc", mode="max").keep(infos) == {3}
    assert KeepBest(2, "loss", missing="keep").keep(infos) == {1, 2, 3}


KEEP_EVERY = [
    case("every_10", every=10, steps=[5, 10, 15, 20, 25], expected=[10, 20]),
    case("step_zero_is_a_multiple", every=7, steps=[0, 3, 7, 13, 14], expected=[0, 7, 14]),
    case("every_1_keeps_all", every=1, steps=[1, 2, 3], expected=[1, 2, 3]),
    case("none_match", every=100, steps=[1, 2, 3], expected=[]),
]


@pytest.mark.parametrize("c", KEEP_EVERY)
def test_keep_every(c: dict[str, Any]) -> None:
    assert survivors(Retention(keep_every=c["every"]), history(c["steps"])) == c["expected"]


PINNED_AND_COMBINED = [
    case(
        "pinned_beats_keep_last", retention=dict(keep_last=1), steps=[1, 2, 3, 4], pinned=[1], expected=[1, 4]
    ),
    case(
        "pinned_beats_keep_best",
        retention=dict(keep_best=1, metric="loss"),
        steps=[1, 2, 3],
        metric={1: 0.1, 2: 0.2, 3: 0.3},
        pinned=[3],
        expected=[1, 3],
    ),
    case(
        "pinned_beats_keep_every",
        retention=dict(keep_every=10),
        steps=[5, 10, 15],
        pinned=[15],
        expected=[10, 15],
    ),
    case("pinned_is_kept_with_no_rules", retention={}, steps=[1, 2], pinned=[1], expected=[1, 2]),
    case("no_rules_keeps_all", retention={}, steps=[1, 2, 3], expected=[1, 2, 3]),
    case(
        "last_or_every",
        retention=dict(keep_last=2, keep_every=10),
        steps=[5, 10, 15, 20, 25, 30, 35],
        expected=[10, 20, 30, 35],
    ),
    case(
        "last_or_best",
        retention=dict(keep_last=1, keep_best=1, metric="loss"),
        steps=[1, 2, 3, 4],
        metric={1: 0.9, 2: 0.1, 3: 0.5, 4: 0.8},
        expected=[2, 4],
    ),
    case(
        "last_or_best_same_step",
        retention=dict(keep_last=1, keep_best=1, metric="loss"),
        steps=[1, 2, 3],
        metric={1: 0.9, 2: 0.5, 3: 0.1},
        expected=[3],
    ),
    case(
        "all_rules",
        retention=dict(keep_last=1, keep_best=2, metric="acc", mode="max", keep_every=4),
        steps=[1, 2, 3, 4, 5, 6, 7, 8, 9],
        metric={1: 0.9, 2: 0.95, 3: 0.1, 6: 0.5},
        pinned=[5],
        expected=[1, 2, 4, 5, 8, 9],
        name="acc",
    ),
]


@pytest.mark.parametrize("c", PINNED_AND_COMBINED)
def test_pinned_and_combinations(c: dict[str, Any]) -> None:
    infos = history(c["steps"], c.get("metric"), c.get("pinned", ()), name=c.get("name", "loss"))
    assert survivors(Retention(**c["retention"]), infos) == c["expected"]


PROTECTED = [
    case(
        "latest_outside_keep_last",
        retention=dict(keep_last=1),
        steps=[1, 2, 3],
        protected=[1],
        expected=[1, 3],
    ),
    case(
        "protected_not_in_history_ignored",
        retention=dict(keep_last=1),
        steps=[1, 2],
        protected=[9],
        expected=[2],
    ),
    case(
        "protected_worst_metric",
        retention=dict(keep_best=1, metric="loss"),
        steps=[1, 2],
        metric={1: 0.1, 2: 9.0},
        protected=[2],
        expected=[1, 2],
    ),
]


@pytest.mark.parametrize("c", PROTECTED)
def test_protected_steps_are_never_removed(c: dict[str, Any]) -> None:
    infos = history(c["steps"], c.get("metric"))
    assert survivors(Retention(**c["retention"]), infos, c["protected"]) == c["expected"]


# --- validation ---------------------------------------------------------------------------------

INVALID = [
    case("keep_last_zero", kwargs=dict(keep_last=0), names=["keep_last"]),
    case("keep_last_negative", kwargs=dict(keep_last=-1), names=["keep_last"]),
    case("keep_last_float", kwargs=dict(keep_last=2.0), names=["keep_last"]),
    case("keep_last_bool", kwargs=dict(keep_last=True), names=["keep_last"]),
    case("keep_last_str", kwargs=dict(keep_last="3"), names=["keep_last"]),
    case("keep_best_zero", kwargs=dict(keep_best=0, metric="loss"), names=["keep_best"]),
    case("keep_every_zero", kwargs=dict(keep_every=0), names=["keep_every"]),
    case("keep_every_negative", kwargs=dict(keep_every=-10), names=["keep_every"]),
    case("keep_best_without_metric", kwargs=dict(keep_best=2), names=["keep_best", "metric"]),
    case("keep_best_with_empty_metric", kwargs=dict(keep_best=2, metric=""), names=["keep_best", "metric"]),
    case("metric_without_keep_best", kwargs=dict(metric="loss"), names=["metric", "keep_best"]),
    case("bad_mode", kwargs=dict(keep_best=1, metric="loss", mode="avg"), names=["mode", "'min'", "'max'"]),
    case(
        "bad_missing_metric",
        kwargs=dict(keep_best=1, metric="loss", missing_metric="drop"),
        names=["missing_metric", "rank_last", "keep"],
    ),
]


@pytest.mark.parametrize("c", INVALID)
def test_invalid_retention_names_the_fields(c: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        Retention(**c["kwargs"])
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, ValueError)
    for name in c["names"]:
        assert name in str(info.value)
    assert str(info.value).startswith("Retention(")


def test_retention_is_frozen_and_keyword_only() -> None:
    retention = Retention(keep_last=2)
    with pytest.raises(AttributeError):
        retention.keep_last = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        Retention(2)  # type: ignore[misc]


# --- the policies a configuration stands for, and explain() --------------------------------------


def test_policies_of_a_configuration() -> None:
    assert Retention().policies() == (KeepAll(), KeepPinned())
    retention = Retention(
        keep_last=3, keep_best=2, metric="acc", mode="max", keep_every=100, missing_metric="keep"
    )
    assert retention.policies() == (
        KeepLast(3),
        KeepBest(2, "acc", "max", "keep"),
        KeepEvery(100),
        KeepPinned(),
    )
    assert retention.policy() == KeepAny(retention.policies())
    assert retention.policy().reason() == "last 3 or best 2 by acc (max) or every 100 or pinned"


def test_explain_says_why_each_step_is_kept() -> None:
    infos = history([5, 10, 15, 20, 25], pinned=[15])
    reasons = explain(infos, Retention(keep_last=2, keep_every=10), {25: "latest", 99: "writing"})
    assert reasons == {
        5: [],
        10: ["every 10"],
        15: ["pinned"],
        20: ["last 2", "every 10"],
        25: ["latest", "last 2"],
    }


def test_explain_for_keep_best_and_no_rules() -> None:
    infos = history([1, 2, 3], {1: 0.3, 2: 0.1, 3: 0.2})
    assert explain(infos, Retention(keep_best=1, metric="loss")) == {
        1: [],
        2: ["best 1 by loss (min)"],
        3: [],
    }
    assert explain(infos, Retention()) == {s: ["no retention limit"] for s in (1, 2, 3)}
    assert explain([], Retention(keep_last=1), {1: "latest"}) == {}


# --- properties over random histories ----------------------------------------------------------

metric_values = st.one_of(
    st.none(),
    st.just(NAN),
    st.sampled_from([0.0, 1.0, 2.0, -1.0]),  # ties
    st.floats(allow_nan=False),  # includes +-inf and huge values
)


@st.composite
def histories(draw: st.DrawFn, *, pins: bool = True) -> tuple[list[CheckpointInfo], frozenset[int]]:
    steps = draw(st.lists(st.integers(0, 500), unique=True, max_size=25))
    infos = []
    for step in steps:
        metrics = {}
        if draw(st.booleans()):  # else: the record lacks the metric
            metrics["loss"] = draw(metric_values)
        infos.append(CheckpointInfo(step, metrics, float(step), pinned=pins and draw(st.booleans())))
    protected = frozenset(draw(st.sets(st.sampled_from(steps)))) if steps else frozenset()
    return infos, protected


retentions = st.builds(
    lambda last, best, every, mode, missing: Retention(
        keep_last=last,
        keep_best=best,
        metric="loss" if best else None,
        mode=mode,
        keep_every=every,
        missing_metric=missing,
    ),
    st.none() | st.integers(1, 6),
    st.none() | st.integers(1, 6),
    st.none() | st.integers(1, 50),
    st.sampled_from(["min", "max"]),
    st.sampled_from(["rank_last", "keep"]),
)

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None)


@PROPERTY_SETTINGS
@given(histories(), retentions)
def test_protected_never_removed_and_removals_are_not_kept(
    drawn: tuple[list[CheckpointInfo], frozenset[int]], retention: Retention
) -> None:
    infos, protected = drawn
    policy = retention.policy()
    removed = plan_removals(infos, policy, protected)
    kept = policy.keep(infos) | protected
    assert not removed & protected
    assert not removed & kept
    assert removed <= {i.step for i in infos}
    assert removed | kept >= {i.step for i in infos}
    assert not removed & {i.step for i in infos if i.pinned}
    # explain() agrees with plan_removals(): a step with no reason is exactly a removed one.
    reasons = explain(infos, retention, {s: "latest" for s in protected})
    assert {s for s, why in reasons.items() if not why} == removed


@PROPERTY_SETTINGS
@given(histories(pins=False), st.integers(1, 8), st.data())
def test_keep_last_alone_keeps_exactly_the_newest(
    drawn: tuple[list[CheckpointInfo], frozenset[int]], n: int, data: st.DataObject
) -> None:
    infos, _ = drawn
    newest = sorted((i.step for i in infos), reverse=True)[:n]
    protected = data.draw(st.sets(st.sampled_from(newest))) if newest else set()
    kept = survivors(Retention(keep_last=n), infos, protected)
    assert len(kept) == min(n, len(infos))
    assert kept == sorted(newest)


def _value(info: CheckpointInfo) -> float | None:
    v = info.metrics.get("loss")
    return None if v is None or math.isnan(v) else v


def _better(a: CheckpointInfo, b: CheckpointInfo, mode: str) -> bool:
    """Whether ``a`` ranks before ``b`` for keep_best (an oracle written pairwise)."""

    va, vb = _value(a), _value(b)
    if (va is None) != (vb is None):
        return vb is None
    if va is None or va == vb:
        return a.step > b.step
    assert vb is not None
    return va < vb if mode == "min" else va > vb


@PROPERTY_SETTINGS
@given(histories(pins=False), st.integers(1, 8), st.sampled_from(["min", "max"]), st.booleans())
def test_keep_best_alone_keeps_exactly_the_k_best(
    drawn: tuple[list[CheckpointInfo], frozenset[int]], k: int, mode: str, keep_missing: bool
) -> None:
    infos, protected = drawn
    retention = Retention(
        keep_best=k, metric="loss", mode=mode, missing_metric="keep" if keep_missing else "rank_last"
    )
    if keep_missing:  # every checkpoint without the metric is kept; the K best of the others
        unscored = {i.step for i in infos if _value(i) is None}
        ranked = [i for i in infos if _value(i) is not None]
    else:
        unscored, ranked = set(), infos
    best = {a.step for a in ranked if sum(_better(b, a, mode) for b in ranked) < k}
    assert len(best) == min(k, len(ranked))
    assert survivors(retention, infos, protected) == sorted(best | unscored | protected)


@PROPERTY_SETTINGS
@given(histories(), retentions, st.randoms(use_true_random=False))
def test_policies_are_pure(
    drawn: tuple[list[CheckpointInfo], frozenset[int]], retention: Retention, rnd: random.Random
) -> None:
    infos, protected = drawn
    snapshot = [(i.step, dict(i.metrics), i.pinned) for i in infos]
    first = plan_removals(infos, retention.policy(), protected)
    assert plan_removals(infos, retention.policy(), protected) == first
    shuffled = list(infos)
    rnd.shuffle(shuffled)
    assert plan_removals(shuffled, retention.policy(), set(protected)) == first
    assert [(i.step, dict(i.metrics), i.pinned) for i in infos] == snapshot
