"""Which durable root a local commit belongs to, and whether that root moved on past it
(safeckpt._format.lineage): plain records in, a decision out, by sequences and never by clocks."""

from __future__ import annotations

from typing import Any

import pytest

from safeckpt._format import lineage
from safeckpt._format.record import Record
from safeckpt._format.tier_fields import Lineage, Upload

ROOT, ID, MINE, THEIRS = "s3://b/run", "r00t", "tier-mine", "tier-theirs"


def local(seq: int, after: int | None, *, time: float = 0.0, step: int | None = None) -> Record:
    return Record(
        step=seq if step is None else step,
        time=time,
        files={},
        seq=seq,
        checksums={"f": f"local-{seq}"},
        local=lineage.stamp(ROOT, ID, MINE, after),
    )


def durable(seq: int, *, tier: str | None, local_seq: int | None = None, time: float = 0.0) -> Record:
    uploaded = None if tier is None else Upload(source="x", tier=tier, seq=local_seq)
    return Record(
        step=seq, time=time, files={}, seq=seq, checksums={"f": f"durable-{seq}"}, uploaded=uploaded
    )


@pytest.mark.parametrize(
    ("record", "root", "behind"),
    [
        pytest.param(
            local(3, after=2),
            [durable(1, tier=MINE, local_seq=1), durable(2, tier=MINE, local_seq=2)],
            None,
            id="root-as-it-followed",
        ),
        pytest.param(
            local(4, after=2),
            [durable(2, tier=MINE, local_seq=2), durable(3, tier=MINE, local_seq=3)],
            None,
            id="since-only-its-own-earlier-uploads",
        ),
        pytest.param(
            local(3, after=2),
            [durable(2, tier=MINE, local_seq=2), durable(3, tier=THEIRS, local_seq=1)],
            3,
            id="another-node-went-on",
        ),
        pytest.param(
            local(3, after=2),
            [durable(2, tier=MINE, local_seq=2), durable(3, tier=None)],
            3,
            id="a-save-made-in-the-root",
        ),
        pytest.param(
            local(3, after=2),
            [durable(2, tier=MINE, local_seq=2), durable(3, tier=MINE, local_seq=5)],
            3,
            id="its-own-later-commit-went-up",
        ),
        pytest.param(
            local(3, after=0, time=1e12),
            [durable(1, tier=THEIRS, local_seq=1, time=0.0)],
            1,
            id="a-clock-ahead-changes-nothing",
        ),
        pytest.param(local(1, after=None), [], None, id="an-empty-root"),
    ],
)
def test_moved_on_by_sequences(record: Record, root: list[Record], behind: int | None) -> None:
    found = lineage.moved_on(record, root)
    assert (None if found is None else found.seq) == behind


def test_a_root_holding_the_same_checkpoint_never_moved_on_past_it() -> None:
    record = local(3, after=0)
    same = Record(step=3, time=0.0, files={}, seq=9, checksums=record.checksums, uploaded=Upload(tier=THEIRS))
    assert lineage.moved_on(record, [durable(8, tier=None), same]) is None


@pytest.mark.parametrize(
    ("stamp", "uploaded", "root", "root_id", "belongs"),
    [
        (Lineage(root=ROOT, root_id=ID), None, ROOT, ID, True),
        (Lineage(root=ROOT, root_id=ID), None, "s3://b/other", "other", False),
        (Lineage(root=ROOT, root_id=ID), None, ROOT, "made-again", False),
        (Lineage(root="/mnt/a/run", root_id=ID), None, "/shared/a/run", ID, True),  # the id decides
        (Lineage(root=ROOT, root_id=None), None, ROOT, ID, True),  # no id then: the location decides
        (None, Upload(to=ROOT + "/step_3"), ROOT, ID, True),  # before local commits named their root
        (None, Upload(to="s3://b/other/step_3"), ROOT, ID, False),
        (None, None, ROOT, ID, True),
    ],
)
def test_belongs(stamp: Any, uploaded: Any, root: str, root_id: str, belongs: bool) -> None:
    record = Record(step=3, time=0.0, files={}, local=stamp, uploaded=uploaded)
    assert lineage.belongs(record, root, root_id) is belongs
