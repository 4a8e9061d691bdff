"""Tiny models for the tensor-parallel tests: a block model that AutoTP's rule splits (its
attention views activations by its own head count, as older model code does), and a random
Llama that splits by its Hugging Face plan. Used by tests/unit/test_tp_plan.py and
tests/workers/tp_train.py."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F


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
    return model
