"""Building the tiers of a manager with ``local_dir=``: what :func:`second_tier` returns to
:func:`safeckpt._manager.tiering.tiers_for` (registered by :mod:`safeckpt._tiers`).

Checks the arguments, opens the local directory as the manager's own root, and finds the nodes
(collective: every rank writes a probe into its ``local_dir``, :mod:`.nodes`). Nothing of either
root is claimed yet: that is the manager's opening, then :meth:`.TwoTiers.start`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._format.layout import Layout
from .._manager.tiering import TierOptions, TierSetup
from .._policy.retention import Retention
from .._store.loc import Loc
from .._store.registry import local_path, open_store
from ..errors import ConfigError
from .copies import TierCopies
from .durable import DurableTier
from .node_commits import is_held
from .nodes import find_nodes
from .two_tiers import TwoTiers

_LOCAL_RETENTION = Retention(keep_last=2)


def second_tier(options: TierOptions) -> TierSetup:
    """The tiers of a manager whose root is ``options.root`` and whose first tier is
    ``options.local_dir``. Collective over the control group."""
    assert options.local_dir is not None
    durable_root = options.root
    local_dir = local_directory(options.local_dir, Loc(durable_root).on_disk)
    if options.has_registrar:
        raise ConfigError(
            "local_dir= works without a registrar, for now; to register checkpoints, save "
            "to the root directly (without local_dir=)."
        )
    ranks = options.ranks
    durable = DurableTier(
        durable_root,
        ranks,
        options.retention,
        read_only=options.read_only,
        lock_timeout=options.lock_timeout,
        retry_interval=options.retry_interval,
    )
    local = open_store(local_dir, ops=options.file_ops)
    nodes = find_nodes(local, ranks, read_only=options.read_only)
    layout = Layout(Loc(local))
    several = nodes.count > 1
    tiers = TwoTiers(
        durable,
        nodes,
        ranks,
        local_dir=local_dir,
        read_only=options.read_only,
        retry_interval=options.retry_interval,
        upload_timeout=options.upload_timeout,
        drain_timeout=options.drain_timeout,
    )
    local_retention = options.local_retention if options.local_retention is not None else _LOCAL_RETENTION
    return TierSetup(
        store=local,
        retention=local_retention,
        sharing=frozenset(nodes.ranks_of(nodes.node_of[ranks.rank])),
        tiers=tiers,
        copies=TierCopies(layout, durable, several_nodes=several),
        # copies a run held aside (see .node_commits): kept at start until the nodes agree
        keep_staging=(lambda name: is_held(layout.staging / name)) if several else None,
        local_dir=local_dir,
        local_retention=local_retention,
    )


def local_directory(local_dir: str | os.PathLike[str], root: Path | None) -> Path:
    """``local_dir`` as an absolute path, checked: a directory of this machine, apart from ``root``
    (the durable root's directory, or None for a root on object storage)."""
    text = os.fspath(local_dir)
    local = local_path(text)  # a file:// URL's path; a mistyped URL is refused, never created
    if local is None:
        raise ConfigError(
            f"local_dir={text!r} is a URL; it must be a directory on this machine's disk (the fast "
            "tier). The durable tier is the root.",
            path=text,
        )
    path = Path(local).absolute()
    if root is not None:
        durable = root
        if path == durable or durable in path.parents or path in durable.parents:
            raise ConfigError(
                f"local_dir={path} and the root {durable} are one inside the other; give the local "
                "tier a directory of its own.",
                path=text,
            )
    return path
