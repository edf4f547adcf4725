"""Requests to a remote service that end within a deadline, and a service that went away
answered at once.

Retrying each request on its own, with a count of attempts and growing pauses,
makes an outage cost minutes per request, and a public call makes many. So:

* each request retries what is worth retrying until its attempts or its
  deadline run out, whichever comes first (a service that has never answered in
  this process gets a short deadline: a closed port at open is a mistake to
  report, not a blip to wait out);
* a request that gives up because nothing answered marks the service *down*
  (one that gave up on a service that kept answering 5xx or throttling does
  not: that service answers, fast, and each request keeps its own deadline);
  while it is down, requests fail at once, except one *probe* every few seconds
  (a cheap request with short timeouts, so a black-holed service costs a call
  seconds, not a read timeout); the first answer marks it up again.

So a public call ends within about one deadline after the service went away,
however many requests it makes, and background threads that keep trying notice
within seconds when it is back.
"""

from __future__ import annotations

import enum
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

OPEN_DEADLINE = 5.0
"""The deadline of a request to a service that has not answered this process yet."""
PROBE_EVERY = 2.0


class Admission(enum.Enum):
    GO = "go"
    PROBE = "probe"  # down: this one request tries, once
    REFUSE = "refuse"  # down, and a probe went out moments ago


class Reachability:
    """Whether one service answers, as every request to it has found (thread-safe)."""

    def __init__(self, *, probe_every: float = PROBE_EVERY) -> None:
        self._guard = threading.Lock()
        self._probe_every = probe_every
        self.answered_once = False
        self.down_since: float | None = None  # monotonic
        self._last_probe = 0.0

    def admit(self) -> Admission:
        with self._guard:
            if self.down_since is None:
                return Admission.GO
            now = time.monotonic()
            if now - self._last_probe >= self._probe_every:
                self._last_probe = now
                return Admission.PROBE
            return Admission.REFUSE

    def answered(self) -> None:
        with self._guard:
            self.answered_once = True
            self.down_since = None

    def gave_up(self) -> None:
        with self._guard:
            if self.down_since is None:
                self.down_since = time.monotonic()
                self._last_probe = self.down_since

    def down_for(self) -> float | None:
        with self._guard:
            return None if self.down_since is None else time.monotonic() - self.down_since


class Outcome(enum.Enum):
    ANSWERED = "answered"  # the service answered with a refusal retrying will not change
    DONE = "done"  # no retry: a failure on this side, not the service's
    RETRY = "retry"  # the service answered, busy or failing: worth another try
    SILENT = "silent"  # nothing answered (refused, reset, timed out): worth another try


def call_with_deadline(
    attempt: Callable[[], T],
    classify: Callable[[BaseException], Outcome],
    reach: Reachability,
    *,
    attempts: int,
    deadline: float,
    unreachable: Callable[[BaseException, float], BaseException],
    probe: Callable[[], object] | None = None,
) -> T:
    """``attempt()`` until it succeeds, fails for good, or runs out of ``attempts`` or of
    ``deadline`` seconds (see the module doc). ``classify`` says what a failure was;
    ``unreachable(last error, seconds down)`` is what a request raises while the service is
    down. A request that ran out of tries while nothing answered (SILENT) marks it down; one
    that ran out while the service kept failing (RETRY: 5xx, throttling) does not (it answers,
    and each request has its own deadline), but either raises ``unreachable``: not available
    now, which the caller must never take for a refusal or for damage.

    ``probe``: a cheap request with short timeouts, made first while the service is down: an
    answer (any) marks it up and the request goes ahead as usual; no answer fails the request at
    once. Without one, the request itself is the probe, tried once."""
    admission = reach.admit()
    if admission is Admission.REFUSE:
        raise unreachable(ConnectionError("not tried: the service is down"), reach.down_for() or 0.0)
    if admission is Admission.PROBE:
        if probe is None:
            attempts = 1
        else:
            try:
                probe()
            except BaseException as e:
                if classify(e) is Outcome.SILENT:
                    raise unreachable(e, reach.down_for() or 0.0) from e
            reach.answered()
    if not reach.answered_once:
        deadline = min(deadline, OPEN_DEADLINE)
    ends = time.monotonic() + deadline
    pause = 0.1
    tried = 0
    while True:
        tried += 1
        try:
            result = attempt()
        except BaseException as e:
            outcome = classify(e)
            if outcome in (Outcome.RETRY, Outcome.ANSWERED):
                reach.answered()
            wait = pause * (0.5 + random.random())
            final = outcome in (Outcome.DONE, Outcome.ANSWERED) or tried >= attempts
            if final or time.monotonic() + wait >= ends:
                if outcome is Outcome.SILENT:
                    reach.gave_up()
                if outcome in (Outcome.SILENT, Outcome.RETRY):  # not available now: never damage
                    raise unreachable(e, reach.down_for() or 0.0) from e
                raise
            time.sleep(wait)
            pause = min(pause * 2, 2.0)
            continue
        reach.answered()
        return result
