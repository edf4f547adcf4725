"""``import safeckpt`` with private torch symbols missing, then a small save and restore (one process).

argv[1]: a JSON list of cases, each ``[name, [[module, attribute path], ...]]``: what the door
(:mod:`safeckpt._util.torch_private`) finds missing in that case (an empty attribute path: the
whole module). Each case imports safeckpt afresh (torch stays imported), checks which fast paths
it reports off, and saves and restores a state that reaches every fallback it can in one
process: a model and its optimizer (staging, the DCP writer and reader), a DTensor on a one-rank
gloo mesh (its local tensor and its staging buffer), nested non-tensor values read through
``load_bytes`` (``set_element``), a second save of the same shapes (the plan cache), a weights
export and import, and a gloo group asked whether it is still registered. Prints one JSON line
per case: the fast paths it found off.
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

DOOR = "safeckpt._util.torch_private"
_real_import_module = importlib.import_module
_hidden: dict[str, set[tuple[str, ...]]] = {}  # module -> attribute paths missing (() for the module)


class _Without:
    """``target`` as the door sees it: without the attribute paths in ``paths``."""

    def __init__(self, target: Any, paths: set[tuple[str, ...]]) -> None:
        self._target, self._paths = target, paths

    def __getattr__(self, name: str) -> Any:
        if (name,) in self._paths:
            raise AttributeError(f"{name} (hidden by the test)")
        value = getattr(self._target, name)
        rest = {path[1:] for path in self._paths if len(path) > 1 and path[0] == name}
        return _Without(value, rest) if rest else value


def _import_module(name: str, package: str | None = None) -> Any:
    module = _real_import_module(name, package)
    if sys._getframe(1).f_globals.get("__name__") != DOOR or name not in _hidden:
        return module
    paths = _hidden[name]
    if () in paths:
        raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
    return _Without(module, paths)


importlib.import_module = _import_module


def fresh_safeckpt() -> Any:
    for name in [n for n in sys.modules if n == "safeckpt" or n.startswith("safeckpt.")]:
        del sys.modules[name]
    return _real_import_module("safeckpt")


def run_case(hidden: list[list[str]], mesh: Any, work: Path) -> dict[str, Any]:
    _hidden.clear()
    for module, path in hidden:
        _hidden.setdefault(module, set()).add(tuple(path.split(".")) if path else ())
    safeckpt = fresh_safeckpt()
    door = _real_import_module(DOOR)  # `import safeckpt` no longer imports it (its names are lazy)
    from safeckpt._dcp import io as dcp_io
    from safeckpt.export import export_weights, import_weights

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 6)).sum().backward()
    optim.step()
    sharded = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    state = {"model": model, "optim": optim, "sharded": {"w": sharded}, "extra": {"n": 3, "xs": [1.5, "a"]}}
    root = work / "ckpt"
    with safeckpt.CheckpointManager(root, async_save=True, retention=safeckpt.Retention(keep_last=2)) as mgr:
        mgr.save(1, state)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        mgr.save(2, state)  # the same shapes: the cached plan, where there is one
        mgr.wait()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_shard = sharded.to_local().clone()

    torch.manual_seed(1)
    model2 = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    target = {
        "model": model2,
        "optim": optim2,
        "sharded": {"w": distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])},
        "extra": {},
    }
    with safeckpt.CheckpointManager(root) as mgr:
        assert mgr.restore(target).step == 2
    assert all(torch.equal(saved[k], v) for k, v in model2.state_dict().items()), "weights differ"
    assert torch.equal(target["sharded"]["w"].to_local(), saved_shard), "the DTensor differs"
    assert target["extra"] == {"n": 3, "xs": [1.5, "a"]}
    assert json.dumps(optim2.state_dict()["param_groups"]) == json.dumps(optim.state_dict()["param_groups"])
    for a, b in zip(optim.state_dict()["state"].values(), optim2.state_dict()["state"].values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a), "optimizer state differs"

    plain = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load({"model": plain}, checkpoint_id=str(root / "step_2"))  # plain DCP reads what we wrote
    assert all(torch.equal(plain[k], saved[k]) for k in saved)

    # Non-tensor values in DCP's own files come back through load_bytes (set_element).
    foreign = work / "foreign"
    dcp.save({"a": {"b": [torch.ones(2), {"c": 7}], "d": "x"}}, checkpoint_id=str(foreign))
    back: dict[str, Any] = {"a": {"b": [torch.zeros(2), {"c": 0}], "d": ""}}
    dcp_io.load(back, foreign, None)
    assert back["a"]["d"] == "x" and back["a"]["b"][1] == {"c": 7}
    assert torch.equal(back["a"]["b"][0], torch.ones(2))

    export_weights(root, work / "exported", step=2)
    imported = work / "imported"
    import_weights(work / "exported", imported)  # the weights as a module (its children found by name)
    again = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))
    with safeckpt.CheckpointManager(imported) as mgr:
        assert mgr.restore({"model": again}).step == 0
    assert all(torch.equal(again.state_dict()[k], v) for k, v in saved.items()), "the import differs"

    group = dist.new_group([0])  # is a group still registered: asked before a manager shuts one down
    assert door.group_is_live(group)
    dist.destroy_process_group(group)
    assert not door.group_is_live(group)
    off = sorted(k for k, on in door.available().items() if not on)
    return {"off": off, "missing": sorted(door.missing())}


def main() -> None:
    cases = json.loads(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            for i, (name, hidden) in enumerate(cases):
                work = Path(tmp) / str(i)
                work.mkdir()
                result = run_case(hidden, mesh, work)
                print(json.dumps({"case": name, **result}), flush=True)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
