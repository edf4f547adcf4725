"""The pieces of a local tier on each node's disk, in one process: which ranks form a node, and how
rank 0 and the other nodes' leaders read the markers in a save's upload area."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from safeckpt._format.checksums import FileChecksum
from safeckpt._format.layout import Layout
from safeckpt._format.record import Record
from safeckpt._format.tier_fields import Part
from safeckpt._store.loc import as_root
from safeckpt._tiers import node_parts
from safeckpt._tiers.nodes import Nodes, _grouped
from safeckpt.errors import ConfigError, IncompleteCheckpointError


def test_ranks_that_see_each_others_probes_form_a_node_led_by_the_lowest() -> None:
    sees = [[True, False, True], [False, True, False], [True, False, True]]
    assert _grouped(sees, "/local") == Nodes((0, 1, 0), (0, 1))


def test_a_directory_some_ranks_of_a_node_share_and_others_do_not_is_a_config_error() -> None:
    # Rank 1 sees ranks 0 and 2; rank 0 does not see rank 2: no consistent node.
    sees = [[True, True, False], [True, True, True], [False, True, True]]
    with pytest.raises(ConfigError, match="shared by some ranks of a node and not by others"):
        _grouped(sees, "/local")


def _part(node: int, files: dict[str, int]) -> Record:
    return Record(
        step=3,
        time=1.0,
        files=files,
        checksums={n: FileChecksum.whole(b"x" * size).to_json() for n, size in files.items()},
        seq=1,
        part=Part(save="step_3.0123456789ab", node=node, nodes=2),
    )


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    return Layout(as_root(tmp_path / "root"))


def test_rank_0_commits_the_union_of_every_nodes_part_once_each_marker_is_in(layout: Layout) -> None:
    mine, theirs = _part(0, {"a": 1}), _part(1, {"b": 2})
    area = node_parts.area_of(layout, mine, "abcdef")
    assert node_parts.of_run(area.name, "abcdef") and not node_parts.of_run(area.name, "fedcba")
    area.store.make_dir(area.key)
    node_parts.put_marker(area, mine)
    node_parts.put_marker(area, theirs)
    whole = node_parts.whole_record(area, mine, should_stop=None)
    assert dict(whole.files) == {"a": 1, "b": 2} and whole.part is None
    assert set(whole.checksums or {}) == {"a", "b"}


def test_a_part_still_missing_is_tried_again_and_a_lost_one_drops_the_save(
    layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_parts, "_WAIT_PER_TRY", 0.3)
    mine = _part(0, {"a": 1})
    area = node_parts.area_of(layout, mine, "abcdef")
    area.store.make_dir(area.key)
    node_parts.put_marker(area, mine)
    with pytest.raises(node_parts.PartsNotIn, match=r"node\(s\) \[1\]"):
        node_parts.whole_record(area, mine, should_stop=None)
    node_parts.put_marker(area, _part(1, {"b": 2}), lost="its bytes fail their checksums")
    with pytest.raises(IncompleteCheckpointError, match=r"node\(s\) 1 cannot be uploaded"):
        node_parts.whole_record(area, mine, should_stop=None)


def test_another_nodes_leader_waits_for_the_commit_and_drops_a_save_whose_area_went(
    layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_parts, "_WAIT_PER_TRY", 0.3)
    theirs = _part(1, {"b": 2})
    area = node_parts.area_of(layout, theirs, "abcdef")
    area.store.make_dir(area.key)
    node_parts.put_marker(area, theirs)
    with pytest.raises(node_parts.PartsNotIn, match="not committed"):  # rank 0 has not committed yet
        node_parts.wait_committed(layout, area, theirs, should_stop=None)
    area.store.remove((area / ".part-1").key)  # rank 0 dropped the save: its area is gone
    with pytest.raises(IncompleteCheckpointError, match="another node's part of it could not be uploaded"):
        node_parts.wait_committed(layout, area, theirs, should_stop=None)


def test_rank_0_reads_each_marker_once_and_looks_less_often_while_a_part_is_missing(
    layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each look is a request per marker on object storage: one already in is not read again, and
    # the pauses between looks grow (0.2 s, 0.3 s, ... up to 2 s).
    import itertools
    import threading

    monkeypatch.setattr(node_parts, "_POLL", 0.01)
    monkeypatch.setattr(node_parts, "_POLL_MAX", 0.04)
    mine, theirs = _part(0, {"a": 1}), _part(1, {"b": 2})
    area = node_parts.area_of(layout, mine, "abcdef")
    area.store.make_dir(area.key)
    node_parts.put_marker(area, mine)
    reads: list[str] = []
    real = type(area.store).read_small

    def counted(self, name, **kwargs):  # type: ignore[no-untyped-def]
        reads.append(name.rpartition("/")[2])
        return real(self, name, **kwargs)

    monkeypatch.setattr(type(area.store), "read_small", counted)
    later = threading.Timer(0.3, node_parts.put_marker, (area, theirs))
    later.start()
    try:
        whole = node_parts.whole_record(area, mine, should_stop=None)
    finally:
        later.cancel()
    assert dict(whole.files) == {"a": 1, "b": 2}
    assert reads.count(".part-0") == 1
    assert 2 <= reads.count(".part-1") <= 14  # 0.3 s: 30 looks at 0.01 s, about 10 as they grow
    assert list(itertools.islice(node_parts._pauses(), 6)) == [0.01, 0.015, 0.0225, 0.03375, 0.04, 0.04]


def test_at_start_the_newest_held_copy_of_a_whole_save_goes_back_and_the_rest_go(layout: Layout) -> None:
    # Node 0 after a run that stopped twice mid-agreement on step 2: its step_2 is part C (not whole),
    # and it holds A and B (both whole, B the newer) aside, plus a save's own interrupted staging
    # under a held-looking name. B goes back; A, C and the leftover go to the trash.
    import threading

    from safeckpt._format.record import read_record, write_record
    from safeckpt._manager.saves import Committed, SaveView
    from safeckpt._tiers.node_commits import held_copies, settle_held

    lock = threading.RLock()
    store = layout.store

    def part(where: Any, seq: int, part_id: str) -> Record:
        record = Record(
            step=2,
            time=float(seq),
            files={},
            checksums={},
            seq=seq,
            part=Part(save=part_id, node=0, nodes=2),
        )
        store.make_dir(where.key)
        write_record(where, record, lock)  # type: ignore[arg-type]
        return record

    a, b = layout.staging_dir(2, "00000aaaaaaa"), layout.staging_dir(2, "00000bbbbbbb")
    part(a, 1, "step_2.111111000001")
    part(b, 2, "step_2.222222000002")
    leftover = layout.staging_dir(2, "00000ccccccc")
    part(leftover, 4, leftover.name)  # a save's own staging: its part is named after it
    view = SaveView()
    view.commit(Committed(layout.step_dir(2), part(layout.step_dir(2), 3, "step_2.333333000003")))
    held, other = held_copies(layout)
    assert sorted(c.path.name for c in held) == [a.name, b.name]
    assert [e.name for e in other] == [leftover.name]
    whole = frozenset({"step_2.111111000001", "step_2.222222000002"})
    back = settle_held(layout, lock, view, held, whole, other)  # type: ignore[arg-type]
    assert [c.record.seq for c in back] == [2]
    assert read_record(layout.step_dir(2)).seq == 2  # type: ignore[union-attr]
    assert view.get(2).record.seq == 2 and view.latest == 2  # type: ignore[union-attr]
    assert not layout.staging_entries()  # nothing held or left over any more
    # A part that is whole itself is never replaced: the held copies just go.
    c = layout.staging_dir(2, "00000ddddddd")
    part(c, 1, "step_2.111111000001")
    held, other = held_copies(layout)
    assert settle_held(layout, lock, view, held, whole, other) == []  # type: ignore[arg-type]
    assert read_record(layout.step_dir(2)).seq == 2 and not layout.staging_entries()  # type: ignore[union-attr]


def test_a_held_copy_is_known_by_its_record_under_any_name_and_start_up_keeps_only_it(
    layout: Layout,
) -> None:
    # A part of save A, moved aside from step_2 (any name), is held; a save's own staging (its part
    # named after it), a whole checkpoint's and an unreadable entry are not: start-up collects them.
    import threading

    from safeckpt._format.record import write_record
    from safeckpt._root.startup import take_root
    from safeckpt._tiers.node_commits import is_held

    lock = threading.RLock()
    store = layout.store

    def staged(token: str, step: int, part: Part | None) -> Any:
        where = layout.staging_dir(step, token)
        store.make_dir(where.key)
        write_record(where, Record(step=step, time=1.0, files={}, checksums={}, seq=1, part=part), lock)  # type: ignore[arg-type]
        return where

    held = staged("a1b2c3d4e5f6", 2, Part(save="step_2.111111000001", node=0, nodes=2))
    own = layout.staging_dir(3, "0123456789ab")
    staged("0123456789ab", 3, Part(save=own.name, node=0, nodes=2))
    whole = staged("fedcba987654", 4, None)
    broken = layout.staging_dir(5, "00000aaaaaaa")
    store.make_dir(broken.key)
    store.write_atomic((broken / "metadata.json").key, b"{not json")
    assert is_held(held) and not any(is_held(e) for e in (own, whole, broken))
    take_root(layout, lock, keep=lambda name: is_held(layout.staging / name))  # type: ignore[arg-type]
    assert [e.name for e in layout.staging_entries()] == [held.name]
