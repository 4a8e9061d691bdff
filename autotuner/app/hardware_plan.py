"""`launcher --autotuning plan --hardware SPEC.json [--num_nodes N] --nproc_per_node M script.py ...
--deepspeed ds.json`: the table the tuner would choose from, for a world of N x M accelerators
that does not exist here (issue 80, part 3). Nothing is launched on this machine's devices.

The script runs twice, in one process each (runtime/census_run.py), as rank 0 of a fake world of
N x M ranks with the model on the meta device: at micro-batch 1 and 2, each run counting one
micro-step's operators (FLOPs, bytes) and the bytes its forward saves, so each operator's cost and
the activations are a + b x micro-batch. Then every data-parallel candidate the config's space
holds (ZeRO stage x micro-batch x gas x checkpointing policy, the user's global batch kept) is
costed: per-rank memory by the memory model (tuning/memory/estimate.py; plus the spec's
`process_overhead_bytes`, 1 GiB on a GPU where it gives none: the CUDA context and the
allocator's reserve; on a CPU spec also the script's own resident set, measured by the census),
which fits under the spec's memory (a CPU node's shared by its ranks) less the safety margin;
step time by the roofline and the spec's links (tuning/models/hardware_step.py) at the compute
efficiency the spec states, or fits on one layout it gives as measured (`calibrate`), else
0.6495 on a GPU (fitted on torchtitan's Llama 2 13B row, docs/benchmarks/published_table.md)
and 1 on a CPU. bf16 "auto" settles as a launch on the spec's device would; fp32 is costed at
the spec's `peak_fp32_flops`. The table is printed and written as plan.csv. A script that trains a
PipelineModule has its stage counts and schedules planned instead (pipeline_plan.py). CPU offload
and scripts on DeepSpeed's own engine (whose step the census does not count) are not planned on
spec hardware yet: each is refused in one line, before the script runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd
from tabulate import tabulate

from autotuner.app.plan_row import candidate_row
from autotuner.app.pipeline_plan import (PipelineCensus, check_pipeline_costed, pipeline_degrees, pipeline_rows,
                                         pipeline_schedules)
from autotuner.config import load_config
from autotuner.config.hardware import HardwareSpec, load_hardware
from autotuner.core.errors import ConfigError, UsageError
from autotuner.launch.script_args import config_path, replace_config, set_flag

DEFAULT_COMPUTE_EFFICIENCY = {"cuda": 0.6495,  # torchtitan's Llama 2 13B FSDP2 row on 64 A100s (published_table.md)
                              "cpu": 1.0}  # host_spec.py measures the peak a core's matmuls reach
DEFAULT_PROCESS_OVERHEAD = {"cuda": 2**30, "cpu": 0}
CENSUS_SIZES = (1, 2)
CENSUS_TIMEOUT_S = 900
PLAN_FILE = "plan.csv"


@dataclass(frozen=True)
class Census:
    """One micro-batch's count: the model's parameters, its operators and the bytes it saves."""

    micro_batch_size: int
    num_params: int
    records: tuple
    activation_bytes: int
    activation_bytes_by_policy: dict[str, int]
    sequence_length: int
    blocks: int  # the model's repeated blocks: the units FSDP2 shards one by one
    split: dict[str, float]  # what the tensor-parallel plan splits, at degree 1 (SplitRegions' fields)
    degrees: tuple[int, ...]  # of the degrees asked, those the plan can split the model over
    resident_bytes: int  # the script's process when it called initialize: its imports and data, no model
    parameter_tensors: int
    pipeline: Any = None  # a PipelineModule's count, layer by layer (pipeline_plan.PipelineCensus); None without


def _run_census(script: str, script_args: tuple[str, ...], config: dict[str, Any], micro: int, world: int,
                workdir: Path, debug: bool, mappings: dict[str, str], degrees: tuple[int, ...]) -> Census:
    ds = workdir / f"census_mbs{micro}.json"
    # A script that takes the batch as its own flags (arg_mappings) gets them there too, as a tune's launches do;
    # a searched pipeline is counted as one stage holding every layer (the plan splits the count).
    for key, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", 1),
                       ("pipeline.stages", 1)):
        if key in mappings:
            script_args = set_flag(script_args, mappings[key], str(value))
    ds.write_text(json.dumps({**config, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                              "train_batch_size": None}))
    record = workdir / f"census_mbs{micro}.record.json"
    env = {**os.environ, "AUTOTUNER_CENSUS_RECORD": str(record), "AUTOTUNER_CENSUS_WORLD": str(world),
           "AUTOTUNER_CENSUS_DEGREES": ",".join(map(str, degrees)), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "autotuner.runtime.measure.census_run", script,
               *replace_config(script_args, str(ds))]
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        out, err = child.communicate(timeout=CENSUS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # its process group: the script's own children too
        child.communicate()
        raise UsageError(f"--hardware: the script's census at micro-batch {micro} ran past {CENSUS_TIMEOUT_S} s"
                         ) from None
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    if child.returncode != 0 or not record.exists():
        lines = [line for line in err.splitlines() if line.strip()]
        said = next((line.split("error: ", 1)[1] for line in reversed(lines) if "error: " in line), None)
        if debug:
            print(err, file=sys.stderr)
        if said is not None and child.returncode == 2:
            raise ConfigError(said)
        last = said or (lines[-1] if lines else f"exit status {child.returncode}")
        raise UsageError(f"--hardware: {script} failed in the plan's census on the meta device at micro-batch {micro}: "
                         f"{last}")
    data = json.loads(record.read_text())
    return Census(micro, int(data["num_params"]), tuple(tuple(r) for r in data["records"]),
                  int(data["activation_bytes"]), {k: int(v) for k, v in data["activation_bytes_by_policy"].items()},
                  int(data["sequence_length"]), int(data["blocks"]), dict(data.get("split") or {}),
                  tuple(int(d) for d in data.get("degrees") or ()), int(data.get("resident_bytes", 0)),
                  int(data.get("parameter_tensors", 1)),
                  PipelineCensus.from_record(data["pipeline"]) if data.get("pipeline") else None)


def _records_at(one: Census, two: Census, micro: int) -> list:
    """Each operator's cost at `micro`, on the line through its two counts. The two runs are aligned
    by operator (a reshape may copy at one size and not the other); an operator only one of them ran
    is scaled from its own count, in proportion to the micro-batch."""
    from difflib import SequenceMatcher

    from autotuner.runtime.measure.op_census import OpRecord

    def line(a, b):  # (flops, bytes) of records a (micro-batch 1) and b (2) at `micro`
        return OpRecord(a[0], max(0.0, a[1] + (b[1] - a[1]) * (micro - 1)),
                        max(0.0, a[2] + (b[2] - a[2]) * (micro - 1)), a[3], a[4])

    def scaled(r, size):
        return OpRecord(r[0], r[1] * micro / size, r[2] * micro / size, r[3], r[4])

    out = []
    matcher = SequenceMatcher(None, [r[0] for r in one.records], [r[0] for r in two.records], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out.extend(line(a, b) for a, b in zip(one.records[i1:i2], two.records[j1:j2]))
        else:
            out.extend(scaled(r, one.micro_batch_size) for r in one.records[i1:i2])
            out.extend(scaled(r, two.micro_batch_size) for r in two.records[j1:j2])
    return out


def _check_costed(config, source: str, spec: HardwareSpec) -> None:
    """What would train differently from what the plan costs is refused, never left unused: CPU
    offload (not costed), an optimizer other than Adam's two fp32 moments, fp32 compute on a spec
    without an fp32 peak."""
    zero = config.zero_optimization
    for name in ("offload_optimizer", "offload_param"):
        section = getattr(zero, name)
        if section is not None and section.device != "none":
            raise ConfigError(f"{source}: zero_optimization.{name}.device {section.device!r}: --hardware does not cost "
                              "CPU offload yet; leave it out (or \"none\") to plan")
    if config.optimizer is not None and config.optimizer.type.lower() not in ("adam", "adamw"):
        raise ConfigError(f"{source}: optimizer.type {config.optimizer.type}: --hardware costs Adam's and AdamW's "
                          "states and step only so far")
    if config.precision == "fp32" and spec.peak_fp32_flops is None:
        raise ConfigError(f"{source}: bf16.enabled false: fp32 compute is costed at the spec's peak_fp32_flops, which "
                          f"{spec.name!r} does not give; add it to the spec, or enable bf16 to plan")


def _degrees(config, nproc_per_node: int, source: str) -> tuple[int, ...]:
    """The tensor-parallel degrees to plan, inside a node: "auto" every divisor of the ranks a
    node, a list those listed, a number that one; 1 where the config sets none."""
    size = config.tensor_parallel.autotp_size
    if size == "auto":
        return tuple(d for d in range(1, nproc_per_node + 1) if nproc_per_node % d == 0)
    listed = tuple(size) if isinstance(size, list) else (max(1, size),)
    for degree in listed:
        if nproc_per_node % degree:
            raise ConfigError(f"{source}: tensor_parallel.autotp_size: {degree} does not divide --nproc_per_node "
                              f"{nproc_per_node}; a tensor-parallel group stays inside a node")
    return tuple(sorted(set(listed)))


def _check_engine(script: str, requested: str) -> None:
    """The census counts our engine's step: a script settled on DeepSpeed's engine (its imports, or
    --engine deepspeed) is refused before it runs, not counted as a step it would not take."""
    from autotuner.app.engines import Engine, engine_choice, imports_deepspeed_itself

    choice = engine_choice(script, requested)
    if choice.settled and choice.engine == Engine.DEEPSPEED:
        instead = (" (or change its `import deepspeed` to `import autotuner as deepspeed`, which trains it on ours)"
                   if imports_deepspeed_itself(choice, script) else "")
        raise UsageError(f"--hardware: {choice.why}; a plan for hardware not here counts our engine's step only so "
                         f"far; plan it with --autotuning plan on the hardware at hand{instead}")


def hardware_plan(script: str, script_args: tuple[str, ...], hardware: str, num_nodes: int, nproc_per_node: int,
                  debug: bool = False, engine: str = "auto") -> int:
    spec = load_hardware(hardware)
    _check_engine(script, engine)
    if nproc_per_node > spec.accelerators_per_node and spec.device != "cpu":  # (CPU ranks share the cores)
        raise UsageError(f"--nproc_per_node {nproc_per_node}: {spec.name} nodes hold {spec.accelerators_per_node} "
                         f"accelerators ({hardware}); give at most that many a node, and more nodes")
    world = num_nodes * nproc_per_node
    given = config_path(script_args)
    if given is None:
        raise UsageError("--autotuning plan --hardware needs the script's config: add --deepspeed ds.json after the "
                         "script")
    # bf16 "auto" settles as a launch on the spec's device would: on for a GPU, off on our CPU launches
    config = load_config(given).with_device_precision(bf16_supported=spec.device != "cpu")
    source = str(given)
    _check_costed(config, source, spec)
    degrees = _degrees(config, nproc_per_node, source)
    from autotuner.tuning.space.config_space import search_space

    raw = json.loads(json.dumps(config.dump(by_alias=True)))
    raw.pop("autotuning", None)  # the census runs one plain step: what a tune searches is settled to its neutral value
    raw["zero_optimization"] = {**(raw.get("zero_optimization") or {}), "stage": 0}
    raw["activation_checkpointing"] = {**(raw.get("activation_checkpointing") or {}), "policy": "none"}
    raw["tensor_parallel"] = {**(raw.get("tensor_parallel") or {}), "autotp_size": 0}  # degree 1 counts what k splits
    if "pipeline.stages" in config.autotuning.arg_mappings:  # (the census counts one stage holding every layer)
        raw["pipeline"] = {**(raw.get("pipeline") or {}), "stages": "auto", "schedule": "1F1B", "stages_per_rank": None}
    with tempfile.TemporaryDirectory(prefix="autotuner_census_") as directory:
        mappings = dict(config.autotuning.arg_mappings)
        one, two = (_run_census(script, script_args, raw, micro, world, Path(directory), debug, mappings,
                                tuple(d for d in degrees if d > 1)) for micro in CENSUS_SIZES)
    unsplittable = [d for d in degrees if d > 1 and d not in one.degrees]
    if unsplittable:
        raise ConfigError(f"{source}: tensor_parallel.autotp_size: the model cannot be split over {unsplittable[0]} "
                          "ranks (the tensor-parallel plan takes whole heads, and needs Linears it knows); list "
                          f"degrees it can take{', such as ' + ', '.join(map(str, one.degrees)) if one.degrees else ''}")
    check_pipeline_costed(config, one.pipeline, degrees, script, source)
    if one.pipeline is not None:
        stage_counts = pipeline_degrees(config, world, one.pipeline, source)
        schedules = pipeline_schedules(config, source)

    def rows_at(efficiency: float) -> list[dict]:
        if one.pipeline is None:
            return [row for degree in degrees
                    for row in plan_rows(spec, config, search_space(config, world // degree), one, two, world, degree,
                                         nproc_per_node, efficiency)]
        overhead, budget = rank_budget(spec, one, world, nproc_per_node)
        searched = "pipeline.stages" in config.autotuning.arg_mappings
        return [row for pp in stage_counts for schedule, v in (schedules if pp > 1 else schedules[:1])
                for row in pipeline_rows(spec, config, search_space(config, world // pp), one.pipeline, two.pipeline,
                                         one.num_params, one.sequence_length,
                                         lambda micro: _records_at(one, two, micro), world, pp, schedule, v,
                                         searched, overhead, budget, nproc_per_node, efficiency)]

    efficiency, said = spec.compute_efficiency, "stated"
    if spec.calibrate is not None:
        efficiency, said = fitted_efficiency(rows_at, spec, hardware)
    elif efficiency is None:
        efficiency, said = DEFAULT_COMPUTE_EFFICIENCY[spec.device], "default"
    rows = rows_at(efficiency)
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        # (ties, as ZeRO 2 and 3 compute-bound alike, to the one holding less)
        max(fitting, key=lambda r: (r["predicted_samples_per_s"], -r["predicted_memory_bytes"]))["picked"] = True
    results = Path(config.autotuning.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(rows)
    table.to_csv(results / PLAN_FILE, index=False)
    print(plan_text(spec, table, world, num_nodes, one, said), end="")
    print(f"autotuner: plan written to {results / PLAN_FILE}", file=sys.stderr)
    return 0


def fitted_efficiency(rows_at, spec: HardwareSpec, source: str) -> tuple[float, str]:
    """The compute efficiency at which the spec's `calibrate` layout takes its measured step: a
    step's time falls as the efficiency rises, so bisection finds it."""
    wanted, measured = spec.calibrate.layout, spec.calibrate.step_s
    names = [row["name"] for row in rows_at(1.0)]
    if wanted not in names:
        raise ConfigError(f"--hardware {source}: calibrate.layout {wanted!r}: not a layout of this plan; its layouts "
                          f"are {', '.join(names)}")
    step = lambda efficiency: next(r["predicted_step_s"] for r in rows_at(efficiency) if r["name"] == wanted)  # noqa: E731
    low, high = 1e-4, 1.0
    if step(high) > measured:
        raise ConfigError(f"--hardware {source}: calibrate.step_s {measured:g}: {wanted} would take {step(high):.4g} s "
                          "a step even at the spec's full peak; the spec's peak, bandwidth or links are too low for "
                          "what was measured")
    if step(low) < measured:
        raise ConfigError(f"--hardware {source}: calibrate.step_s {measured:g}: {wanted} is slower than the spec "
                          f"explains at any compute efficiency over {low:g} (its collectives or overheads are too low)")
    for _ in range(50):
        middle = (low * high) ** 0.5  # (geometric: the efficiency spans decades)
        low, high = (middle, high) if step(middle) > measured else (low, middle)
    efficiency = (low * high) ** 0.5
    return efficiency, f"fitted on {wanted}'s {measured:.4g} s a step"


