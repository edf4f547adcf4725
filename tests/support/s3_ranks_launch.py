"""Two ranks of a scenario of :mod:`s3_dist_worker`, as processes of their own, and their reports."""

from __future__ import annotations

import json
import multiprocessing
import socket
from pathlib import Path
from typing import Any

import s3_dist_worker


def launch(scenario: str, url: str, results: Path, **kwargs: Any) -> list[dict[str, Any]]:
    results.mkdir(parents=True, exist_ok=True)
    for old in results.glob("rank*.json"):
        old.unlink()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=s3_dist_worker.main, args=(scenario, rank, 2, port, url, str(results), kwargs))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
        if proc.is_alive():
            proc.kill()
    reports = [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report["ok"], f"rank {rank}: {report.get('traceback')}"
    return [r["result"] for r in reports]
