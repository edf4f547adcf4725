"""One rank of a safeckpt.hf run under torchrun (tests/test_hf_dist.py).

    torchrun --nproc-per-node N tests/support/hf_dist_worker.py MODE ROOT OUT [--steps S] [--stop-at K]

MODE ``trainer``: the Trainer under DDP (gloo), attached; ``accelerate``: a custom loop on
``Accelerator`` saving ``accelerator_state(accelerator)`` through a CheckpointManager every 2 steps.
``--stop-at K`` ends the run after step K without a save of its own, as a crash would. Rank 0
writes OUT (JSON): the step it resumed from, the final step, and the final weights' digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

import hf_toy


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trainer_run(options: argparse.Namespace) -> dict[str, Any]:
    from transformers import TrainerCallback

    import safeckpt
    import safeckpt.hf

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == options.stop_at:
                control.should_training_stop = True

    seen: dict[str, Any] = {}

    class Resumed(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
            seen["resumed"] = state.global_step
            if state.global_step:  # the weights the resume left: the saved ones
                saved = safeckpt.load(f"{options.root}/step_{state.global_step}")["model"]
                seen["restored_equal"] = hf_toy.same(saved, hf_toy.weights(trainer))

    extra: dict[str, Any] = {}
    if options.mode == "trainer-fsdp":
        extra = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}}
    trainer = hf_toy.trainer(
        options.out + ".run", max_steps=options.steps, per_device_train_batch_size=2, **extra
    )
    trainer.add_callback(StopAt())
    trainer.add_callback(Resumed())
    manager = safeckpt.hf.attach(trainer, options.root)
    trainer.train()
    manager.close()
    return {**seen, "step": trainer.state.global_step, "weights": digest(hf_toy.weights(trainer))}


class Counter:
    """An object registered with ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = int(state["seen"])


def accelerate_run(options: argparse.Namespace) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from transformers import get_linear_schedule_with_warmup

    from safeckpt import CheckpointManager
    from safeckpt.hf import accelerator_state, skip_batches

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0)
    model = hf_toy.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Accelerate steps a prepared scheduler once per process at each call
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, options.steps * accelerator.num_processes)
    loader = torch.utils.data.DataLoader(hf_toy.Tokens(32), batch_size=2, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    state = accelerator_state(accelerator)
    result: dict[str, Any] = {}
    with CheckpointManager(options.root) as manager:
        step = (restored := manager.restore(state)).step or 0
        result["resumed"] = step
        result["counter_at_resume"] = counter.seen
        per_epoch = len(loader)
        while step < options.steps:
            epoch, done_in_epoch = divmod(step, per_epoch)
            loader.set_epoch(epoch)
            # resumed mid-epoch: the skipped batches' indices only, and the RNG as saved
            batches = skip_batches(accelerator, loader, done_in_epoch) if done_in_epoch else loader
            for batch in batches:
                model.train()
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                step += 1
                counter.seen += 1
                if options.trace:
                    weights = dict(accelerator.unwrap_model(model).state_dict())
                    print("trace", step, digest(weights)[:12], flush=True)
                if step % 2 == 0:
                    manager.save(step, state)
                if step in (options.stop_at, options.steps):
                    break
            if step == options.stop_at:
                break
        del restored
    unwrapped = accelerator.unwrap_model(model)
    result.update(step=step, counter=counter.seen, weights=digest(dict(unwrapped.state_dict())))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["trainer", "trainer-fsdp", "accelerate"])
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--trace", action="store_true")
    options = parser.parse_args()
    result = accelerate_run(options) if options.mode == "accelerate" else trainer_run(options)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    Path(options.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
