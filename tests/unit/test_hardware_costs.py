"""Costing a step on hardware that is not here (issue 80, part 3): the hardware spec read and
refused in one line, collectives from its links by algorithm, the roofline over an operator
census and what each checkpointing policy recomputes, the FSDP2 and DDP steps."""

from __future__ import annotations

import json
import math
import re

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autotuner.config.hardware import load_hardware, parse_hardware
from autotuner.core.errors import ConfigError
from autotuner.runtime.measure.op_census import OpCensus, OpRecord
from autotuner.tuning.models.hardware_step import ADAM_BYTES_PER_PARAMETER, step_prediction
from autotuner.tuning.models.roofline import Roofline, recomputed
from autotuner.tuning.models.spec_collectives import Group, collective_seconds, group_of

SPEC = {"name": "A100 SXM 80GB", "peak_bf16_flops": 312e12, "memory_bytes": 85899345920,
        "memory_bandwidth": 2.039e12, "accelerators_per_node": 8,
        "intra_node": {"bandwidth": 300e9, "latency": 5e-6}, "inter_node": {"bandwidth": 25e9, "latency": 10e-6}}


def test_a_spec_keeps_its_extra_fields_and_a_bad_one_is_refused_naming_the_file_and_the_field(tmp_path):
    spec = parse_hardware({**SPEC, "tdp_watts": 400}, "a100.json")
    assert spec.intra_node.bandwidth == 300e9 and spec.accelerators_per_node == 8 and spec.tdp_watts == 400
    missing = {**SPEC, "inter_node": {"bandwidth": 25e9}}
    with pytest.raises(ConfigError, match=r"^a100\.json: inter_node\.latency: missing; a hardware spec needs name, "):
        parse_hardware(missing, "a100.json")
    for field, value in (("memory_bandwidth", 0), ("accelerators_per_node", True), ("peak_bf16_flops", "312e12")):
        with pytest.raises(ConfigError, match=rf"^a100\.json: {field}: got {json.dumps(value)}; expected a positive"):
            parse_hardware({**SPEC, field: value}, "a100.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"--hardware .*bad\.json: not JSON \(line 1"):
        load_hardware(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match=r"--hardware .*none\.json: cannot read it"):
        load_hardware(tmp_path / "none.json")
    assert ConfigError.exit_code == 2


def test_collectives_follow_the_ring_over_the_slower_of_the_links_and_the_tree_for_small_all_reduces():
    spec = parse_hardware(SPEC, "spec")
    node = group_of(8, 1, spec)
    assert node == Group(8, 8) and not node.spans_nodes
    size = 8e9
    assert collective_seconds("all_gather", size, node, spec) == pytest.approx(7 * 5e-6 + size * 7 / 8 / 300e9)
    world = group_of(64, 1, spec)  # 8 nodes: 8 rings, one a network card, 8 x 25 GB/s < NVLink's 300
    assert collective_seconds("reduce_scatter", size, world, spec) == pytest.approx(63 * 10e-6 + size * 63 / 64 / 200e9)
    ring = 2 * 63 * 10e-6 + 2 * size * 63 / 64 / 200e9
    assert collective_seconds("all_reduce", size, world, spec) == pytest.approx(ring)
    tiny = 4096
    tree = 2 * math.ceil(math.log2(64)) * 10e-6 + 2 * tiny / 200e9
    assert collective_seconds("all_reduce", tiny, world, spec) == pytest.approx(tree)
    assert tree < 2 * 63 * 10e-6  # (the ring's hops alone)
    strided = group_of(8, 8, spec)  # a data-parallel group across tensor-parallel nodes: one rank a node
    assert strided == Group(8, 1) and collective_seconds("all_gather", size, strided, spec) == pytest.approx(
        7 * 10e-6 + size * 7 / 8 / 25e9)
    assert collective_seconds("send", 1e6, world, spec) == pytest.approx(10e-6 + 1e6 / 25e9)
    assert collective_seconds("all_reduce", size, Group(1, 1), spec) == 0.0
    assert collective_seconds("broadcast", size, node, spec) == pytest.approx(3 * 5e-6 + size / 300e9)
    with pytest.raises(ValueError, match="collective 'all_to_all'"):
        collective_seconds("all_to_all", size, node, spec)
    # A collective's own figures, where the library runs it at another speed (gloo's reduce-scatter)
    own = parse_hardware({**SPEC, "intra_node": {**SPEC["intra_node"], "collectives": {
        "reduce_scatter": {"bus_bandwidth": 100e9, "latency": 1e-3}}}}, "spec")
    assert collective_seconds("reduce_scatter", size, node, own) == pytest.approx(7 * 1e-3 + size * 7 / 8 / 100e9)
    assert collective_seconds("all_gather", size, node, own) == collective_seconds("all_gather", size, node, spec)


def _records():
    # Two blocks, each: a matmul, an elementwise op, a second matmul, attention; one op outside.
    block = lambda b: [OpRecord("aten.mm", 100.0, 1.0, "forward", b), OpRecord("aten.mul", 0.0, 50.0, "forward", b),
                       OpRecord("aten.mm", 200.0, 1.0, "forward", b), OpRecord("attention", 300.0, 1.0, "forward", b)]
    return [*block(0), *block(1), OpRecord("aten.add", 0.0, 10.0, "forward", None),
            OpRecord("aten.mm", 600.0, 2.0, "backward", None)]


def test_the_roofline_takes_the_slower_of_flops_and_bytes_and_each_policy_recomputes_its_own():
    roofline = Roofline(peak_flops=100.0, memory_bandwidth=10.0, compute_efficiency=0.5)
    assert roofline.seconds(OpRecord("aten.mm", 100.0, 1.0, "forward")) == 2.0  # 100 / (100 x 0.5) > 1 / 10
    assert roofline.seconds(OpRecord("aten.mul", 0.0, 50.0, "forward")) == 5.0
    records = _records()
    assert recomputed(records, "none") == []
    assert len(recomputed(records, "full")) == 8  # both blocks' forwards, not the op outside nor the backward
    assert {r.block for r in recomputed(records, "selective_layer")} == {1}  # every second block
    op = recomputed(records, "selective_op")  # attention and the first of each block's matmuls kept
    assert [(r.op, r.flops) for r in op] == [("aten.mul", 0.0), ("aten.mm", 200.0)] * 2
    assert [r.op for r in recomputed(records, "selective")] == ["aten.mul", "aten.mul"]  # ours: every matmul kept
    with pytest.raises(ValueError, match="policy 'some'"):
        recomputed(records, "some")


def test_the_fsdp2_step_overlaps_its_gathers_with_compute_and_ddp_reduces_once_a_step():
    spec = parse_hardware(SPEC, "spec")
    records = [OpRecord("aten.mm", 312e12, 0.0, "forward"), OpRecord("aten.mm", 2 * 312e12, 0.0, "backward")]
    n = 1_000_000_000
    fsdp = step_prediction(records, n, 64, 3, 2, 4096, "none", spec, 1.0)
    assert fsdp.compute_s == pytest.approx(3.0)  # 3 x the peak's second
    gather = collective_seconds("all_gather", 2 * n, Group(64, 8), spec)
    scatter = collective_seconds("reduce_scatter", 4 * n, Group(64, 8), spec)
    # gathered for each forward and backward; reduce-scattered once, in the last backward
    assert fsdp.communication_s == pytest.approx(2 * gather + scatter / 2)
    assert 2 * gather + scatter < 3.0
    optimizer = n / 64 * ADAM_BYTES_PER_PARAMETER / spec.memory_bandwidth
    assert fsdp.step_s == pytest.approx(2 * 3.0 + optimizer)  # each micro-step compute-bound
    assert fsdp.tokens_per_s_per_rank == pytest.approx(2 * 4096 / fsdp.step_s)
    assert fsdp.model_flops_utilization == pytest.approx(2 * 3 * 312e12 / (fsdp.step_s * 312e12))
    ddp = step_prediction(records, n, 64, 0, 2, 4096, "full", spec, 1.0)
    reduce = collective_seconds("all_reduce", 4 * n, Group(64, 8), spec)
    assert ddp.compute_s == pytest.approx(3.0)  # no block named: nothing to recompute
    assert ddp.step_s == pytest.approx(3.0 + max(3.0, reduce) + n * ADAM_BYTES_PER_PARAMETER / spec.memory_bandwidth)
    slow = step_prediction(records, n, 64, 3, 1, 4096, "none", spec, 100.0)  # compute far faster: comm-bound
    assert slow.step_s == pytest.approx(2 * gather + scatter + optimizer)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            q = block(x).view(2, 3, 4, 4).transpose(1, 2)  # (batch, heads, seq, dim)
            x = x + F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(2, 3, 16)
        return x.sum()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_census_counts_torchs_flops_fuses_attention_and_marks_the_blocks(device):
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    with torch.device(device):
        model = _Tiny()
        x = torch.randn(2, 3, 16, requires_grad=True)
    with OpCensus(model.blocks) as census:
        loss = model(x)
        census.phase = "backward"
        loss.backward()
    matmuls = [r for r in census.records if r.is_matmul]
    with FlopCounterMode(display=False) as counter:  # the same Linears, counted by torch
        for block in model.blocks:
            block(torch.randn(2, 3, 16, device=device, requires_grad=True)).sum().backward()
    assert sum(r.flops for r in matmuls) == counter.get_total_flops()
    attention = [r for r in census.records if r.is_attention]
    assert [r.phase for r in attention] == ["forward", "forward", "backward", "backward"]
    assert attention[0].flops == 4 * 2 * 4 * 3 * 3 * 4 / 2 and attention[2].flops == 2.5 * attention[0].flops
    assert not any(r.op in ("aten.bmm", "aten._softmax", "aten._safe_softmax") for r in census.records)
    assert {r.block for r in census.records if r.phase == "forward" and r.is_matmul} == {0, 1}
    assert all(r.block is None for r in census.records if r.phase == "backward")
    first = next(r for r in census.records if r.op == "aten.mm")
    assert first.bytes == 4 * (6 * 16 + 16 * 16 + 6 * 16)  # input, weight and output read and written once
    assert all(r.bytes == 0 for r in census.records if r.op in ("aten.view", "aten.transpose", "aten.t"))


def test_tensor_parallel_divides_the_split_share_and_waits_on_its_all_reduces_inside_the_node():
    from autotuner.tuning.models.hardware_step import TensorParallel

    spec = parse_hardware(SPEC, "spec")
    records = [OpRecord("aten.mm", 312e12, 0.0, "forward"), OpRecord("aten.mm", 2 * 312e12, 0.0, "backward")]
    n, split = 1_000_000_000, 800_000_000
    tp = TensorParallel(degree=4, split_params=split, flop_share=0.9, row_layers=10, row_output_bytes=10 * 2**20)
    got = step_prediction(records, n, 64, 3, 1, 4096, "none", spec, 1.0, tp)
    each = collective_seconds("all_reduce", 2**20, Group(4, 4), spec)  # one row-wise output, inside a node
    assert got.compute_s == pytest.approx(3.0 * (0.1 + 0.9 / 4) + 2 * 10 * each)
    held = n - split + split // 4  # the rest whole, the split Linears a quarter
    dp = Group(16, 2)  # 16 replicas, 2 of them on each node of 8
    assert got.communication_s == pytest.approx(2 * collective_seconds("all_gather", 2 * held, dp, spec)
                                                + collective_seconds("reduce_scatter", 4 * held, dp, spec))
    assert got.tokens_per_s_per_rank == pytest.approx(4096 / 4 / got.step_s)  # a replica's batch over its 4 ranks
    # With the column-wise layers counted (25, as q, k, v, gate and up of 5 blocks): one all-reduce each.
    counted = step_prediction(records, n, 64, 3, 1, 4096, "none", spec, 1.0, replace(tp, col_layers=25))
    assert counted.compute_s == pytest.approx(3.0 * (0.1 + 0.9 / 4) + (10 + 25) * each)


CPU = {**SPEC, "name": "a 2-core CPU", "device": "cpu", "peak_fp32_flops": 100e9, "peak_bf16_flops": 400e9,
       "memory_bandwidth": 40e9, "accelerators_per_node": 2, "overlap_communication": False}


def test_a_cpu_spec_is_typed_and_its_rules_are_refused_in_one_line():
    spec = parse_hardware(CPU, "cpu.json")
    assert spec.device == "cpu" and spec.peak_flops("fp32") == 100e9 and spec.peak_flops("bf16") == 400e9
    assert spec.rank_share(2) == 1.0 and spec.rank_share(4) == 0.5  # 4 ranks take turns on 2 cores
    assert parse_hardware(SPEC, "a100.json").rank_share(16) == 1.0  # a GPU is a rank's own
    with pytest.raises(ConfigError, match="peak_fp32_flops: missing; an fp32 run is costed at the fp32 peak"):
        parse_hardware(SPEC, "a100.json").peak_flops("fp32")
    cases = {
        "device": ("tpu", 'cpu.json: device: got "tpu"; expected "cuda" or "cpu"'),
        "compute_efficiency": (1.5, "cpu.json: compute_efficiency: got 1.5; expected a number in (0, 1]"),
        "op_overhead_s": (-1, "cpu.json: op_overhead_s: got -1; expected a number >= 0"),
        "overlap_communication": ("no", 'cpu.json: overlap_communication: got "no"; expected true or false'),
        "calibrate": ({"layout": "z0_gas1_mbs4"}, "cpu.json: calibrate.step_s: missing"),
        "intra_node": ({"bandwidth": 1e9, "latency": 1e-4, "collectives": {"all_to_all": {"bus_bandwidth": 1e9,
                                                                                          "latency": 1e-4}}},
                       'cpu.json: intra_node.collectives: "all_to_all" is not a collective; expected all_reduce, '
                       "all_gather, reduce_scatter, broadcast"),
    }
    for field, (value, message) in cases.items():
        with pytest.raises(ConfigError) as caught:
            parse_hardware({**CPU, field: value}, "cpu.json")
        assert str(caught.value) == message and "\n" not in message
    with pytest.raises(ConfigError, match="give compute_efficiency or calibrate, not both"):
        parse_hardware({**CPU, "compute_efficiency": 0.5, "calibrate": {"layout": "z0", "step_s": 1.0}}, "cpu.json")


def test_a_cpu_step_adds_its_collectives_to_compute_and_its_efficiency_scales_the_whole_step():
    spec = parse_hardware(CPU, "cpu.json")
    records = [OpRecord("aten.mm", 100e9, 0.0, "forward"), OpRecord("aten.mul", 0.0, 40e9, "backward")]
    n = 10_000_000
    ddp = step_prediction(records, n, 2, 0, 2, 512, "none", spec, 1.0, precision="fp32")
    reduce = collective_seconds("all_reduce", 4 * n, Group(2, 2), spec)
    optimizer = n * (ADAM_BYTES_PER_PARAMETER - 2) / 40e9  # fp32: no low-precision copy written
    assert ddp.compute_s == pytest.approx(2.0)  # 1 s of FLOPs at the fp32 peak, 1 s of bytes
    assert ddp.step_s == pytest.approx(2.0 + 2.0 + reduce + optimizer)  # gloo shares the cores: a sum
    assert step_prediction(records, n, 2, 0, 2, 512, "none", spec, 0.5, precision="fp32").step_s == pytest.approx(
        2 * ddp.step_s)  # every part of a CPU step runs on the same cores
    crowded = step_prediction(records, n, 4, 0, 2, 512, "none", spec, 1.0, precision="fp32", ranks_per_node=4)
    assert crowded.compute_s == pytest.approx(4.0)  # half a core a rank
    overhead = parse_hardware({**CPU, "op_overhead_s": 0.25}, "cpu.json")
    assert step_prediction(records, n, 2, 0, 1, 512, "none", overhead, 1.0,
                           precision="fp32").compute_s == pytest.approx(2.5)


def test_fsdp2_pays_each_collective_unit_by_unit_and_zero_1_broadcasts_each_parameter():
    spec = parse_hardware({**CPU, "overlap_communication": True}, "cpu.json")
    records = [OpRecord("aten.mm", 100e9, 0.0, "forward")]
    n = 10_000_000
    group = Group(2, 2)
    z3 = step_prediction(records, n, 2, 3, 4, 512, "none", spec, 1.0, precision="fp32", fsdp_units=5)
    gather = 5 * collective_seconds("all_gather", 4 * n / 5, group, spec)
    scatter = 5 * collective_seconds("reduce_scatter", 4 * n / 5, group, spec)
    assert gather > collective_seconds("all_gather", 4 * n, group, spec)  # four more latencies
    assert z3.communication_s == pytest.approx(2 * gather + scatter / 4)
    z2 = step_prediction(records, n, 2, 2, 4, 512, "none", spec, 1.0, precision="fp32", fsdp_units=5)
    assert z2.communication_s == pytest.approx(gather + scatter / 4)  # one gather a micro-step
    z0 = step_prediction(records, n, 2, 0, 1, 512, "none", spec, 1.0, precision="fp32", parameter_tensors=10)
    z1 = step_prediction(records, n, 2, 1, 1, 512, "none", spec, 1.0, precision="fp32", parameter_tensors=10)
    broadcasts = 10 * collective_seconds("broadcast", 4 * n / 10, group, spec)
    halved = n / 2 * (ADAM_BYTES_PER_PARAMETER - 2) / 40e9
    assert z1.step_s == pytest.approx(z0.step_s - z0.optimizer_s + halved + broadcasts)


def test_calibrate_fits_the_efficiency_at_which_its_layout_takes_the_measured_step():
    from autotuner.app.hardware_plan import fitted_efficiency

    def rows_at(efficiency):  # a step of 0.1 s of collectives and 0.2 s of compute at the peak
        return [{"name": "z0_gas4_mbs4", "predicted_step_s": 0.1 + 0.2 / efficiency},
                {"name": "z3_gas4_mbs4", "predicted_step_s": 0.3 + 0.2 / efficiency}]

    spec = parse_hardware({**CPU, "calibrate": {"layout": "z0_gas4_mbs4", "step_s": 0.5}}, "cpu.json")
    efficiency, said = fitted_efficiency(rows_at, spec, "cpu.json")
    assert efficiency == pytest.approx(0.5, rel=1e-6) and said == "fitted on z0_gas4_mbs4's 0.5 s a step"
    refusals = {("z9_gas1_mbs1", 0.5): "calibrate.layout 'z9_gas1_mbs1': not a layout of this plan; its layouts are "
                                       "z0_gas4_mbs4, z3_gas4_mbs4",
                ("z0_gas4_mbs4", 0.2): "calibrate.step_s 0.2: z0_gas4_mbs4 would take 0.3 s a step even at the "
                                       "spec's full peak"}
    for (layout, step), message in refusals.items():
        spec = parse_hardware({**CPU, "calibrate": {"layout": layout, "step_s": step}}, "cpu.json")
        with pytest.raises(ConfigError, match=re.escape(message)):
            fitted_efficiency(rows_at, spec, "cpu.json")
