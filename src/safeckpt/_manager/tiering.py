"""The seam between a manager and the tiers beside it (``local_dir=``; :mod:`safeckpt._tiers`).

The manager's core (the committer, the resumer, pins, the wiring) knows one root: its own. What a
second tier adds (:mod:`safeckpt._tiers`) reaches it only through the two protocols here, and a
manager without ``local_dir=`` uses :class:`OneTier`, whose hooks do nothing.

:class:`Tiers`, the commit side. Who calls what, in order:

1. ``start(core)``: every rank, once, at the end of ``CheckpointManager(...)``, after the
   manager's root is opened and its view shared. Collective over the control group. Opens the
   other tiers and settles what an earlier run left there.
2. For each save, on the writer thread (inline for a sync save), on a rank that commits (the
   lowest of the ranks that share its root, :attr:`TierSetup.sharing`):
   ``before_write(step)`` before anything of the save is written; ``commit(job, record)`` under
   the root's sidecar lock, just before the record is written (the record the tiers stamp, and
   where a copy the commit replaces goes); ``settled(job, everywhere=...)`` once the ranks agreed
   on a commit this rank made (``everywhere``: every rank's root committed it).
3. ``protected()``: the same rank, whenever it prunes (writer thread; ``pin``/``close()`` once the
   writer is idle): steps retention must keep for now.
4. ``wait(closing=False)`` from ``wait(durable=True)``, ``wait(closing=True)`` once from
   ``close()`` after the writer stopped: collective over the control group.

:class:`Copies`, the restore side: where a restore may find a copy of a checkpoint beyond the
manager's own root, and what a pin reaches there.

:func:`tiers_for` builds either: :class:`OneTier` without ``local_dir``, else what the second tier
registered (:func:`register_second_tier`; importing safeckpt does, see :mod:`safeckpt._tiers`).
This module imports no torch: the registration runs at ``import safeckpt``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import ConfigError

if TYPE_CHECKING:
    from .._dist.participants import Participants
    from .._format.layout import Layout
    from .._format.record import Record
    from .._fs.fileops import FileOps
    from .._policy.retention import Policy, Retention
    from .._store.base import Store
    from .._store.loc import Loc
    from .outcomes import Outcomes
    from .saves import SaveJob, SaveView
    from .session import RootSession


@dataclass(frozen=True)
class Core:
    """What of the manager's core a second tier works with (:meth:`Tiers.start`)."""

    ranks: Participants
    layout: Layout
    """The manager's own root (with a second tier: the local one)."""
    view: SaveView
    session: RootSession
    outcomes: Outcomes
    token: str
    """This run's id, the same on every rank (it names the run's staging directories)."""


@dataclass(frozen=True)
class TierCommit:
    """What a commit writes, as the tiers stamp it (:meth:`Tiers.commit`)."""

    record: Record
    keep_replaced: Loc | None = None
    """Where the copy this commit replaces goes instead of the trash, kept until :meth:`Tiers.settled`."""


@dataclass(frozen=True)
class Waited:
    """What :meth:`Tiers.wait` found."""

    error: BaseException | None = None
    """What ``wait(durable=True)`` raises on every rank (agreed by the caller)."""
    busy: bool = False
    """At ``close()``: work still runs that writes into the manager's root when it ends; the root
    stays held (its lock and owner record) rather than given to a second writer beside it."""


class Tiers(Protocol):
    """The commit side of a second tier. Call order and threads: see the module's docstring."""

    def start(self, core: Core) -> None:
        """Collective, once: open the other tiers and settle what an earlier run left."""

    def before_write(self, step: int) -> None:
        """Before a save of ``step`` writes (to free room for it). Never raises into the save."""

    def commit(self, job: SaveJob, record: Record) -> TierCommit:
        """Under the sidecar lock, just before ``record`` (the core's) is written: the record to
        write, and where a copy the commit replaces goes."""

    def settled(self, job: SaveJob, *, everywhere: bool) -> None:
        """The ranks agreed on ``job``, which this rank committed: every root committed it (then it
        goes on to the other tiers), or another failed (then this commit is taken back)."""

    def protected(self) -> frozenset[int]:
        """Committed steps retention keeps for now (not in every tier yet)."""

    def wait(self, *, closing: bool) -> Waited:
        """Collective: wait for the other tiers (``wait(durable=True)``), or, ``closing``, for what
        can still finish in time, and stop."""


