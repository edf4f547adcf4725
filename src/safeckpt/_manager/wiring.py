"""Building a manager's collaborators, and opening its root (collective over the control group).

Each collaborator is built from what it needs (no back references to the
manager), in the order their dependencies ask for: the view; rank 0's session on
the root, opened, and its registration thread; agreement on the opening; then
the committer, the writer thread, triggers, the resumer, pins and the saver.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from .._dcp.options import IOOptions
from .._dcp.plans import SavePlans
from .._dist.participants import Participants
from .._format.layout import Layout
from .._format.lineage import ensure_root_id, read_root_id
from .._policy.retention import Policy, Retention
from .._policy.schedule import SaveSchedule
from .._registration.registrar import Registrar
from .._registration.worker import RegistrationWorker
from .._state.walk import StateCache
from .._store.base import Store
from .._store.loc import Loc
from .background import BackgroundWriter, StagingPool
from .committer import Committer
from .damaged import DamagedCommits
from .durable import DurableTier
from .leader_wait import Heartbeat, on_leader
from .node_commits import held_copies, is_held, settle_held
from .nodes import Nodes
from .outcomes import Outcomes
from .pins import Pins
from .preemption import PreemptionHandlers
from .resumer import Resumer
from .room import LocalRoom
from .saver import Saver
from .saves import Committed, SaveView
from .session import RootSession
from .triggers import Triggers
from .uploads import Uploader

logger = logging.getLogger("safeckpt.manager")


@dataclass(frozen=True)
class Wiring:
    """A manager's collaborators."""

    view: SaveView
    session: RootSession
    outcomes: Outcomes
    committer: Committer
    resumer: Resumer
    triggers: Triggers
    pins: Pins
    saver: Saver
    pool: StagingPool | None
    writer: BackgroundWriter | None
    plans: SavePlans
    state_cache: StateCache
    uploader: Uploader | None


