"""Errors. Everything safeckpt raises derives from :class:`CheckpointError`.

Each error carries the fields a caller may want to act on (``path``, ``step``,
``rank``) and a message that says what happened and what to do. All of them
pickle, so they cross process boundaries (spawned ranks, ``multiprocessing``).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any, TypeVar


class CheckpointError(Exception):
    """Base class of every safeckpt error.

    ``path``, ``step`` and ``rank`` are set where they are known, else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        step: int | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.step = step
        self.rank = rank

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.__dict__.copy()))

    def __str__(self) -> str:
        return self.message


_E = TypeVar("_E", bound=CheckpointError)


def _rebuild(cls: type[_E], message: str, fields: dict[str, Any]) -> _E:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(fields)
    return error


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested checkpoint (step or path) does not exist."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint exists but is not committed, or its files do not match its record."""


class NewerFormatError(CheckpointError):
    """A checkpoint was written by a newer safeckpt, in a format this one cannot read. Never skipped
    by auto-resume: falling back to an older checkpoint would silently undo training progress."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint asked to run code, to read a file outside itself, or to open something that is
    not a regular file: loading never allows it."""


class CorruptCheckpointError(CheckpointError):
    """Bytes of a checkpoint do not match the checksum written with them; they are never loaded.

    ``path`` is the file, ``offset`` where the mismatching segment starts, ``step`` the checkpoint's.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message, path=path, step=step, rank=rank)
        self.offset = offset


class InvalidSaveError(CheckpointError, ValueError):
    """``save()`` was called with arguments that cannot be saved; nothing was written."""


class UnsupportedStateError(CheckpointError, TypeError):
    """A value in the state cannot be saved without pickle, or loaded into what was given."""

    subject: Any = None  # the object whose path in the state the error names, once found


class SaveFailedError(CheckpointError):
    """A save failed while being written; nothing of it was committed.

    ``cause`` is the original error (also chained as ``__cause__``). For a save
    that failed on several ranks, ``failures`` maps each failing rank to its
    error message.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        cause: BaseException | None = None,
        failures: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(message, path=path, step=step, rank=rank)
        self.cause = cause
        self.failures = dict(failures or {})

    def __reduce__(self) -> tuple[Any, ...]:
        # The cause can be anything a write raised (one holding a file or a lock): keep its text
        # where it does not pickle, so this error still crosses to the other ranks whole.
        fields = self.__dict__.copy()
        fields["cause"] = _picklable(self.cause)
        return (_rebuild, (type(self), self.message, fields))


def _picklable(error: BaseException | None) -> BaseException | None:
    if error is None:
        return None
    try:
        pickle.dumps(error)
    except Exception:
        return CheckpointError(f"{type(error).__name__}: {error}")
    return error


class RankAgreementError(CheckpointError):
    """Ranks did not reach the same outcome: one or more failed or stopped answering.

    ``failures`` maps each failing rank to what it reported (or to the reason it
    is presumed dead). Every rank raises this error with the same ``failures``.
    """

    def __init__(
        self,
        message: str,
        *,
        failures: Mapping[int, str] | None = None,
        step: int | None = None,
        path: str | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(message, path=path, step=step, rank=rank)
        self.failures = dict(failures or {})


class LockTimeoutError(CheckpointError, TimeoutError):
    """The sidecar lock of a checkpoint root could not be taken in time."""


class RootInUseError(CheckpointError):
    """Another live process owns the root's writes; a root has one writer at a time.

    ``owner`` describes it (host, pid, since when, last heartbeat).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        owner: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message, path=path, step=step, rank=rank)
        self.owner = dict(owner or {})


class RootNotWritableError(CheckpointError):
    """The root cannot be written: it is read-only, full, under a file, not permitted, or the
    manager was opened with ``read_only=True``. Nothing already saved was touched.

    ``errno`` is the operating system's error number where there was one, else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message, path=path, step=step, rank=rank)
        self.errno = errno


class RootUnreachableError(CheckpointError, ConnectionError):
    """The storage that holds the root does not answer (refused, reset or timed out, after the
    retries ``storage_options["timeout"]`` allows). Not a configuration error: the same call may
    work once the storage is back. Nothing already saved was touched.

    ``errno`` is the operating system's error number where there was one, else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message, path=path, step=step, rank=rank)
        self.errno = errno

    def __reduce__(self) -> tuple[Any, ...]:  # errno is OSError's own slot, not in __dict__
        return (_rebuild_unreachable, (self.message, self.__dict__.copy(), self.errno))


def _rebuild_unreachable(message: str, fields: dict[str, Any], errno: int | None) -> RootUnreachableError:
    error = _rebuild(RootUnreachableError, message, fields)
    error.errno = errno
    return error


class ManagerClosedError(CheckpointError, RuntimeError):
    """The manager was used after ``close()``."""


class ConfigError(CheckpointError, ValueError):
    """A configuration value is invalid or contradicts another one."""
