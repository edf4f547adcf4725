"""A Trainer run attached to a safeckpt root, as its own process (tests/test_hf.py kills it).

    python tests/support/hf_worker.py ROOT OUTPUT_DIR RESULT [--steps N] [--rows R] [--pace SECONDS]

Prints ``step N`` (flushed) at each step's end, so the parent can kill it at a chosen step, and
``resumed N`` once it resumed; writes the final weights to RESULT (torch.save) when training ends.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import hf_toy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("output_dir")
    parser.add_argument("result")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--plain", action="store_true", help="the Trainer alone, not attached")
    options = parser.parse_args()

    from transformers import TrainerCallback

    import safeckpt.hf

    class Progress(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            print(f"resumed {state.global_step}", flush=True)

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            print(f"step {state.global_step}", flush=True)
            if options.pace:
                time.sleep(options.pace)

    trainer = hf_toy.trainer(options.output_dir, max_steps=options.steps, train_rows=options.rows)
    trainer.add_callback(Progress())
    if not options.plain:
        safeckpt.hf.attach(trainer, options.root)
    trainer.train()
    torch.save(hf_toy.weights(trainer), options.result)
    print("done", flush=True)


if __name__ == "__main__":
    main()
