"""Shared fixtures. Suites that must also run on the NFS-semantics filesystem
take the ``root_dir`` fixture, which is parametrised over the filesystems."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest_plugins = ["fs_fixtures", "mlflow_server", "os_fixtures", "s3_proxy", "s3_server"]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A fresh checkpoint root on local disk (not created yet)."""
    return tmp_path / "ckpt"


@pytest.fixture(autouse=True)
def _safeckpt_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="safeckpt")
