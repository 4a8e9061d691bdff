"""Pipeline layouts in `--autotuning plan --hardware` (issue 80, part 3): a script that trains a
PipelineModule with train_batch(), counted layer by layer on the meta device
(runtime/pipeline/census.py), its layers split into stages by the module's own partition_method,
each stage costed by its layers: its memory by the memory model's pipeline stages
(tuning/memory/pipeline_stages.py: the parameters its ranks hold, the activations of the
micro-batches the schedule keeps in flight there, the heaviest stage deciding), its time by
tuning/models/hardware_pipeline.py.

Which stage counts are planned, as a tune searches them: with `pipeline.stages` in arg_mappings,
"auto" every divisor of the ranks (those the layers can fill), a list those listed, a number that
one; without, the script's own count (a config number must agree with it, as initialize checks).
Schedules: 1F1B and GPipe (one stage a rank), Interleaved1F1B and LoopedBFS (stages_per_rank, 2
where left out), "auto" both 1F1B and Interleaved1F1B as a tune searches them; the zero-bubble
schedules (their split backward) are not costed yet and are refused in one line. ZeRO 0 and 1
only, as the pipeline engine runs. Not planned yet: a pipeline with tensor parallelism inside its
stages, and activation checkpointing in it (PipelineModule's activation_checkpoint_interval)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from autotuner.app.plan_row import candidate_row
from autotuner.core.errors import ConfigError

COSTED_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved1f1b": "Interleaved1F1B", "loopedbfs": "LoopedBFS"}
CHUNKED = ("Interleaved1F1B", "LoopedBFS")


@dataclass(frozen=True)
class LayerCount:
    """One layer of the census at one micro-batch."""

    name: str
    trainable_params: int  # what "parameters" partitioning weighs (a tied layer's at each place)
    held_params: int  # what building it adds (0 for a tied layer: its module is counted by key)
    held_tensors: int
    tied: str | None
    saved_bytes: int
    output_bytes: int


@dataclass(frozen=True)
class PipelineCensus:
    layers: tuple[LayerCount, ...]
    tied: dict[str, tuple[int, int]]  # key: (parameters, tensors) of the module
    partition_method: str
    script_stages: int
    checkpoint_interval: int

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> "PipelineCensus":
        layers = tuple(LayerCount(str(layer["name"]), int(layer["trainable_params"]), int(layer["held_params"]),
                                  int(layer["held_tensors"]), layer["tied"], int(layer["saved_bytes"]),
                                  int(layer["output_bytes"])) for layer in data["layers"])
        return cls(layers, {key: (int(v[0]), int(v[1])) for key, v in data["tied"].items()},
                   str(data["partition_method"]), int(data["script_stages"]),
                   int(data["activation_checkpoint_interval"]))


def pipeline_degrees(config, world: int, census: PipelineCensus, source: str) -> tuple[int, ...]:
    stages = config.pipeline.stages
    searched = "pipeline.stages" in config.autotuning.arg_mappings
    if not searched:
        if isinstance(stages, list):
            raise ConfigError(f"{source}: pipeline.stages: a list is searched only where autotuning.arg_mappings maps "
                              "pipeline.stages to the script's flag; give one number, or map it")
        if isinstance(stages, int) and stages != census.script_stages:
            raise ConfigError(f"{source}: pipeline.stages {stages}: the script's PipelineModule built "
                              f"{census.script_stages} stages; make them agree (or leave pipeline.stages \"auto\")")
        listed = (census.script_stages,)
    elif stages == "auto":
        layers = len(census.layers)
        return tuple(d for d in range(1, world + 1) if world % d == 0 and d <= layers)
    else:
        listed = tuple(stages) if isinstance(stages, list) else (stages,)
    for degree in listed:
        if world % degree:
            raise ConfigError(f"{source}: pipeline.stages: {degree} does not divide the {world} ranks planned for")
        if degree > len(census.layers):
            raise ConfigError(f"{source}: pipeline.stages: {degree} stages for the PipelineModule's "
                              f"{len(census.layers)} layers; a stage needs at least one layer")
    return tuple(sorted(set(listed)))


def pipeline_schedules(config, source: str) -> tuple[tuple[str, int], ...]:
    """(schedule, stages per rank) to plan: the config's, or under "auto" the two a tune searches."""
    from autotuner.config.pipeline import DEFAULT_STAGES_PER_RANK

    asked = config.pipeline.schedule
    chunks = config.pipeline.stages_per_rank or DEFAULT_STAGES_PER_RANK
    if asked.lower() == "auto":
        return (("1F1B", 1), ("Interleaved1F1B", chunks))
    name = COSTED_SCHEDULES.get(asked.lower())
    if name is None:
        raise ConfigError(f"{source}: pipeline.schedule {asked!r}: --hardware costs 1F1B, GPipe, Interleaved1F1B and "
                          "LoopedBFS so far (a zero-bubble schedule's split backward is not costed yet)")
    return ((name, chunks if name in CHUNKED else 1),)


