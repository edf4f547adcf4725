"""A second tier beside a manager's root: the :class:`~safeckpt._manager.tiering.Tiers` of a
manager with ``local_dir=`` (``docs/tiers.md``).

The manager's own root is then the local directory: saves commit there as on any root. This
adds, through the protocol's hooks only:

* at start (:mod:`.startup`): the durable root opened, what an earlier run left settled;
* before each save writes: room on the local disk (:mod:`.room`);
* at each commit: the record's tier fields (the durable root it follows; with a local directory
  on each node's disk, the node's part of the save), and where a copy it replaces is held until
  every node has committed (:mod:`.node_commits`);
* after each commit every rank agreed on: its upload, in commit order (:mod:`.uploads`), and
  local retention kept off the commits not uploaded yet;
* ``wait(durable=True)`` and ``close()``: rank 0 waits for the uploads, the other ranks with it
  (:mod:`.leader_wait`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from .._dist.participants import Participants
from .._format.record import Record
from .._format.tier_fields import Part
from .._manager.saves import SaveJob
from .._manager.tiering import Core, TierCommit, Waited
from .durable import DurableTier
from .leader_wait import on_leader
from .node_commits import NodeCommits
from .nodes import Nodes
from .room import LocalRoom
from .startup import open_tiers, settle_earlier
from .uploads import Uploader, not_uploaded_error

logger = logging.getLogger("safeckpt.manager")

# How long another node's leader waits at close() for its last uploads, once rank 0 has waited for
# their commits: only to see them and mark its local copies.
_NODE_CLOSE_TIMEOUT = 10.0


class TwoTiers:
    """A local tier (the manager's root) and a durable one. Call rules: the protocol's
    (:mod:`safeckpt._manager.tiering`)."""

    def __init__(
        self,
        durable: DurableTier,
        nodes: Nodes,
        ranks: Participants,
        *,
        local_dir: Path,
        read_only: bool,
        retry_interval: float,
        upload_timeout: float,
        drain_timeout: float,
    ) -> None:
        self._durable = durable
        self._nodes = nodes
        self._ranks = ranks
        self._local_dir = local_dir
        self._read_only = read_only
        self._retry_interval = retry_interval
        self._upload_timeout = upload_timeout
        self._drain_timeout = drain_timeout
        self._core: Core | None = None
        # Set at start on a rank that commits in a local root (rank 0, each node's leader):
        self._uploader: Uploader | None = None
        self._room: LocalRoom | None = None
        self._node_commits: NodeCommits | None = None  # with several nodes
        self._tier: str | None = None  # the local root's identity, which its commits record

    # --- start ---------------------------------------------------------------------------------

    def start(self, core: Core) -> None:
        self._core = core
        opened = open_tiers(
            core, self._durable, self._nodes, read_only=self._read_only, retry_interval=self._retry_interval
        )
        self._uploader, self._tier = opened.uploader, opened.tier
        if self._uploader is not None:
            self._room = LocalRoom(core.layout, core.view, core.session)
            if self._nodes.count > 1:
                self._node_commits = NodeCommits(core.layout, core.view, core.session, self._uploader.submit)
        settle_earlier(core, self._nodes, opened, read_only=self._read_only)

    # --- each save -------------------------------------------------------------------------------

    def before_write(self, step: int) -> None:
        if self._room is None:
            return
        try:
            self._room.make_room(step)
        except Exception as e:  # making room only helps; the save's own write says if it fails
            logger.warning("safeckpt: could not make room for step %d: %s", step, e)

    def commit(self, job: SaveJob, record: Record) -> TierCommit:
        stamped = dataclasses.replace(record, local=self._durable.stamp(self._tier))
        if self._node_commits is None:
            return TierCommit(stamped)
        # Each node commits its part of the save (its ranks' files), named by the save's staging
        # directory, the same on every node.
        node = self._nodes.node_of[self._ranks.rank]
        part = Part(save=job.staging_dir.name, node=node, nodes=self._nodes.count)
        return TierCommit(dataclasses.replace(stamped, part=part), self._node_commits.hold_place(job))

    def settled(self, job: SaveJob, *, everywhere: bool) -> None:
        if self._node_commits is not None:
            self._node_commits.settled(job, everywhere=everywhere)
        if everywhere and self._uploader is not None and self._core is not None:
            committed = self._core.view.get(job.step)
            if committed is not None:
                self._uploader.submit(committed)

    def protected(self) -> frozenset[int]:
        return self._uploader.kept_for_upload() if self._uploader is not None else frozenset()

    # --- waiting for the durable tier ------------------------------------------------------------

    def wait(self, *, closing: bool) -> Waited:
        return self._close() if closing else self._wait_durable()

    def _wait_durable(self) -> Waited:
        """``wait(durable=True)``: rank 0 waits for the uploads while they succeed, the other ranks
        with it; what is still waiting, and what never will be durable, is the error."""
        assert self._core is not None
        if self._uploader is not None and not self._ranks.is_leader:
            self._uploader.wake()  # another node's leader: rank 0's commits wait for its parts
        self._core.outcomes.same_call("wait(durable=True)")  # before rank 0's heartbeats
        uploaded = on_leader(
            self._ranks,
            lambda beat: self._uploads().wait(self._upload_timeout, give_up_on_failure=True, heartbeat=beat),
            what="wait(durable=True): rank 0's uploads",
        )
        if uploaded is None:  # not rank 0: rank 0's answer is the one agreed
            return Waited()
        lost = self._uploads().take_lost()
        steps, cause = self._uploads().waiting() if not uploaded else ([], None)
        if not steps and not lost:
            return Waited()
        return Waited(error=not_uploaded_error(self._durable.root, self._local_dir, steps, cause, lost=lost))

    def _close(self) -> Waited:
        """``close()``: rank 0 waits for the uploads while they succeed (what is left is uploaded by
        the next start), then gives the durable root up, unless an upload is still in flight."""
        assert self._core is not None
        self._core.outcomes.same_call("close(): uploads")  # before rank 0's heartbeats
        closed = on_leader(
            self._ranks,
            lambda beat: self._uploads().close(self._upload_timeout, heartbeat=beat),
            what="close(): rank 0's uploads",
        )
        stuck = False
        if closed is None:  # not rank 0
            if self._uploader is not None:  # another node's leader: rank 0 has committed what it could
                _, stuck = self._uploader.close(_NODE_CLOSE_TIMEOUT)
        else:
            left, stuck = closed
            self._say_left(left, stuck)
        if stuck:
            # Both tiers' locks and owner records stay held (a lease expires on its own): never a
            # second writer beside a request still in flight, or beside its local mark after it.
            return Waited(busy=True)
        self._durable.drain(self._drain_timeout)
        errors = self._durable.release()
        if errors:
            raise errors[0]
        return Waited()

    def _say_left(self, left: list[int], stuck: bool) -> None:
        root, local = self._durable.root, self._local_dir
        if stuck:
            logger.warning("safeckpt: an upload to %s is still in flight at close(); left running", root)
        if left:
            logger.warning(
                "safeckpt: step(s) %s of %s are committed in %s but not uploaded to %s; the next start "
                "with local_dir=, or `safeckpt upload %s --local-dir %s`, uploads them",
                ", ".join(map(str, left)),
                root,
                local,
                root,
                root,
                local,
            )

    def _uploads(self) -> Uploader:
        assert self._uploader is not None  # rank 0 (or a node's leader) of a manager with local_dir=
        return self._uploader
