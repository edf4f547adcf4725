"""Tiers beside a manager's root: a local directory each save commits to first, uploaded to the
durable root in the background (``CheckpointManager(..., local_dir=...)``, ``docs/tiers.md``).

The manager's core knows none of this: it calls the protocol of
:mod:`safeckpt._manager.tiering`, which :class:`~.two_tiers.TwoTiers` implements. Importing this
package (``import safeckpt`` does) registers the builder of a manager's second tier; the modules
that need torch are imported when a manager with ``local_dir=`` is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._manager.tiering import register_second_tier

if TYPE_CHECKING:
    from .._manager.tiering import TierOptions, TierSetup


def _second_tier(options: TierOptions) -> TierSetup:
    from .setup import second_tier

    return second_tier(options)


register_second_tier(_second_tier)
