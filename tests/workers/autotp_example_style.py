"""A training script shaped like DeepSpeedExamples' AutoTP basic example
(training/tensor_parallel/basic_example/autotp_example.py), written here in our own words:

- the script builds its own tensor- and data-parallel groups with dist.new_group, the ranks of a
  tensor-parallel group consecutive, and hands them to initialize in a small mpu object;
- the config is a dict: train_batch_size = batch x dp, train_micro_batch_size_per_gpu, the ZeRO
  stage, tensor_parallel.autotp_size and data_parallel_size;
- AdamW is built before initialize(model=, optimizer=, config=, mpu=);
- each step the first rank of a tensor-parallel group draws the batch and broadcasts it to the
  group; engine(input_ids=, labels=), engine.backward, engine.step.

The model is a tiny random Llama. `--engine autotuner` (the default) runs it on our engine
through `import autotuner as deepspeed`; `--engine deepspeed` on DeepSpeed's own (on a CPU-only
machine with DS_ACCELERATOR=cpu). `--tp_model_init` first calls deepspeed.tp_model_init(model,
tp_size=, dtype=), as autotp_memory_compare.py's "traditional" mode does. `--config_autotp_size`
and `--tp_model_init_size` put another size in the config or the tp_model_init call than the
groups are built for (the refusals' tests). Rank 0 writes to --out, as JSON, each step's loss
averaged over the data-parallel ranks ("losses"), how many parameter elements it holds
("parameters_held": fewer than the model's where the engine split it), and with --tp_size above 1
each rank's place as deepspeed.utils.groups and the engine's getters tell it ("groups").
`--init_tp_mesh_device` builds DeepSpeed's groups first (utils.groups._init_tp_mesh_device), which
initialize then keeps. Run by tests/integration/test_autotp_api.py."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

ENGINE = "deepspeed" if "--engine" in sys.argv and sys.argv[sys.argv.index("--engine") + 1] == "deepspeed" else "autotuner"
if ENGINE == "deepspeed":
    import deepspeed
else:
    import autotuner as deepspeed  # the one line a DeepSpeed script changes

VOCAB = 50


@dataclass
class ParallelUnit:
    """What initialize(mpu=...) asks of the script's groups: their handles, sizes and this rank's place."""

    tp_group: object
    dp_group: object
    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_group(self):
        return self.dp_group

    def get_model_parallel_world_size(self):
        return self.tp_size

    def get_data_parallel_world_size(self):
        return self.dp_size

    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_data_parallel_rank(self):
        return self.dp_rank


def make_groups(tp_size: int, dp_size: int) -> ParallelUnit:
    """Every rank creates every group (new_group is collective); each keeps the two it is in.
    Tensor-parallel groups are runs of consecutive ranks; a data-parallel group takes one rank
    from each run, at the same offset."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp_size * dp_size != world:
        raise SystemExit(f"--tp_size {tp_size} x --dp_size {dp_size} is not the {world} ranks launched")
    mine = {}
    for first in range(0, world, tp_size):
        members = list(range(first, first + tp_size))
        group = dist.new_group(members)
        if rank in members:
            mine["tp"] = group
    for offset in range(tp_size):
        members = list(range(offset, world, tp_size))
        group = dist.new_group(members)
        if rank in members:
            mine["dp"] = group
    return ParallelUnit(mine["tp"], mine["dp"], tp_size, dp_size, rank % tp_size, rank // tp_size)


def tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=32))


def groups_view(engine, built_first) -> dict:
    """This rank's place as deepspeed.utils.groups and the engine tell it after initialize."""
    groups = deepspeed.utils.groups
    view = {
        "tp": [groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank()],
        "mp": [groups.get_model_parallel_world_size(), groups.get_model_parallel_rank()],
        "dp": [groups.get_data_parallel_world_size(), groups.get_data_parallel_rank()],
        "tp_source_rank": groups.get_tensor_model_parallel_src_rank(),
        "tp_ranks": dist.get_process_group_ranks(groups.get_tensor_model_parallel_group()),
        "mp_ranks": dist.get_process_group_ranks(groups.get_model_parallel_group()),
        "dp_ranks": dist.get_process_group_ranks(groups.get_data_parallel_group()),
        "engine": [engine.get_data_parallel_rank(), engine.get_tensor_parallel_rank(),
                   engine.get_model_parallel_rank()],
    }
    if built_first is not None:
        view["kept_the_groups_built_first"] = groups.get_tensor_model_parallel_group() is built_first[1]
    return view


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--engine", choices=["autotuner", "deepspeed"], default="autotuner")
    parser.add_argument("--tp_size", type=int, default=2)
    parser.add_argument("--dp_size", type=int, default=None, help="default: the ranks over --tp_size")
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--seq_length", type=int, default=16)
    parser.add_argument("--num_steps", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--tp_model_init", action="store_true")
    parser.add_argument("--tp_model_init_size", type=int, default=None, help="default: --tp_size")
    parser.add_argument("--config_autotp_size", type=int, default=None, help="default: --tp_size")
    parser.add_argument("--init_tp_mesh_device", action="store_true",
                        help="build DeepSpeed's groups (utils.groups._init_tp_mesh_device) before initialize")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    deepspeed.init_distributed()
    dp_size = args.dp_size or dist.get_world_size() // args.tp_size
    mpu = make_groups(args.tp_size, dp_size)
    device = torch.device(deepspeed.get_accelerator().current_device_name())

    torch.manual_seed(42)  # the same weights on every rank, as a from_pretrained checkpoint gives
    model = tiny_llama().to(device)
    if args.tp_model_init:
        model = deepspeed.tp_model_init(model, tp_size=args.tp_model_init_size or args.tp_size, dtype=torch.float32)
    built_first = None
    if args.init_tp_mesh_device:  # as DeepSpeed's initialize does on Hugging Face's path (tp_model_init, no mpu)
        built_first = deepspeed.utils.groups._init_tp_mesh_device(tensor_model_parallel_size=args.tp_size)

    autotp_size = args.config_autotp_size or args.tp_size
    config_dp = dist.get_world_size() // autotp_size  # the config states its own sizes consistently
    config = {
        "train_batch_size": args.batch_size * config_dp,
        "train_micro_batch_size_per_gpu": args.batch_size,
        "zero_optimization": {"stage": args.zero_stage},
        "tensor_parallel": {"autotp_size": autotp_size},
        "data_parallel_size": config_dp,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)

    source = mpu.dp_rank * mpu.tp_size  # the global rank of this tensor-parallel group's first rank
    shape = (args.batch_size, args.seq_length)
    losses = []
    for step in range(args.num_steps):
        if mpu.tp_rank == 0:
            generator = torch.Generator().manual_seed(1000 * step + mpu.dp_rank)
            input_ids = torch.randint(0, VOCAB, shape, generator=generator).to(device)
        else:
            input_ids = torch.empty(shape, dtype=torch.long, device=device)
        dist.broadcast(input_ids, src=source, group=mpu.tp_group)
        labels = input_ids.clone()
        loss = engine(input_ids=input_ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, group=mpu.dp_group)
        losses.append(mean.item() / mpu.dp_size)

    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, groups_view(engine, built_first) if args.tp_size > 1 else None)
    if dist.get_rank() == 0:
        held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in engine.module.parameters())
        with open(args.out, "w") as handle:
            json.dump({"losses": losses, "parameters_held": held, "groups": views}, handle)
    dist.barrier()


if __name__ == "__main__":
    main()
