"""The layouts a tune runs, settled before any launch: the tensor-parallel degrees
(tensor_parallel_checks.py) crossed with the pipeline stages, each kept or left out with the
reason said; what a pipeline tune cannot carry refused.

The pipeline stages reach a script the way DeepSpeed's users give them, as the script's own flag
(DeepSpeedExamples' `-p`, which it passes to PipelineModule(num_stages=...)): so a tune sets them
only where `autotuning.arg_mappings` maps `pipeline.stages` to that flag. Then `"auto"` searches
every divisor of the ranks (a pipeline may span nodes), a list those listed, a number fixes it in
every experiment. Without the mapping, `pipeline.stages` keeps DeepSpeed's meaning: the script's
PipelineModule decides, and a number is checked against what it built."""

from __future__ import annotations

import json
from itertools import product
from typing import Callable

from autotuner.app.engines import EngineChoice
from autotuner.app.tensor_parallel_checks import at_degree, check_layout_tune, settled_degrees
from autotuner.config.batch import check_fixed_triad
from autotuner.config.models import DeepSpeedConfig
from autotuner.config.pipeline import DEFAULT_STAGES_PER_RANK, runs_several_stages
from autotuner.core.errors import ConfigError
from autotuner.tuning.space.layout import PIPELINE_KEY, Layout
from autotuner.tuning.space.search_space import SearchSpace


def pipeline_set_by_tune(config: DeepSpeedConfig) -> bool:
    return PIPELINE_KEY in config.autotuning.arg_mappings


def settled_stages(config: DeepSpeedConfig, world_size: int, source: str) -> tuple[int, ...]:
    """The pipeline stages the tune sets in its experiments: () where it sets none."""
    stages = config.pipeline.stages
    if not pipeline_set_by_tune(config):
        if isinstance(stages, list):
            raise ConfigError(f"{source}: pipeline.stages: got {json.dumps(stages)}; a search of the stages needs "
                              f"them to reach the script: map {PIPELINE_KEY} to its flag in autotuning.arg_mappings "
                              f"(DeepSpeedExamples' pipeline script: \"{PIPELINE_KEY}\": \"-p\")")
        return ()
    if stages == "auto":
        return tuple(d for d in range(1, world_size + 1) if world_size % d == 0)
    listed = stages if isinstance(stages, list) else [stages]
    for count in listed:
        if world_size % count:
            raise ConfigError(f"{source}: pipeline.stages: {count} in {json.dumps(stages)} does not divide the number "
                              f"of ranks ({world_size}); list divisors of it, or give \"auto\"")
    return tuple(sorted(set(listed)))


def pipeline_searched(config: DeepSpeedConfig) -> bool:
    return pipeline_set_by_tune(config) and not isinstance(config.pipeline.stages, int)


def settled_chunks(config: DeepSpeedConfig, source: str) -> tuple[int, ...]:
    """The virtual stages per rank a pipeline layout runs (0: one stage per rank): the config's
    count under a schedule of several, and under `schedule: "auto"` one stage per rank (1F1B)
    and the count (2 where left out) under Interleaved1F1B, each a layout of its own."""
    pipeline = config.pipeline
    given = pipeline.stages_per_rank or DEFAULT_STAGES_PER_RANK
    if pipeline.schedule == "auto":
        if not pipeline_set_by_tune(config):
            raise ConfigError(f"{source}: pipeline.schedule \"auto\": a tune searches the schedule with the stages, "
                              f"which reach the script through its flag: map {PIPELINE_KEY} to it in "
                              "autotuning.arg_mappings, or name a schedule")
        if given < 2:
            raise ConfigError(f"{source}: pipeline.stages_per_rank {given}: \"auto\" searches 1F1B against "
                              "Interleaved1F1B at this many stages per rank; give 2 or more, or leave it out (2)")
        return 0, given
    if pipeline.schedule.lower() in ("zbvzerobubble", "dualpipev"):
        raise ConfigError(f"{source}: pipeline.schedule {pipeline.schedule}: a tune does not cost a V's placement (its "
                          "fill below 2 x stages micro-batches, DualPipeV's forward and backward run together); tune "
                          "with InterleavedZeroBubble or Interleaved1F1B (or \"auto\"), then train with this schedule")
    if runs_several_stages(pipeline.schedule):
        return (given,)
    if pipeline.stages_per_rank not in (None, 1):  # (the ranks refuse it too, after a launch)
        raise ConfigError(f"{source}: pipeline.stages_per_rank {pipeline.stages_per_rank}: schedule "
                          f"{pipeline.schedule!r} runs one stage per rank; name a schedule of several "
                          "(Interleaved1F1B, LoopedBFS), or \"auto\", or leave it out")
    return (0,)


