"""What a manager with two tiers does as it starts, once its own (local) root is open.

Collective over the control group (:meth:`~safeckpt._tiers.two_tiers.TwoTiers.start`):

1. :func:`open_tiers`: each rank that commits in a local root (rank 0, and each node's leader)
   opens the durable root (rank 0 holds it as a manager holds its own; the other leaders only read
   its identity), refuses a local directory holding another root's commits, and (rank 0, with one
   node) sets aside the local commits the root has moved on past. Every rank raises the same error
   if one of them failed.
2. :func:`settle_earlier`: with several nodes, the nodes agree which saves not uploaded yet are
   whole (every node holds its part, :func:`whole_saves`), and a copy held aside
   (:mod:`.node_commits`) goes back in place of a part of a save that is not. Then what an earlier
   run committed locally and never uploaded goes up before training goes on (rank 0 waits, the
   other ranks with it, in heartbeats), or waits in line while the root cannot be reached.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .._dist.participants import Participants
from .._format.lineage import ensure_root_id, read_root_id
from .._manager.saves import Committed, SaveView
from .._manager.session import RootSession
from .._manager.tiering import Core
from .._store.loc import Loc
from .durable import DurableTier
from .leader_wait import Heartbeat, on_leader
from .node_commits import held_copies, settle_held
from .nodes import Nodes
from .uploads import Uploader

logger = logging.getLogger("safeckpt.manager")


@dataclass
class Opened:
    """What :func:`open_tiers` found on this rank."""

    uploader: Uploader | None = None
    """This rank's uploader (a rank that commits in a local root), else None."""
    tier: str | None = None
    """The local root's identity, which its commits record (see ``_format.lineage``)."""
    held: list[Committed] = field(default_factory=list)
    """Copies an earlier run held aside (several nodes), and the other staging entries."""
    other_staging: list[Loc] = field(default_factory=list)


def open_tiers(
    core: Core, durable: DurableTier, nodes: Nodes, *, read_only: bool, retry_interval: float
) -> Opened:
    """Collective: step 1 of the module's docstring."""
    ranks, layout, session = core.ranks, core.layout, core.session
    opened = Opened()
    error: BaseException | None = None
    if nodes.leads(ranks.rank):  # it holds its local root (rank 0, or a node's leader)
        try:
            if nodes.count > 1:
                opened.held, opened.other_staging = held_copies(layout)
            if ranks.is_leader:  # the other nodes' leaders only put their parts in the root
                durable.open()
            else:
                durable.read_identity()
            opened.tier = _local_identity(core, read_only)
            committed = [c.record for c in [*core.view.committed(), *opened.held]]
            durable.refuse_others(layout.root, committed)
            assert session.lock is not None
            opened.uploader = Uploader(durable, core.view, session.lock, retry_interval=retry_interval)
            if ranks.is_leader and nodes.count == 1 and owns(session, read_only):
                opened.uploader.set_aside_behind(core.view.committed(), layout)
        except BaseException as e:
            error = e
    try:
        ranks.agree(error, ranks.control, what=f"opening {durable.root}")
    except BaseException:
        if ranks.is_leader:
            durable.release()  # its lock and owner record go with the error
        raise
    durable.run = core.token
    # every rank sees what was set aside
    core.outcomes.share_view(ranks.control, what=f"the checkpoints in {layout.root.where}")
    return opened


def settle_earlier(core: Core, nodes: Nodes, opened: Opened, *, read_only: bool) -> None:
    """Collective: step 2 of the module's docstring."""
    ranks, layout, session, view = core.ranks, core.layout, core.session, core.view
    uploader = opened.uploader
    uploading = uploader is not None and owns(session, read_only)  # a live job's are its own
    several = nodes.count > 1
    whole = whole_saves(ranks, nodes, uploader, view, opened.held) if several else None
    if (opened.held or opened.other_staging) and uploading and whole is not None:
        assert session.lock is not None
        try:
            settle_held(layout, session.lock, view, opened.held, whole, opened.other_staging)
        except Exception as e:  # what is left stays held aside, for the next start
            logger.warning("safeckpt: could not settle the copies held aside in %s (%s)", layout.root, e)
    if several:  # every rank sees what a put-back changed
        core.outcomes.share_view(ranks.control, what=f"the checkpoints in {layout.root.where}")
    if uploading and not ranks.is_leader:
        assert uploader is not None  # a node's leader: its parts go up beside rank 0's, which waits
        uploader.upload_earlier(view.committed(), whole=whole, wait=False)

    def upload_earlier(heartbeat: Heartbeat) -> None:
        if uploading:
            assert uploader is not None
            uploader.upload_earlier(view.committed(), heartbeat=heartbeat, whole=whole)

    on_leader(ranks, upload_earlier, what="uploading what an earlier run left")  # rank 0 uploads


def owns(session: RootSession, read_only: bool) -> bool:
    """Whether this manager writes the root of ``session`` (it claimed it)."""
    return not read_only and session.ownership is not None and session.ownership.claimed


def _local_identity(core: Core, read_only: bool) -> str | None:
    """The local root's identity (written now by its writer where it has none; see
    :mod:`safeckpt._format.lineage`)."""
    if owns(core.session, read_only) and core.session.lock is not None:
        return ensure_root_id(core.layout.root, core.session.lock)
    return read_root_id(core.layout.root)


def whole_saves(
    ranks: Participants, nodes: Nodes, uploader: Uploader | None, view: SaveView, held: list[Committed]
) -> frozenset[str]:
    """Collective: the saves not uploaded yet of which every node holds its part (committed, or a
    copy held aside), and which are not behind the durable root (rank 0 decides, as for one node):
    only these are uploaded."""
    mine = None
    if uploader is not None and nodes.leads(ranks.rank):
        mine = {
            c.record.part_id: c
            for c in [*view.committed(), *held]
            if c.record.uploaded is None and c.record.part_id
        }
    said = ranks.gather(None if mine is None else frozenset(mine), ranks.control, what="the parts to upload")
    whole: frozenset[str] = frozenset()
    if ranks.is_leader and mine is not None:
        leaders = [said[rank] for rank in nodes.leaders]
        if all(h is not None for h in leaders):
            whole = frozenset.intersection(*leaders)
            whole = frozenset(i for i in whole if uploader is not None and not uploader.behind(mine[i]))
    return ranks.broadcast(whole, ranks.control, what="the parts to upload")