def wire(
    store: Store,
    parts: Participants,
    *,
    retention: Retention | Policy,
    schedule: SaveSchedule | None,
    signals: PreemptionHandlers,
    async_save: bool,
    queue_depth: int,
    save_rng: bool,
    read_only: bool,
    lock_timeout: float,
    retry_interval: float,
    registrar: Registrar | None,
    registration_timeout: float,
    io: IOOptions,
    durable: DurableTier | None = None,
    overlap: bool = False,
    nodes: Nodes | None = None,
) -> Wiring:
    """Build the collaborators and open ``root`` (rank 0); every rank raises the same error if that fails.

    With ``durable`` (two tiers), ``store`` is the local tier: saves commit there, and each commit
    is uploaded to ``durable``, which rank 0 opens too; commits of an earlier run that were not
    uploaded are uploaded before this returns (or queued, if the durable tier cannot be reached).
    ``nodes``: with a ``local_dir`` on each node's disk, each node's leader opens its own and
    uploads its node's part of each save (:mod:`.node_parts`).
    """
    nodes = nodes if nodes is not None else Nodes.one(parts.world_size)
    leads_root = parts.is_leader or nodes.leads(parts.rank)  # holds this rank's local root
    layout = Layout(Loc(store))
    root = layout.root.where
    view = SaveView()
    plans = SavePlans()  # DCP's plans of this manager's saves, reused while they stay the same
    state_cache = StateCache()  # the state's structure, reused while it stays the same
    damaged = DamagedCommits(layout, view)
    session = RootSession(
        layout,
        view,
        damaged,
        read_only=read_only,
        lock_timeout=lock_timeout,
        retry_interval=retry_interval,
    )
    outcomes = Outcomes(parts, view, own_view=leads_root and not parts.is_leader)
    error: BaseException | None = None
    registration: RegistrationWorker | None = None
    uploader: Uploader | None = None
    several = durable is not None and nodes.count > 1
    if several:  # copies an earlier run held aside: kept until the nodes agree (see .node_commits)
        session.keep_staging = is_held
    held: list[Committed] = []
    other_held: list[Loc] = []
    tier: str | None = None  # the local root's identity, which its commits record
    if leads_root:
        try:
            session.open()
            if several:
                held, other_held = held_copies(layout)
            if durable is not None:
                try:
                    if parts.is_leader:  # the other nodes' leaders only put their parts there
                        durable.open()
                    else:
                        durable.read_identity()
                    tier = _local_identity(layout, session, read_only)
                    durable.refuse_others(layout.root, [c.record for c in [*view.committed(), *held]])
                except BaseException:
                    session.release()  # the local root's lock and owner record go with the error
                    if parts.is_leader:
                        durable.release()
                    raise
                assert session.lock is not None
                uploader = Uploader(durable, view, session.lock, retry_interval=retry_interval)
                if parts.is_leader and not several and _owns(session, read_only):
                    uploader.set_aside_behind(view.committed(), layout)  # before the view is shared
            if registrar is not None and not read_only and parts.is_leader:
                assert session.lock is not None
                registration = RegistrationWorker(
                    registrar, session.lock, layout.root, timeout=registration_timeout
                )
        except BaseException as e:
            error = e
    parts.agree(error, parts.control, what=f"opening {root}")
    outcomes.share_view(parts.control, what=f"the checkpoints in {root}")
    token = parts.broadcast(uuid.uuid4().hex[:6], parts.control, what="the save session id")
    if durable is not None:
        durable.run = token
    pool = StagingPool(queue_depth) if async_save else None
    committer = Committer(
        root,
        retention,
        parts=parts,
        plans=plans,
        layout=layout,
        view=view,
        pool=pool,
        session=session,
        outcomes=outcomes,
        registration=registration,
        registration_timeout=registration_timeout,
        io=io,
        on_commit=uploader.submit if uploader is not None else None,
        holds=uploader.held if uploader is not None else None,
        make_room=LocalRoom(layout, view, session).make_room if uploader is not None else None,
        nodes=nodes,
        stamp=(lambda: durable.stamp(tier)) if durable is not None and leads_root else None,
    )
    owns_local = _owns(session, False)

    uploading = uploader is not None and not read_only and owns_local  # a live job's are its own
    whole = _whole_saves(parts, nodes, uploader, view, held) if several else None
    if (held or other_held) and uploading and whole is not None:
        assert session.lock is not None
        try:
            settle_held(layout, session.lock, view, held, whole, other_held)
        except Exception as e:  # what is left stays held aside, for the next start
            logger.warning("safeckpt: could not settle the copies held aside in %s (%s)", root, e)
    if several:  # every rank sees what a put-back changed
        outcomes.share_view(parts.control, what=f"the checkpoints in {root}")
    if uploading and not parts.is_leader:
        assert uploader is not None  # a node's leader: its parts go up beside rank 0's, which waits
        uploader.upload_earlier(view.committed(), whole=whole, wait=False)

    def upload_earlier(heartbeat: Heartbeat) -> None:
        if uploading:
            assert uploader is not None
            uploader.upload_earlier(view.committed(), heartbeat=heartbeat, whole=whole)

    if durable is not None:  # rank 0 uploads; the other ranks wait with it
        on_leader(parts, upload_earlier, what="uploading what an earlier run left")
    writer = BackgroundWriter(committer.persist, on_crash=committer.crashed) if async_save else None
    triggers = Triggers(parts, schedule, signals)
    resumer = Resumer(
        root,
        parts=parts,
        layout=layout,
        session=session,
        damaged=damaged,
        outcomes=outcomes,
        save_rng=save_rng,
        io=io,
        durable=durable.layout if durable is not None else None,
        local_reads=nodes.count == 1,
    )
    pins = Pins(
        root,
        parts=parts,
        view=view,
        session=session,
        committer=committer,
        outcomes=outcomes,
        durable=durable if uploader is not None else None,  # where rank 0 holds both tiers
    )
    saver = Saver(
        root,
        token=token,
        save_rng=save_rng,
        parts=parts,
        layout=layout,
        view=view,
        session=session,
        damaged=damaged,
        committer=committer,
        outcomes=outcomes,
        triggers=triggers,
        pool=pool,
        writer=writer,
        state_cache=state_cache,
        overlap=overlap,
    )
    return Wiring(
        view,
        session,
        outcomes,
        committer,
        resumer,
        triggers,
        pins,
        saver,
        pool,
        writer,
        plans,
        state_cache,
        uploader,
    )


def _owns(session: RootSession, read_only: bool) -> bool:
    return not read_only and session.ownership is not None and session.ownership.claimed


def _local_identity(layout: Layout, session: RootSession, read_only: bool) -> str | None:
    """The local root's identity (written now by its writer where it has none; see
    :mod:`safeckpt._format.lineage`)."""
    if _owns(session, read_only) and session.lock is not None:
        return ensure_root_id(layout.root, session.lock)
    return read_root_id(layout.root)


def _whole_saves(
    parts: Participants, nodes: Nodes, uploader: Uploader | None, view: SaveView, held: list[Committed]
) -> frozenset[str]:
    """Collective: the saves not uploaded yet of which every node holds its part (committed, or a
    copy held aside), and which are not behind the durable root (rank 0 decides, as for one node):
    only these are uploaded."""
    mine = None
    if uploader is not None and nodes.leads(parts.rank):
        mine = {
            c.record.part_id: c
            for c in [*view.committed(), *held]
            if c.record.uploaded is None and c.record.part_id
        }
    said = parts.gather(None if mine is None else frozenset(mine), parts.control, what="the parts to upload")
    whole: frozenset[str] = frozenset()
    if parts.is_leader and mine is not None:
        held = [said[rank] for rank in nodes.leaders]
        if all(h is not None for h in held):
            whole = frozenset.intersection(*held)
            whole = frozenset(i for i in whole if uploader is not None and not uploader.behind(mine[i]))
    return parts.broadcast(whole, parts.control, what="the parts to upload")
