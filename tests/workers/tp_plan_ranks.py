"""Two ranks split a tiny random model by its tensor-parallel plan (autotuner/runtime/training/
tp_plan.py) with torch's parallelize_module, and train it beside an unsplit copy on every rank:
the split model's losses must equal the whole model's. Writes `ok <model> <losses>` per rank to
--out; any difference raises. Run by tests/integration/test_tp_plan_ranks.py under the launcher."""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from autotuner.runtime.training.tp_plan import divide_head_attributes, dtensor_styles, tp_plan


class Attention(nn.Module):
    """Views activations by its own head count, as older model code does (DeepSpeed divides it)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.num_heads, self.head_dim = heads, width // heads
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        return self.out(y)


class Block(nn.Module):
    """The attention's last Linear comes just before a norm (row-wise by AutoTP's rule); the MLP's
    second is row-wise by its name."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.attn = Attention(width, heads)
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        x = self.norm(x + self.attn(x))
        return x + self.down_proj(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, blocks: int = 2, block=Block):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList(block() for _ in range(blocks))
        self.head = nn.Linear(32, 50)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=50, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    model.forward_loss = lambda ids, labels: model(input_ids=ids, labels=labels).loss
    return model


def loss_of(model, ids, labels):
    return model.forward_loss(ids, labels) if hasattr(model, "forward_loss") else model(ids, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("net", "llama"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the launcher passes it, as DeepSpeed's does
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    whole = Net() if args.model == "net" else llama()
    split = copy.deepcopy(whole)
    if args.model == "llama":
        split.forward_loss = lambda ids, labels: split(input_ids=ids, labels=labels).loss
    plan = tp_plan(split, world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(split, mesh["tp"], dtensor_styles(plan))
    divide_head_attributes(split, plan, world)
    whole_opt = torch.optim.SGD(whole.parameters(), lr=0.1)
    split_opt = torch.optim.SGD(split.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, 50, (2, 16), generator=generator)  # the same batch on every rank
        labels = torch.randint(0, 50, (2, 16), generator=generator)
        expected = loss_of(whole, ids, labels)
        got = loss_of(split, ids, labels)
        for model, opt, loss in ((whole, whole_opt, expected), (split, split_opt, got)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        got_value = got.full_tensor().item() if hasattr(got, "full_tensor") else got.item()
        if abs(got_value - expected.item()) > 1e-5:
            raise SystemExit(f"rank {rank}: split loss {got_value} != whole {expected.item()}")
        losses.append(got_value)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in split.parameters())
    total = sum(p.numel() for p in whole.parameters())
    with open(os.path.join(args.out, f"rank{rank}.txt"), "w") as handle:
        handle.write(f"ok {args.model} {local} {total} " + " ".join(f"{v:.6f}" for v in losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
