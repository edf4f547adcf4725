"""SafeCheckpointIO on ``gs://`` and ``az://`` paths, against the emulators (a sample: the plugin's
whole behaviour on URLs is tested on ``s3://`` in test_lightning_s3.py, and every store runs the
same object-root store)."""

from __future__ import annotations

import pytest
import torch

import safeckpt

pytest.importorskip("lightning")

from safeckpt.lightning import SafeCheckpointIO

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_save_load_and_remove_on_a_url(store: str, request: pytest.FixtureRequest) -> None:
    place = request.getfixturevalue("gcs_bucket" if store == "gcs" else "azure_container")
    io = SafeCheckpointIO(async_save=True)
    path = place.url("ckpts/epoch=0.ckpt")
    checkpoint = {"state_dict": {"w": torch.arange(6.0)}, "epoch": 0}
    io.save_checkpoint(checkpoint, path)
    loaded = io.load_checkpoint(path)  # waits for its own save of the path
    assert torch.equal(loaded["state_dict"]["w"], checkpoint["state_dict"]["w"]) and loaded["epoch"] == 0
    io.remove_checkpoint(path)
    io.teardown()
    with pytest.raises(safeckpt.CheckpointError):  # removed: gone, said so
        io.load_checkpoint(path)
