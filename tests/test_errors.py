"""Errors: one base class, a builtin mixed in where it fits, fields, and pickling."""

from __future__ import annotations

import copy
import pickle
import threading
from typing import Any

import pytest

import safeckpt
from safeckpt import errors
from safeckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidSaveError,
    LockTimeoutError,
    ManagerClosedError,
    NewerFormatError,
    RankAgreementError,
    RootInUseError,
    RootNotWritableError,
    RootUnreachableError,
    SaveFailedError,
    UnsafeCheckpointError,
    UnsupportedStateError,
)

# Each class, with the builtin it mixes in (Exception where it mixes in none).
CLASSES: list[tuple[type[CheckpointError], type[BaseException]]] = [
    (CheckpointError, Exception),
    (CheckpointNotFoundError, FileNotFoundError),
    (IncompleteCheckpointError, Exception),
    (UnsafeCheckpointError, Exception),
    (CorruptCheckpointError, Exception),
    (InvalidSaveError, ValueError),
    (UnsupportedStateError, TypeError),
    (SaveFailedError, Exception),
    (RankAgreementError, Exception),
    (LockTimeoutError, TimeoutError),
    (RootInUseError, Exception),
    (RootNotWritableError, Exception),
    (RootUnreachableError, ConnectionError),
    (ManagerClosedError, RuntimeError),
    (ConfigError, ValueError),
    (NewerFormatError, Exception),
]
IDS = [cls.__name__ for cls, _ in CLASSES]


def test_every_error_class_is_listed_here() -> None:
    defined = {
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    }
    assert defined == {cls for cls, _ in CLASSES}
    assert all(cls.__name__ in safeckpt.__all__ for cls in defined)


def make(cls: type[CheckpointError]) -> CheckpointError:
    kwargs: dict[str, Any] = dict(path="/ckpt/step_3", step=3, rank=1)
    if cls is SaveFailedError:
        kwargs.update(cause=OSError(28, "No space left on device"), failures={1: "OSError: no space"})
    if cls is RankAgreementError:
        kwargs.update(failures={1: "RuntimeError: boom", 3: "presumed dead"})
    if cls is CorruptCheckpointError:
        kwargs.update(offset=4096)
    if cls is RootInUseError:
        kwargs.update(owner={"host": "node7", "pid": 1234})
    if cls in (RootNotWritableError, RootUnreachableError):
        kwargs.update(errno=30)
    return cls(f"{cls.__name__}: what happened; what to do.", **kwargs)


@pytest.mark.parametrize("cls,builtin", CLASSES, ids=IDS)
def test_hierarchy(cls: type[CheckpointError], builtin: type[BaseException]) -> None:
    error = make(cls)
    assert isinstance(error, CheckpointError)
    assert isinstance(error, builtin)
    assert isinstance(error, Exception), "an `except Exception` must catch every safeckpt error"
    with pytest.raises(builtin):
        raise error


@pytest.mark.parametrize("cls,builtin", CLASSES, ids=IDS)
@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_pickles_with_its_fields(
    cls: type[CheckpointError], builtin: type[BaseException], protocol: int
) -> None:
    error = make(cls)
    clone = pickle.loads(pickle.dumps(error, protocol=protocol))
    assert type(clone) is cls
    assert str(clone) == str(error) == f"{cls.__name__}: what happened; what to do."
    assert clone.args == error.args
    assert (clone.path, clone.step, clone.rank) == ("/ckpt/step_3", 3, 1)
    if isinstance(error, (SaveFailedError, RankAgreementError)):
        assert clone.failures == error.failures  # type: ignore[attr-defined]
    if isinstance(error, (RootNotWritableError, RootUnreachableError)):
        assert clone.errno == 30  # type: ignore[attr-defined]
    if isinstance(error, SaveFailedError):
        assert isinstance(clone.cause, OSError)  # type: ignore[attr-defined]
        assert str(clone.cause) == str(error.cause)  # type: ignore[attr-defined]
    copied = copy.deepcopy(error)
    assert (type(copied), str(copied), copied.path, copied.step, copied.rank) == (
        cls,
        str(error),
        "/ckpt/step_3",
        3,
        1,
    )


def test_fields_default_to_none_and_empty() -> None:
    error = CheckpointError("m")
    assert (error.path, error.step, error.rank) == (None, None, None)
    assert SaveFailedError("m").failures == {} and SaveFailedError("m").cause is None
    assert RankAgreementError("m").failures == {}
    clone = pickle.loads(pickle.dumps(SaveFailedError("m")))
    assert clone.failures == {} and clone.cause is None


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("the disk went away")
        self.handle = threading.Lock()


def test_a_save_failure_pickles_even_when_its_cause_does_not() -> None:
    # Errors cross process boundaries (gathered from every rank); an unpicklable cause must not
    # turn a SaveFailedError into a bare message.
    error = SaveFailedError("save of step 3 failed", step=3, cause=_Unpicklable(), failures={0: "x"})
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is SaveFailedError
    assert (clone.step, clone.failures) == (3, {0: "x"})
    assert clone.cause is not None and "the disk went away" in str(clone.cause)
    assert "_Unpicklable" in str(clone.cause)
    assert isinstance(error.cause, _Unpicklable), "pickling must not change the original"


def test_an_error_pickles_after_fields_change() -> None:
    error = IncompleteCheckpointError("m", path="/a")
    error.rank = 5  # the agreement sets the failing rank after the fact
    error.add_note("while restoring")
    clone = pickle.loads(pickle.dumps(error))
    assert clone.rank == 5 and clone.__notes__ == ["while restoring"]


def test_oserror_mixins_keep_their_message() -> None:
    error = CheckpointNotFoundError("there is no checkpoint at /x.", path="/x", step=None)
    assert str(error) == "there is no checkpoint at /x."
    clone = pickle.loads(pickle.dumps(error))
    assert str(clone) == "there is no checkpoint at /x." and clone.path == "/x"
    assert isinstance(clone, FileNotFoundError)
