"""The model of NFS behaviour the filesystem of :mod:`nfsfs` serves: its configuration
(:class:`NFSConfig`, :class:`Linger`) and the silly-renamed files that linger after their last close
(:class:`SillyFiles`). Standard library only: it runs inside the FUSE process, which imports no torch.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger("safeckpt.testing.nfsfs")

HIDDEN_PREFIX = ".fuse_hidden"
SILLY_PREFIX = ".nfs"


@dataclass(frozen=True)
class Linger:
    """How long a ``.nfs`` file stays after its last close, drawn per file.

    Each file draws ``slow`` with probability ``slow_prob``, else a delay
    uniform in ``[fast_min, fast_max]``. The draws come from ``random.Random(seed)``
    in the order files are closed, so a run is reproducible.
    """

    seed: int = 0
    fast_min: float = 0.0
    fast_max: float = 0.0
    slow_prob: float = 0.0
    slow: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fast_min <= self.fast_max:
            raise ValueError(f"Linger: need 0 <= fast_min <= fast_max, got {self.fast_min}, {self.fast_max}")
        if not 0.0 <= self.slow_prob <= 1.0:
            raise ValueError(f"Linger: slow_prob={self.slow_prob} must be within [0, 1]")
        if self.slow < 0.0:
            raise ValueError(f"Linger: slow={self.slow} must not be negative")

    @classmethod
    def constant(cls, seconds: float) -> Linger:
        """Every ``.nfs`` file stays exactly ``seconds``."""
        return cls(fast_min=seconds, fast_max=seconds)

    @classmethod
    def field_like(cls, seed: int = 0) -> Linger:
        """Like the Isilon server of the NFS review: most within 0.38 s, 1 in 300 for 4.0 s."""
        return cls(seed=seed, fast_max=0.38, slow_prob=1 / 300, slow=4.0)

    def draws(self) -> Iterator[float]:
        """The delays, file after file (an endless, deterministic stream)."""
        rng = random.Random(self.seed)
        while True:
            slow = rng.random() < self.slow_prob  # two draws per file keep the streams aligned
            fast = rng.uniform(self.fast_min, self.fast_max)
            yield self.slow if slow else fast

    def sample(self, n: int) -> list[float]:
        """The first ``n`` delays."""
        stream = self.draws()
        return [next(stream) for _ in range(n)]


@dataclass(frozen=True)
class NFSConfig:
    """Everything the filesystem can be told, at mount time or later (``NFSMount.configure``)."""

    linger: Linger = field(default_factory=Linger)
    """Delay between the last close of a ``.nfs`` file and its disappearance."""
    ebusy_rmdir_next: int = 0
    """The next this many ``rmdir`` calls fail with EBUSY."""
    ebusy_rmdir_prob: float = 0.0
    """After those, each ``rmdir`` fails with EBUSY with this probability."""
    seed: int = 0
    """Seeds the EBUSY draws."""

    def __post_init__(self) -> None:
        if self.ebusy_rmdir_next < 0:
            raise ValueError(f"NFSConfig: ebusy_rmdir_next={self.ebusy_rmdir_next} must not be negative")
        if not 0.0 <= self.ebusy_rmdir_prob <= 1.0:
            raise ValueError(f"NFSConfig: ebusy_rmdir_prob={self.ebusy_rmdir_prob} must be within [0, 1]")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NFSConfig:
        data = dict(data)
        if isinstance(data.get("linger"), dict):
            data["linger"] = Linger(**data["linger"])
        return cls(**data)

    def updated(self, changes: dict[str, Any]) -> NFSConfig:
        """A copy with ``changes`` (JSON field values) applied."""
        return NFSConfig.from_json({**self.to_json(), **changes})


def silly_name(hidden: str) -> str:
    """The ``.nfs`` name under which a libfuse ``.fuse_hidden`` file is stored."""
    return SILLY_PREFIX + "00000000" + hidden[len(HIDDEN_PREFIX) :]


class _Silly:
    """One ``.nfs`` file: where it is now, and whether it is still open."""

    __slots__ = ("path", "state")

    def __init__(self, path: str, state: str) -> None:
        self.path = path
        self.state = state


class SillyFiles:
    """The ``.nfs`` files of the mount: open ones, and closed ones lingering until their deadline.

    Keyed by backing path; a rename of a directory above one moves it. A reaper
    thread unlinks a lingering file at its deadline. Thread-safe.
    """

    OPEN = "open"
    LINGERING = "lingering"

    def __init__(self, linger: Linger) -> None:
        self._cond = threading.Condition()
        self._files: dict[str, _Silly] = {}
        self._due: list[tuple[float, int, _Silly]] = []
        self._seq = 0
        self._draws = linger.draws()
        self.renamed = 0
        self.reaped = 0
        self.lingers: list[float] = []
        threading.Thread(target=self._reap, name="nfs-reaper", daemon=True).start()

    def set_linger(self, linger: Linger) -> None:
        with self._cond:
            self._draws = linger.draws()

    def added(self, path: str) -> None:
        with self._cond:
            self._files[path] = _Silly(path, self.OPEN)
            self.renamed += 1

    def state(self, path: str) -> str | None:
        with self._cond:
            silly = self._files.get(path)
            return silly.state if silly else None

    def closed(self, path: str) -> None:
        """The last close of ``path`` happened: it goes after its linger."""
        with self._cond:
            delay = next(self._draws)
            self.lingers.append(delay)
            silly = self._files.get(path) or _Silly(path, self.OPEN)
            if delay <= 0:
                self._unlink(silly)
                return
            silly.state = self.LINGERING
            self._files[path] = silly
            self._seq += 1
            heapq.heappush(self._due, (time.monotonic() + delay, self._seq, silly))
            self._cond.notify_all()

    def moved(self, old: str, new: str) -> None:
        """``old`` (a file, or a directory above tracked files) was renamed to ``new``."""
        with self._cond:
            for path in [p for p in self._files if p == old or p.startswith(old + "/")]:
                silly = self._files.pop(path)
                silly.path = new + path[len(old) :]
                self._files[silly.path] = silly

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no ``.nfs`` file is left (open or lingering); whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._files, timeout=timeout)

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            states = [s.state for s in self._files.values()]
            return {
                "silly_renames": self.renamed,
                "open": states.count(self.OPEN),
                "lingering": states.count(self.LINGERING),
                "reaped": self.reaped,
                "lingers": list(self.lingers),
                "silly_paths": sorted(self._files),
            }

    def reap_all(self) -> None:
        """Unlink every lingering file now (at unmount)."""
        with self._cond:
            for _deadline, _seq, silly in self._due:
                self._unlink(silly)
            self._due.clear()

    def _unlink(self, silly: _Silly) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(silly.path)
        if self._files.get(silly.path) is silly:
            del self._files[silly.path]
        self.reaped += 1
        self._cond.notify_all()

    def _reap(self) -> None:
        with self._cond:
            while True:
                if not self._due:
                    self._cond.wait()
                    continue
                deadline, _seq, silly = self._due[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(timeout=left)
                    continue
                heapq.heappop(self._due)
                self._unlink(silly)