def _at(one: int, two: int, micro: int) -> float:
    """A count at `micro` on the line through its counts at micro-batch 1 and 2."""
    return max(0.0, one + (two - one) * (micro - 1))


def pipeline_ranks(census_one: PipelineCensus, census_two: PipelineCensus, records: list, pp: int, v: int, micro: int):
    """(PipelineRanks, per-rank activation bytes a sample, the backward's records) for `pp` ranks of
    `v` chunks each, split by the module's partition_method; None where a chunk would get no layer."""
    from autotuner.runtime.pipeline.partition import parts_for
    from autotuner.tuning.models.hardware_pipeline import PipelineRanks

    layers = census_one.layers
    parts = parts_for(census_one.partition_method, [layer.name for layer in layers],
                      [layer.trainable_params for layer in layers], pp * v)
    if any(parts[c] == parts[c + 1] for c in range(pp * v)):
        return None
    rank_of_layer = [0] * len(layers)
    for chunk in range(pp * v):
        for index in range(parts[chunk], parts[chunk + 1]):
            rank_of_layer[index] = chunk % pp  # looped, as torch's interleaved schedules place chunks
    last = rank_of_layer[-1]
    forward: list[list] = [[] for _ in range(pp)]
    backward = []
    for record in records:
        if record.phase != "forward":
            backward.append(record)
        else:  # the loss, after the last layer, runs on the last layer's rank
            forward[last if record.block is None else rank_of_layer[record.block]].append(record)
    params, tensors, per_sample = [0] * pp, [0] * pp, [0] * pp
    tied_ranks: dict[str, set[int]] = {}
    for index, (a, b) in enumerate(zip(layers, census_two.layers)):
        rank = rank_of_layer[index]
        params[rank] += a.held_params
        tensors[rank] += a.held_tensors
        per_sample[rank] += b.saved_bytes - a.saved_bytes
        if a.tied is not None:
            tied_ranks.setdefault(a.tied, set()).add(rank)
    for key, holders in tied_ranks.items():
        for rank in holders:  # each rank that runs a tied layer holds its module once
            params[rank] += census_one.tied[key][0]
            tensors[rank] += census_one.tied[key][1]
    boundaries = [parts[c] - 1 for c in range(1, pp * v)]
    boundary = max((_at(layers[i].output_bytes, census_two.layers[i].output_bytes, micro) for i in boundaries),
                   default=0.0)
    shared = sum(census_one.tied[key][0] for key, holders in tied_ranks.items() if len(holders) > 1)
    ranks = PipelineRanks(tuple(tuple(f) for f in forward), tuple(params), tuple(tensors), boundary, shared)
    return ranks, tuple(max(0, s) for s in per_sample), backward