def rank_budget(spec: HardwareSpec, one: Census, world: int, ranks_per_node: int | None) -> tuple[int, int]:
    """(a rank's memory besides the model, the memory a rank may use). Besides the model: the spec's
    process overhead, and on a CPU spec also the script's own resident set, as the census measured
    it (a rank's memory there is its resident set). A CPU node's memory is shared by its ranks."""
    from autotuner.tuning.memory.estimate import usable_bytes
    from autotuner.tuning.models.memory_book import SAFETY_MARGIN

    overhead = int(DEFAULT_PROCESS_OVERHEAD[spec.device] if spec.process_overhead_bytes is None
                   else spec.process_overhead_bytes)
    rank_memory = int(spec.memory_bytes)
    if spec.device == "cpu":
        overhead += one.resident_bytes
        rank_memory //= max(1, ranks_per_node or min(world, spec.accelerators_per_node))
    return overhead, usable_bytes(rank_memory, SAFETY_MARGIN)  # the tuner's own margin (memory_book.py)


def plan_rows(spec: HardwareSpec, config, space, one: Census, two: Census, world: int, degree: int,
              ranks_per_node: int | None = None, efficiency: float | None = None) -> list[dict]:
    """Every candidate of `space` (data parallel over world / degree) at tensor-parallel `degree`."""
    from autotuner.tuning.memory.degree_prediction import profile_at_degree
    from autotuner.tuning.memory.estimate import ModelProfile, StageSettings, estimate
    from autotuner.tuning.models.hardware_step import TensorParallel, step_prediction

    if efficiency is None:
        efficiency = spec.compute_efficiency or DEFAULT_COMPUTE_EFFICIENCY[spec.device]
    overhead, budget = rank_budget(spec, one, world, ranks_per_node)
    per_sample = {policy: two.activation_bytes_by_policy.get(policy, 0) - one.activation_bytes_by_policy.get(policy, 0)
                  for policy in one.activation_bytes_by_policy}
    plain = two.activation_bytes - one.activation_bytes
    precision = config.precision
    tp = TensorParallel()
    split_per_sample = 0
    if degree > 1:
        a, b = one.split, two.split
        tp = TensorParallel(degree, int(a["params"]), float(a["flop_share"]), int(a["row_layers"]), 0.0,
                            int(a.get("col_layers", 0)))
        split_per_sample = int(b["saved_bytes"]) - int(a["saved_bytes"])
        row_bytes = (float(a["row_output_bytes"]), float(b["row_output_bytes"]) - float(a["row_output_bytes"]))
    dp = world // degree
    rows = []
    for stage in space.stages:
        for micro in space.valid_micro_batch_sizes(space.max_micro_batch_size):
            gas = space.gas(micro)
            records = _records_at(one, two, micro)
            for variant in space.variants_for(stage):
                policy = str(dict(variant).get("activation_checkpointing", config.activation_checkpointing.policy))
                held = per_sample.get(policy, plain)
                profile = ModelProfile(num_params=one.num_params, activation_bytes_per_sample=held,
                                       baseline_bytes=overhead, num_shard_units=one.blocks)
                if degree > 1:  # the split regions' share of the saved bytes, over k (degree_prediction.py)
                    # (full checkpointing keeps the blocks' inputs, which no plan splits; selective
                    # its matmul outputs, split in the share the plain forward's are)
                    split = {"none": split_per_sample, "full": 0}.get(policy, split_per_sample * held // max(1, plain))
                    profile = profile_at_degree(replace(profile, splittable_num_params=tp.split_params,
                                                        split_activation_bytes_per_sample=min(held, split)), degree)
                    tp = replace(tp, row_output_bytes=row_bytes[0] + row_bytes[1] * (micro - 1))
                settings = StageSettings(stage, precision, dp, gradient_accumulation_steps=gas,
                                         activation_policy="none")
                memory = estimate(profile, settings, micro).total
                tokens = micro * max(1, one.sequence_length)
                step = step_prediction(records, one.num_params, world, stage, gas, tokens, policy, spec, efficiency, tp,
                                       precision, ranks_per_node, one.blocks + 1, one.parameter_tensors)
                name = (f"z{stage}" + (f"_tp{degree}" if degree > 1 else "") + (f"_ac{policy}" if policy != "none"
                                                                                 else "") + f"_gas{gas}_mbs{micro}")
                rows.append(candidate_row(name, stage, degree, 1, micro, gas, dp, policy, memory, budget, step,
                                          efficiency))
    return rows


def plan_text(spec: HardwareSpec, table: pd.DataFrame, world: int, num_nodes: int, one: Census,
              efficiency_said: str = "stated") -> str:
    shown = table.sort_values("predicted_samples_per_s", ascending=False)
    if one.pipeline is not None:
        split = "pipeline stages " + ", ".join(str(d) for d in sorted(set(table["pp"])))
    else:
        split = "tensor parallel " + ", ".join(str(d) for d in sorted(set(table["tp"])))
    lines = [f"plan for {num_nodes} node(s) x {world // max(1, num_nodes)} {spec.name} ({world} ranks; {split}, "
             "data parallel over the rest): "
             f"{one.num_params:,} parameters, counted on the meta device; compute efficiency "
             f"{float(table['compute_efficiency'].iloc[0]):.4g} "
             f"({efficiency_said}), memory {spec.memory_bytes / 2**30:.0f} GiB "
             f"{'a node, shared by its ranks' if spec.device == 'cpu' else 'a rank'}"]
    view = shown[["name", "fits", "predicted_memory_bytes", "predicted_step_s", "predicted_samples_per_s",
                  "predicted_mfu"]].copy()
    view["predicted_memory_bytes"] = (view["predicted_memory_bytes"] / 2**30).round(1)
    view = view.rename(columns={"predicted_memory_bytes": "memory GiB", "predicted_step_s": "step s",
                                "predicted_samples_per_s": "samples/s", "predicted_mfu": "MFU"})
    lines.append(tabulate(view, headers="keys", tablefmt="pipe", showindex=False, floatfmt=".4g"))
    picked = table[table["picked"]]
    if len(picked):
        best = picked.iloc[0]
        lines.append(f"predicted pick: {best['name']} at {best['predicted_samples_per_s']:.4g} samples/s "
                     f"({best['predicted_memory_bytes'] / 2**30:.1f} GiB a rank)")
    else:
        lines.append("predicted pick: none fits; every candidate is out of memory")
    return "\n".join(lines) + "\n"
