"""Which ranks share a ``local_dir``: the nodes of a run with two tiers.

Each rank passes its own ``local_dir``; ranks that see one directory (the
ranks of one node, on its disk) form a node, and the lowest rank of each node
leads it: it commits, prunes and uploads that node's local copies. Found at
start, not assumed from the launcher's topology: every rank writes a probe into
its ``local_dir``, and every rank reports which probes it sees. Sharing must be
all or nothing within a node; anything else (a directory some ranks of a node
see and others do not) is a :class:`ConfigError` on every rank, and so is a
``local_dir`` that cannot be written (every save commits there first): refused
at construction, not at the first ``save()``.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass

from .._dist.participants import Participants
from .._store.base import Store
from ..errors import ConfigError

_PROBE = ".node-probe.{token}.{rank}"


@dataclass(frozen=True)
class Nodes:
    """The node of each rank (numbered by their lowest rank's order) and each node's leader."""

    node_of: tuple[int, ...]
    leaders: tuple[int, ...]

    @classmethod
    def one(cls, world_size: int) -> Nodes:
        return cls((0,) * world_size, (0,))

    @property
    def count(self) -> int:
        return len(self.leaders)

    def leads(self, rank: int) -> bool:
        return rank in self.leaders

    def ranks_of(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]


def find_nodes(store: Store, ranks: Participants, *, read_only: bool) -> Nodes:
    """Collective: the nodes of ``ranks``, from what each rank sees in its ``local_dir``
    (``store``). A reader writes no probe: it is one node (each rank checks its own files).
    A ``local_dir`` a rank cannot write is a :class:`ConfigError` on every rank."""
    if read_only:
        return Nodes.one(ranks.world_size)
    token = uuid.uuid4().hex[:12]
    if ranks.distributed:
        token = ranks.broadcast(token, ranks.control, what="the local_dir probe")
    mine = _PROBE.format(token=token, rank=ranks.rank)
    error: BaseException | None = None
    try:
        store.make_dir("")
        store.write_atomic(mine, mine.encode())
    except OSError as e:
        error = _not_writable(store, e)
    if not ranks.distributed:
        if error is not None:
            raise error
        with contextlib.suppress(OSError):
            store.remove(mine)
        return Nodes.one(ranks.world_size)
    ranks.agree(error, ranks.control, what="writing a probe into local_dir")
    seen = [_sees(store, _PROBE.format(token=token, rank=r)) for r in range(ranks.world_size)]
    sees = ranks.gather(seen, ranks.control, what="reading the local_dir probes")
    with contextlib.suppress(OSError):
        store.remove(mine)
    return _grouped(sees, store.where(""))


def _not_writable(store: Store, error: OSError) -> ConfigError:
    cause, remedy = store.explain_error(error)
    refused = ConfigError(
        f"local_dir={store.where('')} cannot be written: {cause} ({type(error).__name__}: {error}). "
        f"Every save commits there first. To fix it: {remedy}; or pass a local_dir this user can "
        "write (or read_only=True, to only restore).",
        path=str(store.where("")),
    )
    refused.__cause__ = error
    return refused


def _sees(store: Store, name: str) -> bool:
    try:
        return store.read_small(name, limit=64, what="probe") == name.encode()
    except OSError:
        return False


def _grouped(sees: list[list[bool]], where: object) -> Nodes:
    """Nodes from ``sees[r][q]`` (rank r sees rank q's probe); each node's ranks see exactly each
    other's probes."""
    node_of: list[int] = [-1] * len(sees)
    leaders: list[int] = []
    for rank, row in enumerate(sees):
        if node_of[rank] >= 0:
            continue
        members = [q for q, seen in enumerate(row) if seen]
        if rank not in members or any(sees[q] != row for q in members):
            raise ConfigError(
                f"local_dir={where} (on rank {rank}) is shared by some ranks of a node and not by "
                f"others: rank {rank} sees the probes of ranks {members}, and they do not all see the "
                "same. Give the ranks of each node one directory on its own disk (the same path on "
                "every node works: each node's is its own)."
            )
        for q in members:
            node_of[q] = len(leaders)
        leaders.append(rank)
    return Nodes(tuple(node_of), tuple(leaders))
