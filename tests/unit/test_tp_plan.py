"""The tensor-parallel plan (autotuner/runtime/training/tp_plan.py): a model's own Hugging Face plan,
else DeepSpeed AutoTP's rule for Linears in blocks, refused where an even split would be wrong."""

from __future__ import annotations

import pytest
import torch.nn as nn

from autotuner.core.errors import UnsupportedError
from autotuner.runtime.training.tp_plan import (COLWISE, COLWISE_GATHERED, ROWWISE, divide_head_attributes,
                                                dtensor_styles, tp_plan)
from workers.tp_models import Net  # the block model the engine tests train split


def tiny_llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, max_position_embeddings=32)
    return LlamaForCausalLM(LlamaConfig(**{**values, **config}))


def test_a_hugging_face_model_is_split_by_its_own_plan_with_an_untied_head_gathered():
    plan = tp_plan(tiny_llama(), 2)
    styles = dict(plan.styles)
    assert "Hugging Face" in plan.source
    for layer in (0, 1):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert styles.pop(f"model.layers.{layer}.{name}") == COLWISE
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert styles.pop(f"model.layers.{layer}.{name}") == ROWWISE
    assert styles == {"lm_head": COLWISE_GATHERED}  # the embedding and the norms stay whole


def test_a_head_tied_to_the_embedding_stays_whole_with_it():
    assert "lm_head" not in tp_plan(tiny_llama(tie_word_embeddings=True), 2).split


def test_a_degree_that_does_not_divide_the_heads_is_refused_in_one_line():
    with pytest.raises(UnsupportedError, match=r"config\.num_key_value_heads is 2, which 4 does not divide"):
        tp_plan(tiny_llama(), 4)
    with pytest.raises(UnsupportedError, match=r"has 64 features to split, which 3 does not divide"):
        tp_plan(tiny_llama(), 3)


def test_without_a_plan_autotp_splits_the_linears_in_blocks_as_deepspeed_does():
    plan = tp_plan(Net(), 2)
    assert plan.source == "DeepSpeed AutoTP's rule"
    assert dict(plan.styles) == {
        f"blocks.{i}.{name}": style for i in (0, 1)
        for name, style in (("attn.q", COLWISE), ("attn.k", COLWISE), ("attn.v", COLWISE), ("attn.out", ROWWISE),
                            ("up", COLWISE), ("down_proj", ROWWISE))}


def test_heads_are_divided_on_the_split_layers_parents_only():
    model = Net()
    assert divide_head_attributes(model, tp_plan(model, 2), 2) == ["blocks.0.attn.num_heads", "blocks.1.attn.num_heads"]
    assert model.blocks[0].attn.num_heads == 2


def test_what_an_even_split_would_get_wrong_is_refused():
    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = nn.Linear(32, 96)
            self.o_proj = nn.Linear(32, 32)

    with pytest.raises(UnsupportedError, match=r"blocks\.0\.qkv_proj is a fused projection"):
        tp_plan(Net(block=Fused), 2)
    with pytest.raises(UnsupportedError, match=r"has no Linear layer in a block of a ModuleList"):
        tp_plan(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), 2)
    model = tiny_llama()
    model._tp_plan = {**model._tp_plan, "model.norm": "sequence_parallel"}
    with pytest.raises(UnsupportedError, match=r"'model\.norm' the style 'sequence_parallel'"):
        tp_plan(model, 2)


def test_the_plan_becomes_torchs_styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = dtensor_styles(tp_plan(tiny_llama(), 2))
    assert isinstance(styles["model.layers.0.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(styles["model.layers.0.self_attn.o_proj"], RowwiseParallel)
    assert isinstance(styles["lm_head"], ColwiseParallel)
