"""One workload, two engines: the same model, data, optimizer and loop under DeepSpeed or ours.

    deepspeed --num_gpus 2 benchmarks/workloads/dual_engine.py --engine deepspeed --deepspeed --deepspeed_config ds.json
    launcher --nproc_per_node 2 benchmarks/workloads/dual_engine.py --engine autotuner --deepspeed --deepspeed_config ds.json

The model is the minimal example's residual MLP (examples/minimal/train.py), the data its fixed
random teacher; only `initialize` differs. The micro-batch, gas and ZeRO stage come from the
config (DeepSpeed's autotuner passes it base64-encoded after --deepspeed_config; ours a path).
With an `autotuning` section enabled, both engines stop by themselves after end_profile_step
and write their metrics.
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # examples/ from a checkout
from examples.minimal.train import MLP, teacher_dataset  # noqa: E402
from training_loop import engine_parser, parse_engine_args, train_engine  # noqa: E402


def parse_args():
    parser, engine_name = engine_parser(__doc__)
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps (autotuning stops earlier)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=1234)
    return parse_engine_args(parser, engine_name), engine_name


def main() -> None:
    args, engine_name = parse_args()
    torch.manual_seed(args.seed)
    model = MLP(args.width, args.depth)
    data = teacher_dataset(args.samples)
    # Imported by name here: the launcher reads a script's own imports to tell its engine.
    if engine_name == "deepspeed":
        import deepspeed as engine_module
    else:
        import autotuner as engine_module
    engine, _, loader, _ = engine_module.initialize(args=args, model=model,
                                                                 model_parameters=model.parameters(), training_data=data)
    loss = train_engine(engine, loader, args.steps, nn.functional.mse_loss)
    if engine.global_rank == 0:
        print(f"done ({engine_name}): {engine.global_steps} steps, last loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