class Copies(Protocol):
    """Where a restore finds copies beyond the manager's own root, and what a pin reaches there.

    ``roots``: the roots a restore chooses from, in the order a copy of one commit is tried (the
    manager's own root among them, or not). ``choose`` and ``pin`` run on rank 0; ``read_with``
    and ``unreadable_with`` on every rank, in the same order.
    """

    roots: Sequence[Layout]

    def choose(
        self,
        step: int | None,
        path: Loc | str | os.PathLike[str] | None,
        *,
        excluded: Sequence[Collection[int]],
        on_damaged: Callable[[Loc, Record | None, Exception], None],
    ) -> tuple[Loc, Record] | None:
        """The copy to restore (``excluded[i]``: steps of ``roots[i]`` found unloadable), or None to
        start fresh. ``on_damaged``: for damage found in the manager's own root."""

    def read_with(self, directory: Loc, record: Record) -> Loc | None:
        """``directory`` as this rank reads it with the files it holds on its own disk (None: as
        it is)."""

    def unreadable_with(self, step: int, why: str) -> None:
        """Reading ``step`` with the ranks' own files (:meth:`read_with`) found damage on every rank
        that failed: the next reads of it are of ``directory`` as it is."""

    def pin(self, step: int, pinned: bool, *, here: bool) -> bool:
        """Pin (or unpin) ``step``'s copies beyond the manager's root; whether there was one.
        ``here``: the manager's own copy took the pin already (an error then says so)."""


@dataclass(frozen=True)
class TierOptions:
    """A manager's arguments that concern its tiers."""

    root: Store
    """The root the manager was given (with ``local_dir``: the durable tier)."""
    ranks: Participants
    retention: Retention | Policy
    local_dir: str | os.PathLike[str] | None
    local_retention: Retention | Policy | None
    upload_timeout: float
    drain_timeout: float
    has_registrar: bool
    read_only: bool
    lock_timeout: float
    retry_interval: float
    file_ops: FileOps | None = None


@dataclass(frozen=True)
class TierSetup:
    """How a manager is built for its tiers (:func:`tiers_for`)."""

    store: Store
    """The manager's own root: where its saves commit (with a second tier: the local directory)."""
    retention: Retention | Policy
    """The retention of the manager's own root."""
    sharing: frozenset[int]
    """The ranks whose files this rank's root holds (every rank, on one shared root); the lowest
    of them commits there."""
    tiers: Tiers
    copies: Copies | None = None
    keep_staging: Callable[[str], bool] | None = None
    """Staging entries of the manager's root that start-up collection keeps (the tiers' own)."""
    local_dir: Path | None = None
    """The local directory, for the manager's attribute; None with one tier."""
    local_retention: Retention | Policy | None = None


class OneTier:
    """The tiers of a manager with one root: nothing beyond it."""

    def start(self, core: Core) -> None:
        pass

    def before_write(self, step: int) -> None:
        pass

    def commit(self, job: SaveJob, record: Record) -> TierCommit:
        return TierCommit(record)

    def settled(self, job: SaveJob, *, everywhere: bool) -> None:
        pass

    def protected(self) -> frozenset[int]:
        return frozenset()

    def wait(self, *, closing: bool) -> Waited:
        return Waited()


SecondTier = Callable[[TierOptions], TierSetup]
_second_tier: SecondTier | None = None


def register_second_tier(factory: SecondTier) -> None:
    """What builds a manager's tiers when it has a ``local_dir`` (:mod:`safeckpt._tiers`)."""
    global _second_tier
    _second_tier = factory


def tiers_for(options: TierOptions) -> TierSetup:
    """The tiers of a manager with these arguments (collective with a second tier)."""
    if options.local_dir is None:
        if options.local_retention is not None:
            raise ConfigError("local_retention= is the retention of local_dir=; pass local_dir= too.")
        everyone = frozenset(range(options.ranks.world_size))
        return TierSetup(options.root, options.retention, everyone, OneTier())
    if _second_tier is None:  # importing safeckpt registers it: only a broken install lacks it
        raise ConfigError("local_dir= needs safeckpt._tiers, which is missing; reinstall safeckpt.")
    return _second_tier(options)
