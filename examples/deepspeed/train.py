"""A plain DeepSpeed training script: nothing in it knows about the autotuner.

    deepspeed --num_gpus 2 examples/deepspeed/train.py --deepspeed --deepspeed_config ds.json
    launcher --autotuning run --nproc_per_node 2 examples/deepspeed/train.py --deepspeed \
        --deepspeed_config examples/deepspeed/ds_config.json

A residual MLP regresses a fixed random teacher (the minimal example's model and data) on
DeepSpeed's own engine; `deepspeed.initialize` builds the engine, the data loader and the
optimizer from the config. Rank 0 prints which engine class trained, and the last loss.

`--checkpoint_activations true` recomputes each block in the backward pass through
`deepspeed.checkpointing`, as Megatron-DeepSpeed's --checkpoint-activations does, configured from
the config's activation_checkpointing section. Mapped in autotuning.arg_mappings
(`"activation_checkpointing.policy": "--checkpoint_activations"`), the tuner decides it.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # examples/ from a checkout
from examples.minimal.train import MLP, teacher_dataset  # noqa: E402


class CheckpointedMLP(MLP):
    """The same model and parameters; each block's activations are recomputed in the backward."""

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = x + deepspeed.checkpointing.checkpoint(layer, x)
        return self.head(x)


def true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--losses_out", default=None, help="rank 0 writes each step's loss here (JSON)")
    parser.add_argument("--checkpoint_activations", type=true_or_false, default=False,
                        help="true: recompute each block's activations in the backward (deepspeed.checkpointing)")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = (CheckpointedMLP if args.checkpoint_activations else MLP)(args.width, args.depth)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=teacher_dataset(args.samples))
    if args.checkpoint_activations:  # after initialize, as Megatron-DeepSpeed does: it reads the process group
        deepspeed.checkpointing.configure(None, deepspeed_config=args.deepspeed_config)
    # DeepSpeed casts the model, not the batch: inputs follow the config's precision.
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32
    losses, epoch = [], 0
    while engine.global_steps < args.steps:
        sampler = getattr(loader, "data_sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(engine.device, dtype), y.to(engine.device)
            loss = nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            if engine.global_steps > len(losses):
                losses.append(float(loss.item()))
            if engine.global_steps >= args.steps:
                break
        epoch += 1
    if engine.global_rank == 0:
        print(f"done on {type(engine).__module__}.{type(engine).__name__}: {engine.global_steps} steps, "
              f"last loss {losses[-1]:.4f}", flush=True)
        if args.losses_out:
            Path(args.losses_out).write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
