"""Preemption signals: handlers that only record that a signal came.

A scheduler that takes the machine away (SLURM's ``--signal=USR1@90``, a
Kubernetes eviction, torchrun passing on SIGTERM) sends a signal and, some
seconds later, SIGKILL. The handler installed here does no I/O, takes no lock
and raises nothing: it stores the signal number, then calls the handler that
was there before if that one was a Python function (not the default action, not
``SIG_IGN``, not Python's default SIGINT handler, which would raise
``KeyboardInterrupt`` in the middle of the save the signal asked for). The
training loop learns of it through ``mgr.should_save(step)``, saves as usual and
stops; a second signal during that save only sets the flag again.

Call rules: :meth:`PreemptionHandlers.install` and :meth:`restore` from the main
thread (Python allows signal handlers nowhere else). Where ours cannot be taken
out at ``restore()`` (another handler was installed after it, or ``close()`` ran
in another thread), it stays and from then on does what the handler before it
did: a closed manager never swallows a SIGTERM.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConfigError

logger = logging.getLogger(__name__)

_Handler = Callable[[int, Any], Any]


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15; the number for an unknown one."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


class PreemptionHandlers:
    """Handlers for ``signals`` that record the newest one received, until restored."""

    def __init__(self, signals: Sequence[int]) -> None:
        # once each: a second install would chain our handler to itself
        self.signals: tuple[signal.Signals, ...] = tuple(dict.fromkeys(_as_signal(s) for s in signals))
        if self.signals and threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "preemption_signals=... installs signal handlers, which Python allows only in the "
                "main thread: create the CheckpointManager there, or pass preemption_signals=()."
            )
        self._previous: dict[int, Any] = {}
        self._retired: set[int] = set()  # closed, but ours could not be taken out: act as the previous
        # Written only by the handler (which runs on the main thread, between bytecodes) and
        # by take(); an int store is atomic, so no lock (a lock here could deadlock the handler).
        self._received: int | None = None

    def install(self) -> None:
        """Install the handlers, remembering the previous ones. Main thread only."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
            # Restart system calls the signal interrupts (in gloo, DCP's file I/O or any other
            # thread) instead of failing them with EINTR: the handler only sets a flag.
            signal.siginterrupt(sig, False)

    def _handle(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum)
        if signum in self._retired:
            _act_as(previous, signum, frame)
            return
        self._received = signum
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def take(self) -> int | None:
        """The signal received since the last call (None if none), and forget it."""
        received, self._received = self._received, None
        return received

    def restore(self) -> None:
        """Put the previous handlers back (where ours is still the one installed). Idempotent."""
        if not set(self._previous) - self._retired:
            return
        if threading.current_thread() is not threading.main_thread():
            self._retired.update(self._previous)
            logger.warning(
                "safeckpt: close() ran outside the main thread, where Python cannot change signal "
                "handlers; the handlers for %s stay installed and act as the previous ones",
                ", ".join(signal_name(s) for s in self._previous),
            )
            return
        for sig, previous in list(self._previous.items()):
            if sig in self._retired:
                continue
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
                del self._previous[sig]
            else:
                # Someone installed a handler after ours and may chain to it: theirs stays, and
                # ours from now on does what the handler before it did (SIGTERM kills again).
                self._retired.add(sig)


def _act_as(previous: Any, signum: int, frame: Any) -> None:
    """What ``previous`` (a handler ``signal.signal`` returned) does with ``signum``."""
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default action (terminate, for the usual signals)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def _as_signal(value: Any) -> signal.Signals:
    try:
        sig = signal.Signals(value)
    except (ValueError, TypeError):
        raise ConfigError(
            f"preemption_signals: {value!r} is not a signal; pass signal.SIGTERM, signal.SIGUSR1, ..."
        ) from None
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError(f"preemption_signals: {sig.name} cannot be caught, so it announces nothing.")
    return sig
