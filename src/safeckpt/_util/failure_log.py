"""One log line per kind of failure of a background thread, not a traceback per try.

A thread that retries (a heartbeat, a deleter, an uploader) while the storage is
down would otherwise write the same warning every second. :class:`FailureLog`
says the first failure of each kind at WARNING, the repeats at DEBUG, and once
the kind stops failing, that it recovered.
"""

from __future__ import annotations

import logging
import threading


class FailureLog:
    """What one background thread has said about its failures (thread-safe)."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self._what = what  # "the deleter of s3://b/run"
        self._failing: dict[str, int] = {}  # kind -> failures since it last worked
        self._guard = threading.Lock()

    def failed(self, kind: str, message: str, *args: object) -> None:
        """A failure of ``kind``: WARNING the first time since it last worked, DEBUG after."""
        with self._guard:
            count = self._failing.get(kind, 0)
            self._failing[kind] = count + 1
        level = logging.WARNING if count == 0 else logging.DEBUG
        self._logger.log(level, "safeckpt: %s: " + message, self._what, *args)

    def worked(self, kind: str | None = None) -> None:
        """``kind`` (None: every kind) worked again: say so once, if it had failed."""
        with self._guard:
            if kind is None:
                count = sum(self._failing.values())
                self._failing.clear()
            else:
                count = self._failing.pop(kind, 0)
        if count:
            self._logger.info("safeckpt: %s: works again (after %d failure(s))", self._what, count)

    def failing(self, kind: str) -> bool:
        with self._guard:
            return kind in self._failing