def pipeline_rows(spec, config, space, census_one: PipelineCensus, census_two: PipelineCensus, num_params: int,
                  sequence_length: int, records_at: Callable[[int], list], world: int, pp: int, schedule: str, v: int,
                  searched: bool, overhead: int, budget: int, ranks_per_node: int | None,
                  efficiency: float) -> list[dict]:
    """Every candidate of `space` (ZeRO 0-1 x micro-batch x gas) at `pp` stages under `schedule`."""
    from autotuner.tuning.memory.estimate import ModelProfile, StageSettings, estimate
    from autotuner.tuning.models.hardware_pipeline import pipeline_step_prediction
    from autotuner.tuning.space.layout import Layout

    v = v if pp > 1 else 1
    space = space.at_layout(Layout(0, pp, v if v > 1 else 0), world)
    tag = Layout(0, pp if searched else 0, v if v > 1 else 0).tag()
    dp = world // pp
    rows = []
    for stage in space.stages:
        for micro in space.valid_micro_batch_sizes(space.max_micro_batch_size):
            gas = space.gas(micro)
            if gas is None:
                continue
            placed = pipeline_ranks(census_one, census_two, records_at(micro), pp, v, micro)
            if placed is None:
                continue
            ranks, per_sample, backward = placed
            profile = ModelProfile(num_params=num_params, activation_bytes_per_sample=max(per_sample),
                                   baseline_bytes=overhead, pipeline_stage_params=ranks.params,
                                   pipeline_stage_activation_bytes_per_sample=per_sample,
                                   pipeline_schedule=schedule, pipeline_stages_per_rank=v)
            settings = StageSettings(stage, config.precision, dp, gradient_accumulation_steps=gas,
                                     activation_policy="none")
            memory = estimate(profile, settings, micro).total
            step = pipeline_step_prediction(ranks, backward, world, v, stage, gas, micro * max(1, sequence_length),
                                            spec, efficiency, config.precision, ranks_per_node)
            rows.append(candidate_row(f"z{stage}{tag}_gas{gas}_mbs{micro}", stage, 1, pp, micro, gas, dp, "none",
                                      memory, budget, step, efficiency, " (its heaviest stage)",
                                      pipeline_schedule=schedule, stages_per_rank=v))
    return rows


def check_pipeline_costed(config, census: PipelineCensus | None, degrees: tuple[int, ...], script: str,
                          source: str) -> None:
    """A searched pipeline on a script that built none, and what a pipeline plan does not cost yet,
    refused in one line."""
    if census is None:
        if "pipeline.stages" in config.autotuning.arg_mappings:
            raise ConfigError(f"{source}: autotuning.arg_mappings.pipeline.stages: {script} built no PipelineModule "
                              "(it trains data parallel); leave the mapping out, or build the model as a "
                              "PipelineModule trained with train_batch()")
        return
    if not any(stage <= 1 for stage in config.zero_optimization.stages):
        raise ConfigError(f"{source}: zero_optimization.stage: the pipeline engine runs ZeRO 0 and 1 only (as "
                          "DeepSpeed's does); give 0 or 1 among the stages to plan the pipeline")
    policy = config.activation_checkpointing.policy
    if policy not in (None, "none", "auto", ["none"]):  # ("auto": settled to none at a pipeline, as a tune does)
        raise ConfigError(f"{source}: activation_checkpointing.policy {policy!r}: the pipeline engine takes no "
                          "checkpointing policy (PipelineModule's activation_checkpoint_interval is its way); leave "
                          'it "none" to plan the pipeline')
    if any(d > 1 for d in degrees):
        raise ConfigError(f"{source}: tensor_parallel.autotp_size: --hardware plans a pipeline's stages without tensor "
                          "parallelism inside them so far; leave autotp_size out to plan the pipeline")
    interval = config.pipeline.activation_checkpoint_interval or census.checkpoint_interval
    if interval:
        raise ConfigError(f"{source}: pipeline.activation_checkpoint_interval {interval}: --hardware does not cost a "
                          "pipeline's activation checkpointing yet; set it to 0 to plan")

