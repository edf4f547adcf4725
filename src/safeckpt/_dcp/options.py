"""How a manager reads and writes a checkpoint's bytes: verification, direct I/O, and whose
writer and reader (``CheckpointManager(verify=, direct_io=, dcp_io=)``).

A manager sets its options for the calls it makes (:func:`using`, a context
variable: per call, per thread, never process-wide); the I/O code reads
:func:`current` in the calling thread and hands plain values to the threads it
starts. Outside a manager (``safeckpt.load``, ``safeckpt export``) the defaults
apply. The environment variables ``SAFECKPT_VERIFY=0``, ``SAFECKPT_DIRECT_IO=0``
and ``SAFECKPT_DCP_IO=torch`` change those defaults for the whole process, and
each logs a WARNING once when it does.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from ..errors import ConfigError

logger = logging.getLogger(__name__)

RAW = "raw"
TORCH = "torch"
DCP_IO = (RAW, TORCH)


@dataclass(frozen=True, kw_only=True)
class IOOptions:
    verify: bool = True
    """Every byte loaded is checked against the CRC32 written with it (``safeckpt verify`` always checks)."""
    direct_io: bool = True
    """Large files are written and read with ``O_DIRECT`` where the filesystem takes it (same bytes)."""
    dcp_io: str = RAW
    """``"raw"``: safeckpt's writer and reader; ``"torch"``: DCP's own (same files, slower)."""

    def __post_init__(self) -> None:
        if not isinstance(self.verify, bool) or not isinstance(self.direct_io, bool):
            raise ConfigError(
                f"verify= and direct_io= take True or False, got {self.verify!r}, {self.direct_io!r}."
            )
        if self.dcp_io not in DCP_IO:
            raise ConfigError(f"dcp_io={self.dcp_io!r}: choose one of {', '.join(map(repr, DCP_IO))}.")


_OFF = ("0", "false", "no", "off")
_warned: set[str] = set()


def _env_says(name: str, default: str, changed: str) -> str:
    value = os.environ.get(name, default).strip().lower()
    if value != default and name not in _warned:
        _warned.add(name)
        logger.warning(
            "safeckpt: %s=%s in the environment: %s for every manager of this process", name, value, changed
        )
    return value


def defaults() -> IOOptions:
    """The options a manager gets for those it is not given: the environment's, else the defaults."""
    verify = _env_says("SAFECKPT_VERIFY", "1", "checksums are NOT verified on load") not in _OFF
    direct = _env_says("SAFECKPT_DIRECT_IO", "1", "O_DIRECT is off") not in _OFF
    dcp_io = _env_says("SAFECKPT_DCP_IO", RAW, "DCP's own writer and reader are used")
    return IOOptions(verify=verify, direct_io=direct, dcp_io=TORCH if dcp_io == TORCH else RAW)


def resolve(*, verify: bool | None, direct_io: bool | None, dcp_io: str | None) -> IOOptions:
    """A manager's options: what it was given, the rest from :func:`defaults`."""
    base = defaults()
    return IOOptions(
        verify=base.verify if verify is None else verify,
        direct_io=base.direct_io if direct_io is None else direct_io,
        dcp_io=base.dcp_io if dcp_io is None else dcp_io,
    )


_current: ContextVar[IOOptions | None] = ContextVar("safeckpt_io_options", default=None)


def current() -> IOOptions:
    """The options of the call this thread is in, or :func:`defaults`."""
    options = _current.get()
    return defaults() if options is None else options


@contextlib.contextmanager
def using(options: IOOptions) -> Iterator[None]:
    """Run the block with ``options`` (this thread and this context only)."""
    token = _current.set(options)
    try:
        yield
    finally:
        _current.reset(token)
