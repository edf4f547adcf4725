"""The peers' async saves, shared by the scripts that compare against them (not a test).

``dcp.async_save`` with one reused ``DefaultStager`` and Lightning's
``AsyncCheckpointIO`` (plus the fsync it lacks), each over a state given by a
function called before every save, writing to fresh paths of a ``Scratch``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from bench_common import fsync_path
from bench_limits import Scratch


class AsyncRunner(Protocol):
    def run(self) -> tuple[float, float]:
        """One save: (seconds until the call returned, seconds until durable)."""
        ...

    def close(self) -> None: ...


class DcpAsync:
    """``dcp.async_save`` staging through one reused ``DefaultStager`` (it caches host storages).

    Pinned and shared memory are off: pinning needs an accelerator, and on one
    they would make the copy faster for safeckpt too.
    """

    def __init__(self, scratch: Scratch, state: Callable[[], Any], directory: str = "dcp-async") -> None:
        self.scratch, self.state, self.directory = scratch, state, directory
        self.writer = FileSystemWriter(scratch.fresh(directory))
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self.current: Path | None = None

    def start(self) -> Any:
        """Stage and start the upload; the future of the upload (pass it to :meth:`finish`)."""
        self.current = self.scratch.fresh(self.directory)
        response: Any = dcp.async_save(
            self.state(),
            checkpoint_id=self.current,
            storage_writer=self.writer,
            async_stager=self.stager,
            no_dist=True,
        )
        return getattr(response, "upload_completion", response)

    def finish(self, future: Any) -> None:
        """Wait for the upload; the checkpoint is deleted at the next purge (outside any timing)."""
        future.result()
        self.scratch.discard(self.current)

    def run(self) -> tuple[float, float]:
        start = time.perf_counter()
        future = self.start()
        returned = time.perf_counter()
        future.result()
        durable = time.perf_counter() - start
        self.finish(future)
        return returned - start, durable

    def close(self) -> None:
        self.stager.close()


class LightningAsync:
    """Lightning's ``AsyncCheckpointIO`` around ``TorchCheckpointIO`` (plus an fsync it lacks).

    ``state`` gives a checkpoint dict as Lightning builds one: state dicts, no ``Stateful``.
    """

    def __init__(self, scratch: Scratch, state: Callable[[], Any]) -> None:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        class FsyncTorchCheckpointIO(TorchCheckpointIO):
            def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, options: Any = None) -> None:
                super().save_checkpoint(checkpoint, path, options)
                fsync_path(Path(path))

        self.scratch, self.state = scratch, state
        self.io = AsyncCheckpointIO(FsyncTorchCheckpointIO())

    def run(self) -> tuple[float, float]:
        path = self.scratch.fresh("lightning.ckpt")  # torch.save over an existing file would truncate it
        checkpoint = self.state()
        start = time.perf_counter()
        self.io.save_checkpoint(checkpoint, path)
        returned = time.perf_counter()
        self.io.teardown()  # waits for the write (the only public way to)
        done = time.perf_counter() - start
        self.scratch.discard(path)
        return returned - start, done

    def close(self) -> None:
        self.io.teardown()


def lightning_available() -> bool:
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:
        return False
    return True
