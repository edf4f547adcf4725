"""Hold files open from another process: what makes an NFS client keep ``.nfs`` files.

A :class:`FileHolder` is a small helper process (this file run as a script, so it
starts without importing torch) that opens files when told, and closes them
after a while or when released:

    with FileHolder() as holder:
        hold = holder.hold(paths, seconds=0.2)  # returns once every file is open
        ...
        hold.release()                          # returns once every file is closed

``hold_open(paths, seconds)`` does the same with a helper process of its own.
Closing a file on FUSE only queues its ``release``: the filesystem may see the
close a moment after ``release()`` returns, as an NFS server may.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterable
from types import TracebackType
from typing import Any


class Hold:
    """Files one :meth:`FileHolder.hold` opened. ``release()`` is idempotent."""

    def __init__(self, holder: FileHolder, hold_id: int, paths: list[str], owns_holder: bool) -> None:
        self.holder = holder
        self.id = hold_id
        self.paths = paths
        self._owns_holder = owns_holder

    def release(self) -> None:
        """Close the files now (if the timer has not already)."""
        if self.holder.running:
            self.holder.release(self.id)
        if self._owns_holder:
            self.holder.close()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.release()


class FileHolder:
    """A helper process that holds files open. Call rules: from one thread at a time."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._next = 0

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    @property
    def pid(self) -> int:
        return self._process.pid

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"the file holder process exited (status {self._process.poll()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise OSError(reply.get("errno", 0), reply["error"], reply.get("path"))
        return reply

    def hold(
        self, paths: Iterable[str | os.PathLike[str]], seconds: float | None = None, *, _owns: bool = False
    ) -> Hold:
        """Open every file in ``paths`` (read-only) and keep it open for ``seconds`` (None: until
        released). Returns once all are open; raises ``OSError`` (and opens none) if one cannot be."""
        self._next += 1
        names = [os.fspath(p) for p in paths]
        self._request({"op": "hold", "id": self._next, "paths": names, "seconds": seconds})
        return Hold(self, self._next, names, _owns)

    def release(self, hold_id: int) -> None:
        """Close the files of hold ``hold_id``; returns once they are closed."""
        self._request({"op": "release", "id": hold_id})

    def close(self) -> None:
        """Close every file and end the process. Idempotent."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            with contextlib.suppress(OSError):
                self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=10)
        if self._process.stdout is not None:
            self._process.stdout.close()

    def __enter__(self) -> FileHolder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def hold_open(paths: Iterable[str | os.PathLike[str]], seconds: float | None = None) -> Hold:
    """Hold ``paths`` open from a new process for ``seconds`` (None: until ``release()``).

    The returned :class:`Hold` ends its process on ``release()`` (also as a context manager).
    """
    holder = FileHolder()
    try:
        return holder.hold(paths, seconds, _owns=True)
    except BaseException:
        holder.close()
        raise


# --- the helper process ------------------------------------------------------------


def _serve() -> None:
    """Answer hold/release requests on stdin; close everything at its end."""
    guard = threading.Lock()
    held: dict[int, list[int]] = {}

    def close(hold_id: int) -> None:
        with guard:
            fds = held.pop(hold_id, [])
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    for line in sys.stdin:
        request = json.loads(line)
        reply: dict[str, Any] = {"ok": True}
        if request["op"] == "hold":
            fds: list[int] = []
            try:
                for path in request["paths"]:
                    fds.append(os.open(path, os.O_RDONLY))
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                reply = {"error": e.strerror or str(e), "errno": e.errno, "path": e.filename}
            else:
                with guard:
                    held[request["id"]] = fds
                if request.get("seconds") is not None:
                    timer = threading.Timer(request["seconds"], close, args=(request["id"],))
                    timer.daemon = True
                    timer.start()
        elif request["op"] == "release":
            close(request["id"])
        else:
            reply = {"error": f"unknown op {request['op']!r}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    for hold_id in list(held):
        close(hold_id)


if __name__ == "__main__":
    _serve()
