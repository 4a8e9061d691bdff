"""The hardware plan's step time against a published table nobody here wrote (issue 80, part 3):
torchtitan's docs/performance.md, Llama 3 8B and 70B and Llama 2 13B and 70B trained with FSDP2 on
64 A100 80GB GPUs, tokens/s per GPU (WPS) for each local batch and activation checkpointing
setting. Each model is built from its config on the meta device (nothing allocated), one
micro-step counted operator by operator (runtime/measure/op_census.py) and costed against an A100
SXM 80GB spec from its datasheet (tuning/models/hardware_step.py). One compute efficiency is
fitted, on the Llama 2 13B row without checkpointing; every other row is predicted, within 15%.
benchmarks/published_table.py prints the rows (docs/benchmarks/published_table.md)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from autotuner.config.hardware import parse_hardware
from autotuner.runtime.measure.op_census import OpCensus
from autotuner.tuning.models.hardware_step import step_prediction

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# The A100 SXM 80GB datasheet: dense bf16 peak, HBM2e bandwidth and size; NVLink 3 (600 GB/s both
# ways: 300 one way) inside a node of 8; one 200 Gb/s network card a GPU (25 GB/s) between nodes.
A100_SXM_80GB = {"name": "A100 SXM 80GB", "peak_bf16_flops": 312e12, "memory_bytes": 85899345920,
                 "memory_bandwidth": 2.039e12, "accelerators_per_node": 8,
                 "intra_node": {"bandwidth": 300e9, "latency": 5e-6},
                 "inter_node": {"bandwidth": 25e9, "latency": 10e-6}}
# (layers, hidden, FFN, heads, KV heads, vocabulary, sequence): the models' published configs, at
# the sequence torchtitan trains each at.
MODELS = {"Llama 3 8B": (32, 4096, 14336, 32, 8, 128256, 8192), "Llama 3 70B": (80, 8192, 28672, 64, 8, 128256, 8192),
          "Llama 2 13B": (40, 5120, 13824, 40, 40, 32000, 4096), "Llama 2 70B": (80, 8192, 28672, 64, 8, 32000, 4096)}
POLICY = {"no": "none", "full": "full", "selective layer": "selective_layer", "selective op": "selective_op"}
WORLD = 64


@dataclass(frozen=True)
class Row:
    model: str
    local_batch: int
    checkpointing: str
    wps: float  # published tokens/s per GPU
    mfu: float  # published, percent

    @property
    def key(self) -> str:
        return f"{self.model}, batch {self.local_batch}, {self.checkpointing}"


# torchtitan docs/performance.md (read 2026-12-03; Llama 3's rows as the file's latest revision gives them).
ROWS = (Row("Llama 3 8B", 1, "selective layer", 2904, 56.8), Row("Llama 3 8B", 1, "selective op", 2973, 58.2),
        Row("Llama 3 70B", 1, "full", 331, 51.7), Row("Llama 2 13B", 2, "no", 2162, 61.1),
        Row("Llama 2 13B", 2, "selective layer", 1914, 54.1), Row("Llama 2 13B", 2, "selective op", 1904, 53.8),
        Row("Llama 2 70B", 1, "selective op", 355, 50.8), Row("Llama 2 70B", 2, "full", 353, 50.5))
FITTED = "Llama 2 13B, batch 2, no"


def census(model: str, local_batch: int):
    """(one micro-step's operator records, the parameter count, the tokens of a micro-step)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, ffn, heads, kv, vocab, seq = MODELS[model]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq,
                         attn_implementation="sdpa")
    with torch.device("meta"):
        net = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(local_batch, seq, dtype=torch.long, device="meta")
    with OpCensus(net.model.layers) as counted:
        loss = net(input_ids=ids, labels=ids).loss
        counted.phase = "backward"
        loss.backward()
    return counted.records, sum(p.numel() for p in net.parameters()), local_batch * seq


def predicted_rows(fitted: str = FITTED) -> tuple[float, list[tuple[Row, object]]]:
    """(the compute efficiency fitted on `fitted`, each row with its StepPrediction)."""
    spec = parse_hardware(A100_SXM_80GB, "A100 SXM 80GB")
    counted = {}
    for row in ROWS:
        if (row.model, row.local_batch) not in counted:
            counted[row.model, row.local_batch] = census(row.model, row.local_batch)

    def predict(row: Row, efficiency: float):
        records, params, tokens = counted[row.model, row.local_batch]
        return step_prediction(records, params, WORLD, 3, 1, tokens, POLICY[row.checkpointing], spec, efficiency)

    target = next(r for r in ROWS if r.key == fitted)
    low, high = 0.05, 1.0  # tokens/s rise with the efficiency: bisect for the fitted row's figure
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if predict(target, middle).tokens_per_s_per_rank < target.wps else (low, middle)
    efficiency = (low + high) / 2
    return efficiency, [(row, predict(row, efficiency)) for row in ROWS]


def test_an_8b_models_step_is_counted_on_the_meta_device_with_torchs_flop_formulas():
    # The census' matmul FLOPs are FlopCounterMode's; attention is one fused kernel, its seq x seq
    # matrices (the math path's bmm and softmax) never counted; no parameter was materialised.
    records, params, tokens = census("Llama 3 8B", 1)
    assert 8.0e9 < params < 8.1e9 and tokens == 8192
    assert not any(r.op in ("aten.bmm", "aten._softmax", "aten._safe_softmax") for r in records)
    attention = [r for r in records if r.is_attention]
    assert len(attention) == 2 * 32  # one forward and one backward a block
    # 4 b h s^2 d / 2 (causal) a forward: 32 heads x 8192^2 x 128
    assert attention[0].flops == pytest.approx(4 * 32 * 8192 ** 2 * 128 / 2)
    matmul = sum(r.flops for r in records if r.is_matmul)
    assert matmul == pytest.approx(6 * 8192 * (params - 128256 * 4096), rel=0.01)  # 2 forward + 4 backward per weight


def test_the_published_table_is_predicted_within_15_percent_with_one_fitted_constant():
    efficiency, rows = predicted_rows()
    assert 0.3 < efficiency < 1.0
    errors = {row.key: (p.tokens_per_s_per_rank - row.wps) / row.wps for row, p in rows}
    assert abs(errors[FITTED]) < 1e-3  # (the fitted row, by construction)
    assert all(abs(e) < 0.15 for e in errors.values()), errors
    # The order within each model's rows is kept where the table's figures differ by more than 1%
    # (Llama 2 13B's two selective policies, 0.5% apart, are not told apart: docs/benchmarks/published_table.md).
    for one, p in rows:
        for other, q in rows:
            if one.model == other.model and one.wps > 1.01 * other.wps:
                assert p.tokens_per_s_per_rank > q.tokens_per_s_per_rank, (one.key, other.key, errors)
