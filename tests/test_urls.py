"""A URL is never a local directory (``safeckpt._store.registry``, issue 52 item 5).

``file://`` URLs name the local path they hold; anything else that starts like a URL and is not a
well-formed one is a ``ConfigError`` with the likely spelling, and nothing is created for it.
Local paths with a colon further on stay local paths.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import safeckpt
from safeckpt import CheckpointManager
from safeckpt._s3.location import parse_url
from safeckpt._store.loc import as_loc
from safeckpt._store.registry import LOCAL, local_path, scheme_of
from safeckpt.cli import main
from safeckpt.errors import ConfigError


@pytest.fixture
def cwd(tmp_path: Path) -> Iterator[Path]:
    """A working directory of this test's own, so that a relative root created by mistake is seen."""
    before = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(before)


def _everything_under(top: Path) -> list[str]:
    return sorted(str(p.relative_to(top)) for p in top.rglob("*"))


@pytest.mark.parametrize(
    ("root", "said"),
    [
        pytest.param("s3:/train/x", "did you mean 's3://train/x'?", id="s3-one-slash"),
        pytest.param("s3:train/x", "did you mean 's3://train/x'?", id="s3-no-slash"),
        pytest.param("S3:/train/x", "did you mean 's3://train/x'?", id="s3-upper-one-slash"),
        pytest.param("gs:/bucket/x", "did you mean 'gs://bucket/x'?", id="gs-one-slash"),
        pytest.param("az:container/x", "did you mean 'az://container/x'?", id="az-no-slash"),
        pytest.param("https:cache", "did you mean 'https://cache'?", id="https-no-slash"),
        pytest.param("file:/tmp/y", "did you mean 'file:///tmp/y'?", id="file-one-slash"),
        pytest.param("file:runs/y", "a file: URL names an absolute path", id="file-relative"),
        pytest.param("file://otherhost/tmp/y", "names the host 'otherhost'", id="file-other-host"),
        pytest.param("file://", "names no path", id="file-empty"),
        pytest.param(
            "S3://train/x",
            "the URL scheme 'S3://' is written in lowercase: did you mean 's3://train/x'?",
            id="s3-upper",
        ),
        pytest.param("FILE:///tmp/y", "did you mean 'file:///tmp/y'?", id="file-upper"),
        pytest.param("http://host/x", "no storage for http:// roots", id="http-unserved"),
    ],
)
def test_a_mistyped_or_unserved_url_is_a_config_error_and_creates_nothing(
    cwd: Path, root: str, said: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(said)):
        CheckpointManager(root, async_save=False)
    with pytest.raises(ConfigError, match=re.escape(said)):
        safeckpt.load(root)
    assert _everything_under(cwd) == []  # nothing like ./s3:/train/x


def test_the_message_names_the_spelling_to_use_and_how_to_mean_a_directory(cwd: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        CheckpointManager("s3:/train/x")
    message = str(caught.value)
    assert "'s3:/train/x' starts with the URL scheme 's3:' but is not a URL" in message
    assert "write './s3:/train/x'" in message  # the way to mean a local directory of that name
    # A pathlib.Path merges the '//' of a URL: said so.
    with pytest.raises(ConfigError, match=re.escape("pathlib.Path merges a URL's '//'")):
        CheckpointManager(Path("s3://train/x"))
    assert _everything_under(cwd) == []


def test_an_uppercase_scheme_is_blamed_not_the_bucket() -> None:
    for url in ("S3://train/x", "S3://ckpts"):
        with pytest.raises(ConfigError) as caught:
            CheckpointManager(url)
        assert "scheme" in str(caught.value) and "bucket" not in str(caught.value)
    # The S3 store's own parser says the same when reached directly.
    with pytest.raises(ConfigError, match="'S3://' is written in lowercase") as caught:
        parse_url("S3://train/x")
    assert "bucket" not in str(caught.value)
    # A bad bucket name is blamed on the bucket, by name.
    with pytest.raises(
        ConfigError, match=re.escape("'Train' is not an S3 bucket name (bucket names have no upper")
    ):
        parse_url("s3://Train/x")


@pytest.mark.parametrize(
    "form", ["file://{path}", "file://localhost{path}"], ids=["file-3-slashes", "localhost"]
)
def test_a_file_url_is_the_local_path_it_names(cwd: Path, form: str) -> None:
    target = cwd / "runs" / "y"
    url = form.format(path=target)
    with CheckpointManager(url, async_save=False) as mgr:
        assert mgr.root == target
        mgr.save(1, {"w": torch.arange(3.0)})
    assert (target / "step_1" / "metadata.json").is_file()
    assert not (cwd / "file:").exists()  # not ./file:/...
    assert torch.equal(safeckpt.load(url)["w"], torch.arange(3.0))
    assert torch.equal(safeckpt.load(url + "/step_1")["w"], torch.arange(3.0))
    assert as_loc(url + "/step_1").where == target / "step_1"
    assert main(["ls", url]) == 0


@pytest.mark.parametrize(
    "path",
    ["runs/exp:1", "exp:1/run", "ckpt:v2", "c:/x", "./s3:/train/x", "run-s3:x"],
)
def test_a_local_path_with_a_colon_stays_a_local_path(cwd: Path, path: str) -> None:
    # Only the schemes storage URLs are written with ("s3", "gs", "file", "http", ...) make a
    # path a mistyped URL; "exp:1" is a directory name like any other.
    assert scheme_of(path) == LOCAL and local_path(path) == path
    with CheckpointManager(path, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    assert (cwd / path / "step_1" / "metadata.json").is_file()


def test_a_lightning_path_follows_the_same_rules(cwd: Path) -> None:
    pytest.importorskip("lightning")
    from safeckpt.lightning import SafeCheckpointIO

    io = SafeCheckpointIO(async_save=False)
    io.save_checkpoint({"a": 1}, f"file://localhost{cwd}/ckpts/x.ckpt")
    assert torch.load(cwd / "ckpts" / "x.ckpt", weights_only=True) == {"a": 1}
    with pytest.raises(ConfigError, match=re.escape("did you mean 's3://b-1/x.ckpt'")):
        io.save_checkpoint({"a": 1}, "s3:/b-1/x.ckpt")
    io.teardown()
    assert _everything_under(cwd) == ["ckpts", "ckpts/x.ckpt"]  # no ./s3:/b-1


def test_local_dir_takes_a_file_url_and_refuses_a_mistyped_one(cwd: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 's3://b/x'"):
        CheckpointManager(cwd / "root", local_dir="s3:/b/x")
    with CheckpointManager(cwd / "root", local_dir=f"file://{cwd}/fast", async_save=False) as mgr:
        assert mgr.local_dir == cwd / "fast"
