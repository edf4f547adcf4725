"""Shared fixtures. Suites that must also run on the NFS-semantics filesystem
take the ``root_dir`` fixture, which is parametrised over the filesystems."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

# What the tests use and start (servers, fixtures, faults, worker processes) is in tests/support,
# imported by module name; a worker run as a script finds the others beside it.
sys.path.insert(0, str(Path(__file__).parent / "support"))

pytest_plugins = [
    "azurite_server",
    "fs_fixtures",
    "gcs_server",
    "mlflow_server",
    "os_fixtures",
    "s3_proxy",
    "s3_server",
    "s3rver_server",
]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A fresh checkpoint root on local disk (not created yet)."""
    return tmp_path / "ckpt"


@pytest.fixture(autouse=True)
def _safeckpt_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="safeckpt")


# The files that take longest, started first: `make test` runs files on two processes
# (pytest-xdist, a file to a process), and one of these started last would leave the other
# process idle at the end.
_LONGEST_FIRST = (
    "test_tiers.py",
    "test_s3_ranks.py",
    "test_node_tiers.py",
    "test_demo.py",
    "test_lightning.py",
    "test_crash.py",
    "test_s3_crash.py",
    "test_edges.py",
    "test_distributed.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
