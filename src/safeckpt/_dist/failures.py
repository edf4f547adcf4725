"""Turning what went wrong during a save into one error that says what to do."""

from __future__ import annotations

from collections.abc import Mapping

from .._store.loc import Loc
from ..errors import (
    CheckpointError,
    ConfigError,
    RootInUseError,
    RootNotWritableError,
    RootUnreachableError,
    SaveFailedError,
)


def describe(error: BaseException) -> str:
    """One line for an error; DCP's CheckpointException is unwrapped to each rank's cause."""
    # here, not at the top: the CLI's tables use human_size() and must not import torch
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        causes = []
        for rank, failure in sorted(error.failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            causes.append(f"DCP rank {rank}: {type(cause).__name__}: {cause}")
        return "; ".join(causes) or str(error)
    return f"{type(error).__name__}: {str(error).rstrip('.')}"


def human_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def save_failed(
    step: int,
    failed: Mapping[int, BaseException],
    *,
    own: BaseException | None,
    root: Loc,
    latest: str,
    distributed: bool,
) -> CheckpointError:
    """The error every rank raises for a save that failed on ``failed`` (rank -> error).

    ``latest`` says what ``latest`` names now ("step 3", "nothing", "unchanged").
    The free space where the root is goes into the message: a full disk is the
    usual cause, and DCP's own error rarely says so. A save refused because another
    writer owns the root is that :class:`RootInUseError` (no retry will help).
    """
    refusal = next((e for _, e in sorted(failed.items()) if isinstance(e, RootInUseError)), None)
    if refusal is not None:
        refused = RootInUseError(
            f"the save of step {step} was not made: {refusal.message}",
            path=refusal.path,
            step=step,
            owner=refusal.owner,
        )
        refused.__cause__ = refusal
        return refused
    detail = "; ".join(f"rank {r}: {describe(e)}" for r, e in sorted(failed.items()))
    free = root.store.free_space()
    if free is not None:
        detail += f" (free space where the root is: {human_size(free)})"
    where = f" on rank(s) {sorted(failed)}" if distributed else ""
    cause = own or failed[min(failed)]
    if all(isinstance(e, ConnectionError) for e in failed.values()):
        todo = "The storage did not answer: the next save tries again, as it is."
    else:
        todo = "Fix the cause (disk space, permissions, the state) and save again."
    error = SaveFailedError(
        f"the save of step {step} failed{where}: {detail}. Nothing of it was committed; `latest` "
        f"{latest} and earlier checkpoints are untouched. {todo}",
        step=step,
        path=str(root),
        cause=cause,
        failures={r: describe(e) for r, e in failed.items()},
    )
    error.__cause__ = cause
    return error


def unreachable(root: Loc, error: OSError, *, doing: str, step: int | None = None) -> RootUnreachableError:
    """The error for a root whose storage does not answer (``error`` is a ``ConnectionError``)."""
    cause, remedy = root.store.explain_error(error)
    wrapped = RootUnreachableError(
        f"{doing}: {root} cannot be reached: {cause}. Nothing already saved was touched; {remedy}. "
        "This is not a configuration error: the same call can work once the storage answers again.",
        path=str(root),
        step=step,
        errno=error.errno,
    )
    wrapped.__cause__ = error
    return wrapped


def storage_error(root: Loc, error: OSError, *, doing: str) -> CheckpointError:
    """A storage error met outside a save, as a public call raises it: storage that does not
    answer is :class:`RootUnreachableError` (try again), any other refusal a :class:`ConfigError`
    naming the cause (the server's code) and what to fix."""
    if isinstance(error, ConnectionError):
        return unreachable(root, error, doing=doing)
    cause, remedy = root.store.explain_error(error)
    wrapped = ConfigError(
        f"{doing}: {root} cannot be read: {cause} ({type(error).__name__}: {error}). To fix it: {remedy}.",
        path=str(root),
    )
    wrapped.__cause__ = error
    return wrapped


def root_not_writable(
    root: Loc, error: OSError, *, doing: str, step: int | None = None
) -> RootNotWritableError | RootUnreachableError:
    """The error for an ``OSError`` met while preparing to write ``root``: the cause, then the remedy
    (as the root's store explains its own errors). Storage that does not answer is
    :class:`RootUnreachableError`: nothing is wrong with the root itself."""
    if isinstance(error, ConnectionError):
        return unreachable(root, error, doing=doing, step=step)
    cause, remedy = root.store.explain_error(error)
    wrapped = RootNotWritableError(
        f"{doing}: {root} cannot be written: {cause} ({type(error).__name__}: {error}). Nothing "
        f"already saved was touched; {remedy}.",
        path=str(root),
        step=step,
        errno=error.errno,
    )
    wrapped.__cause__ = error
    return wrapped