def settled_layouts(config: DeepSpeedConfig, world_size: int, ranks_per_node: int,
                    source: str) -> tuple[tuple[Layout, ...], bool]:
    """The layouts the tune runs and whether it searches them (several, or a search asked for):
    each tensor-parallel degree with each pipeline stage count and stages per rank, in that order
    (the degree inner)."""
    degrees = settled_degrees(config, world_size, ranks_per_node, source)
    tp_searched = config.tensor_parallel.searched
    stages = settled_stages(config, world_size, source) or (0,)
    chunks = settled_chunks(config, source)
    if not tp_searched:
        degrees = tuple(d if d > 1 else 0 for d in degrees)  # a degree of 1 not searched: the config's layout
    # (one stage on a single pipeline rank: a schedule of several has nothing to interleave there)
    layouts = tuple(dict.fromkeys(Layout(tp, pp, v if pp > 1 else 0)
                                  for pp, v, tp in product(stages, chunks, degrees)))
    return layouts, tp_searched or pipeline_searched(config) or len(chunks) > 1


def check_pipeline_tune(config: DeepSpeedConfig, engine: EngineChoice, source: str) -> None:
    """A tune that sets the pipeline stages: our engine's pipeline, and what it refuses there
    refused before any launch."""
    check_layout_tune(config, engine, source, f"autotuning.arg_mappings.{PIPELINE_KEY}", "a pipeline tune",
                      "in a pipeline")


def at_layout(config: DeepSpeedConfig, layout: Layout) -> DeepSpeedConfig:
    """The config as an experiment at `layout` reads it."""
    if layout.tensor_parallel:
        config = at_degree(config, layout.tensor_parallel)
    if layout.pipeline:
        config = config.model_copy(update={"pipeline": config.pipeline.model_copy(update={"stages": layout.pipeline})})
    return config


def _why_not(config: DeepSpeedConfig, space: SearchSpace, layout: Layout, ranks: int, source: str,
             batch_is_valid: Callable[[SearchSpace, int, str], None]) -> str | None:
    at = space.at_layout(layout, ranks)
    if not at.stages:
        return (f"zero_optimization.stage {json.dumps(list(space.stages))}: ZeRO 2 and 3 are not supported with "
                "pipeline parallelism (DeepSpeed refuses them too)")
    try:
        # A pipeline's triad is counted over the world / (stages x tp); a degree alone's as the launch counts it.
        check_fixed_triad(at_layout(config, layout), ranks if layout.pipeline > 1 else at.data_parallel_size, source)
        batch_is_valid(at, at.data_parallel_size, source)
    except ConfigError as err:
        return str(err).removeprefix(source + ": ")
    return None


def kept_layouts(config: DeepSpeedConfig, space: SearchSpace, layouts: tuple[Layout, ...], ranks: int, source: str,
                 say: Callable[[str], None], batch_is_valid: Callable[[SearchSpace, int, str], None]
                 ) -> tuple[tuple[Layout, ...], tuple[tuple[Layout, str], ...]]:
    """The searched layouts that have something to run, and (layout, why) for each left out, said;
    none kept is refused with the first layout's reason. `ranks`: what the layouts divide (the
    data-parallel size with no model split); `batch_is_valid` refuses a space with no valid global batch."""
    kept, left_out = [], []
    for layout in layouts:
        why = _why_not(config, space, layout, ranks, source, batch_is_valid)
        if why is None:
            kept.append(layout)
            continue
        left_out.append((layout, why))
        say(f"{layout.text()}: left out ({why})")
    if not kept:
        raise ConfigError(f"{source}: {left_out[0][1]}")
    sizes = ", ".join(str(ranks // layout.model_ranks) for layout in kept)
    if not any(layout.pipeline for layout in kept):
        say(f"tensor parallel: searching degrees {', '.join(str(l.tensor_parallel) for l in kept)} (each profiled at "
            f"its own degree, data-parallel size {sizes})")
    elif not any(layout.tensor_parallel or layout.stages_per_rank for layout in kept):
        say(f"pipeline: searching stages {', '.join(str(l.pipeline) for l in kept)} (each profiled at its own layout, "
            f"data-parallel size {sizes})")
    else:
        say(f"layouts: searching {', '.join(l.text() for l in kept)} (each profiled at its own layout, data-parallel "
            f"size {sizes})")
    return tuple(kept), tuple(left_out)
