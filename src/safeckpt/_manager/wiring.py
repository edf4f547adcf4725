"""Building a manager's collaborators, and opening its root (collective over the control group).

Each collaborator is built from what it needs (no back references to the
manager), in the order their dependencies ask for: the view; the session on
the root (held by the rank that commits there), opened, and its registration
thread; agreement on the opening; then the committer, the tiers beside the root
(:meth:`~.tiering.Tiers.start`), the writer thread, triggers, the resumer, pins
and the saver.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from .._dcp.options import IOOptions
from .._dcp.plans import SavePlans
from .._dist.participants import Participants
from .._format.layout import Layout
from .._policy.schedule import SaveSchedule
from .._registration.registrar import Registrar
from .._registration.worker import RegistrationWorker
from .._state.walk import StateCache
from .._store.loc import Loc
from .background import BackgroundWriter, StagingPool
from .committer import Committer
from .damaged import DamagedCommits
from .outcomes import Outcomes
from .pins import Pins
from .preemption import PreemptionHandlers
from .resumer import Resumer
from .saver import Saver
from .saves import SaveView
from .session import RootSession
from .tiering import Core, TierSetup
from .triggers import Triggers

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


def wire(
    setup: TierSetup,
    ranks: Participants,
    *,
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
    overlap: bool = False,
) -> Wiring:
    """Build the collaborators and open the root of ``setup`` (on the ranks that commit there);
    every rank raises the same error if that fails. Then the tiers beside it start
    (:meth:`~.tiering.Tiers.start`: with ``local_dir=``, what an earlier run left reaches the
    other tiers before this returns)."""
    commits_here = ranks.rank == min(setup.sharing)  # rank 0, or the lowest rank sharing its root
    layout = Layout(Loc(setup.store))
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
    session.keep_staging = setup.keep_staging
    # a rank that commits in a root rank 0 does not see keeps its own view of it
    outcomes = Outcomes(ranks, view, own_view=commits_here and not ranks.is_leader)
    error: BaseException | None = None
    registration: RegistrationWorker | None = None
    if commits_here:
        try:
            session.open()
            if registrar is not None and not read_only and ranks.is_leader:
                assert session.lock is not None
                registration = RegistrationWorker(
                    registrar, session.lock, layout.root, timeout=registration_timeout
                )
        except BaseException as e:
            error = e
    ranks.agree(error, ranks.control, what=f"opening {root}")
    outcomes.share_view(ranks.control, what=f"the checkpoints in {root}")
    token = ranks.broadcast(uuid.uuid4().hex[:6], ranks.control, what="the save session id")
    pool = StagingPool(queue_depth) if async_save else None
    committer = Committer(
        root,
        setup.retention,
        ranks=ranks,
        plans=plans,
        layout=layout,
        view=view,
        pool=pool,
        session=session,
        outcomes=outcomes,
        registration=registration,
        registration_timeout=registration_timeout,
        io=io,
        tiers=setup.tiers,
        sharing=setup.sharing,
    )
    try:
        setup.tiers.start(Core(ranks, layout, view, session, outcomes, token))
    except BaseException:
        session.release()  # the root's lock and owner record go with the error
        raise
    writer = BackgroundWriter(committer.persist, on_crash=committer.crashed) if async_save else None
    triggers = Triggers(ranks, schedule, signals)
    resumer = Resumer(
        root,
        ranks=ranks,
        layout=layout,
        session=session,
        damaged=damaged,
        outcomes=outcomes,
        save_rng=save_rng,
        io=io,
        copies=setup.copies,
    )
    pins = Pins(
        root,
        ranks=ranks,
        view=view,
        session=session,
        committer=committer,
        outcomes=outcomes,
        copies=setup.copies,
    )
    saver = Saver(
        root,
        token=token,
        save_rng=save_rng,
        ranks=ranks,
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
    )
