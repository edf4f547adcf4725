"""Ranks, the manager's own process groups, and agreement on outcomes.

Two dedicated gloo groups, created once by every rank in the same order:

* ``control``: the training thread's agreement at the end of ``save()``,
  ``wait()``, ``flush()`` and ``close()``, restore decisions and ``dcp.load``;
* ``writer``: DCP saves and the writer thread's agreement on each save.

A collective on one group never runs concurrently from two threads, and the
training thread never uses the group the writer thread runs DCP on: mixing
them deadlocks under tightly spaced async saves. Without ``torch.distributed``
(or with one rank) the same code runs with one participant and no groups.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .._util.forksafe import at_exit
from .._util.torch_private import group_is_live
from ..errors import CheckpointError, RankAgreementError

logger = logging.getLogger(__name__)


@dataclass
class Participants:
    """The ranks that checkpoint together. Rank 0 alone writes records, moves ``latest``, prunes."""

    rank: int = 0
    world_size: int = 1
    control: dist.ProcessGroup | None = None
    writer: dist.ProcessGroup | None = None
    timeout: float = 600.0

    @classmethod
    def create(cls, *, timeout: float, group: dist.ProcessGroup | None = None) -> Participants:
        """One participant, or every rank of ``group`` (the default group when None).

        Collective: over the default group when ``group`` is None, else over
        ``group``'s ranks only (ranks outside it need not call), so managers
        scoped to different groups (pipeline stages) can be created side by side.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return cls(timeout=timeout)
        if group is None:
            if dist.get_world_size() == 1:
                return cls(timeout=timeout)
            delta = datetime.timedelta(seconds=timeout)
            control = dist.new_group(backend="gloo", timeout=delta)
            writer = dist.new_group(backend="gloo", timeout=delta)
            return _unreleased(
                cls(
                    rank=dist.get_rank(),
                    world_size=dist.get_world_size(),
                    control=control,
                    writer=writer,
                    timeout=timeout,
                )
            )
        ranks = sorted(dist.get_process_group_ranks(group))
        if dist.get_rank() not in ranks:
            raise CheckpointError(
                f"rank {dist.get_rank()} is not in the process_group given to the manager (ranks "
                f"{ranks}); create the manager only on the ranks of its group."
            )
        if len(ranks) == 1:
            return cls(timeout=timeout)
        delta = datetime.timedelta(seconds=timeout)
        # Local synchronization: only the group's ranks take part in creating these groups.
        control = dist.new_group(ranks, backend="gloo", timeout=delta, use_local_synchronization=True)
        writer = dist.new_group(ranks, backend="gloo", timeout=delta, use_local_synchronization=True)
        return _unreleased(
            cls(
                rank=dist.get_rank(control),  # rank order of the sorted ranks, as in both groups
                world_size=len(ranks),
                control=control,
                writer=writer,
                timeout=timeout,
            )
        )

    def release(self) -> None:
        """Shut down the two groups (idempotent; call once no collective runs on them).

        Left for interpreter exit, a gloo group's worker threads can still hold a
        finished collective's tensors; freeing them there takes the GIL while
        Python finalizes, and the process aborts ("terminate called without an
        active exception") after a run that succeeded.
        """
        groups, self.control, self.writer = (self.control, self.writer), None, None
        _UNRELEASED.pop(id(self), None)
        for group in groups:
            try:
                # gone already when the caller destroyed every group first
                if group is not None and dist.is_initialized() and group_is_live(group):
                    dist.destroy_process_group(group)
            except Exception as e:  # never instead of the caller's own error
                logger.warning("safeckpt: could not shut down one of the manager's gloo groups: %s", e)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def gather(self, obj: Any, group: dist.ProcessGroup | None, *, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order. Collective over ``group``."""
        if not self.distributed:
            return [obj]
        live = self._live(group)
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=live)
        except Exception as e:
            raise self._lost(what, e) from e
        return out

    def broadcast(self, obj: Any, group: dist.ProcessGroup | None, *, what: str) -> Any:
        """Rank 0's ``obj`` on every rank. Collective over ``group``."""
        if not self.distributed:
            return obj
        live = self._live(group)
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=dist.get_global_rank(live, 0), group=live)
        except Exception as e:
            raise self._lost(what, e) from e
        return box[0]

    def agree(
        self,
        error: BaseException | None,
        group: dist.ProcessGroup | None,
        *,
        what: str,
        step: int | None = None,
    ) -> None:
        """Return if every rank succeeded; else raise the same error on every rank.

        One participant: re-raises its own error unchanged. Several: a single
        distinct failure is re-raised as it is on every rank (with ``rank`` set);
        several become a :class:`RankAgreementError` naming each failing rank.
        """
        errors = self.gather(portable(error), group, what=what)
        failures = {rank: e for rank, e in enumerate(errors) if e is not None}
        if not failures:
            return
        if not self.distributed:
            assert error is not None
            raise error
        raise agreed_error(failures, what=what, step=step)

    @staticmethod
    def _live(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        # None would silently mean the default group: here it means release() ran
        if group is None:
            raise CheckpointError(
                "the manager's process groups were shut down (by close(), or as the interpreter "
                "exits); create a new manager."
            )
        return group

    def _lost(self, what: str, cause: Exception) -> RankAgreementError:
        return RankAgreementError(
            f"rank {self.rank}: the ranks could not agree on {what}: {cause}. Another rank "
            f"probably died or stopped answering within {self.timeout:.0f} s. Nothing of this "
            "operation was committed; restart the job, and it resumes from the last committed "
            "checkpoint.",
            failures={-1: str(cause)},
            step=None,
            rank=self.rank,
        )


# Groups not released yet, by id of their Participants: a manager whose constructor failed, or
# one never closed, still has its groups shut down at exit, after the exit hooks of managers
# (this one is registered with the first group, before any manager's), while Python is whole.
_UNRELEASED: dict[int, Participants] = {}


def _unreleased(parts: Participants) -> Participants:
    at_exit(_release_all)
    _UNRELEASED[id(parts)] = parts
    return parts


def _release_all() -> None:
    for parts in list(_UNRELEASED.values()):
        parts.release()


def agreed_error(failures: Mapping[int, BaseException], *, what: str, step: int | None) -> CheckpointError:
    """The one error every rank raises for ``failures`` (rank -> error)."""
    messages = {rank: f"{type(e).__name__}: {e}" for rank, e in failures.items()}
    distinct = {str(e) for e in failures.values()}
    if len(distinct) == 1:
        rank, first = min(failures.items())
        if isinstance(first, CheckpointError):
            named = {getattr(e, "rank", None) for e in failures.values()}
            if len(failures) == 1:
                first.rank = rank
            elif len(named) != 1 or None in named:  # one error agreed on earlier keeps its rank
                first.rank = None
            return first
    listing = "; ".join(f"rank {r}: {m}" for r, m in sorted(messages.items()))
    return RankAgreementError(
        f"{what} failed on rank(s) {sorted(failures)}: {listing}",
        failures=messages,
        step=step,
    )


def portable(error: BaseException | None) -> BaseException | None:
    """``error`` if it pickles, else a CheckpointError with its text (for all_gather_object)."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return CheckpointError(f"{type(error).__name__}: {error}")
