"""The tuned dimensions beyond stage × micro-batch × gas: the dimension registry.

A dimension declares what the tuner needs of it: where its value goes in the config (any
section), which values full mode tries for a stage on an engine and device, its tag in experiment
names, its encoding for the tuners and cost models, its memory-model term, its term in the
step-time model, its role in the search and the final pick, its script flag on DeepSpeed's
engine, its refusals (refusals.py) and, for a plugin's, its config section. The space, experiment
names and configs, the tuners' features, the memory book, the step-time model, the planned run,
the variant rules, the config space, the engine choice and its checks, and the checks before a
tune read this table and name no dimension themselves. What the config layer and the ranks must
know (they cannot import this table) is declared at the config layer (config/sections.py: a
section and its tuned keys, refused outside a tune by the launcher and every rank). A plugin adds
one with `register_dimension` (core/plugins.py), which registers its section too; the engine
inside the ranks honours its config key (its engine code: runtime/ for ours, DeepSpeed reads its own).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from autotuner.core.engine_kind import Engine
from autotuner.config.sections import ConfigSection, register_section
from autotuner.config.tuned_values import lookup, write  # noqa: F401 - the config's paths, read and written
from autotuner.tuning.memory.estimate import StageSettings
from autotuner.tuning.space.refusals import (DeepSpeedRefusal, TuneRefusal, compile_before_the_window,
                                             compile_on_deepspeed, policy_on_deepspeed)

MemoryTerm = Callable[[StageSettings, Any], StageSettings]


def log2_number(value: Any) -> float:
    """Sizes on a log scale (a bucket of 1e6 and one of 5e7 are far apart), flags as 0/1."""
    number = float(value)
    return math.log2(number) if number > 1 else number


def zero_knob_term(name: str) -> MemoryTerm:
    """The value joins the zero_optimization settings the engine's state model reads (DeepSpeed's
    buckets, say); our engine's model reads none of them."""

    def term(settings: StageSettings, value: Any) -> StageSettings:
        knobs = {**dict(settings.zero_knobs), name: value}
        return replace(settings, zero_knobs=tuple(sorted(knobs.items())))

    return term


def _offload_optimizer(settings: StageSettings, value: Any) -> StageSettings:
    return replace(settings, offload_optimizer=True) if value == "cpu" else settings


def _offload_param(settings: StageSettings, value: Any) -> StageSettings:
    return replace(settings, offload_param=True) if value == "cpu" else settings


def _is_cpu(value: Any) -> float:
    return float(value == "cpu")


def _bool_text(value: bool) -> str:
    return "true" if value else "false"


CHECKPOINT_POLICIES = ("none", "selective", "full")  # in the order they save memory (and cost recompute)


def _checkpoint_policy(settings: StageSettings, value: Any) -> StageSettings:
    return replace(settings, activation_policy=str(value))


def _policy_rank(value: Any) -> float:
    return float(CHECKPOINT_POLICIES.index(value))


def _same_memory(settings: StageSettings, value: Any) -> StageSettings:
    return settings


@dataclass(frozen=True)
class Dimension:
    name: str  # the key in Experiment.knobs, the journal and the results table
    path: tuple[str, ...]  # where Experiment.apply writes the value in the config
    tag: str  # short form in experiment names (DeepSpeed's autotuner writes rbs/abs likewise)
    values: Mapping[Engine, Mapping[int, tuple[Any, ...]]]  # full mode's values per engine and stage
    memory_term: MemoryTerm
    encode: Callable[[Any], float] = log2_number
    cuda_only: bool = False  # offered on CUDA only (on a CPU everything is host memory already)
    # Config sections whose presence means the user chose (offload: either section fixes both).
    user_sections: tuple[tuple[str, ...], ...] = ()
    # "knob": tuned in full mode on the best stages unless the user fixed it. "variant": changes
    # what fits (the micro-batch a stage can reach), so it is searched beside the stage in either
    # mode. "finish": changes only speed, with a one-off cost (compiling), so it is tried last on
    # the best configurations. Variants and finishes are tuned only where the user asked ("auto",
    # or a list, at the path).
    role: str = "knob"
    # On DeepSpeed's engine the script applies it, through the flag autotuning.arg_mappings maps
    # the config key to: how a value is written there (Hugging Face's bool flags take true/false).
    flag_text: Callable[[Any], str] = str
    applied_by_script_on_deepspeed: bool = False  # (the flag above) else DeepSpeed reads it from its config
    # A variant also swept as a knob in full mode on these engines when the user left it out.
    full_mode_engines: tuple[Engine, ...] = ()
    neutral: Any = None  # the value the profile launches run ("off"); None: the first value offered
    # Its term in the step-time model: "offset", a fixed time per step for each value (a group of
    # its own); "per_sample", a time per sample for each value other than the neutral one (the
    # recompute of activation checkpointing grows with the micro-batch).
    step_time: str = "offset"
    # Its value selects which activation figure the profile measured applies (one per value, as
    # the profile's activation probe measures for each checkpointing policy); unmeasured, it is
    # not tuned, and `unmeasured_reason(profiled)` says why.
    selects_activations: bool = False
    unmeasured_reasons: tuple[str, str] = ("", "")  # (after a profile, without one: model_info given)
    # When a ZeRO stage fits nothing on the GPU, the memory book tries this value at these stages
    # (CPU offload), the first stages gated by where the engine offers the dimension.
    fallback: Mapping[int, Any] = field(default_factory=dict)
    # On DeepSpeed's engine, the flag of the script that applies it (Hugging Face's), for the
    # refusal that asks for an arg_mappings entry, and what the script does with it.
    script_flag: str = ""
    script_applies: str = ""
    # Why "auto" at its path is not tuned on an engine that offers it no value (per engine).
    untuned_reasons: Mapping[Engine, str] = field(default_factory=dict)
    # The config section it brings, a plugin's (config/sections.py): the key the loader then
    # accepts in the CLI and in every rank, its model, and its tuned keys, refused outside a tune.
    # The built-in dimensions' sections are DeepSpeedConfig's own (their tuned keys: BUILT_IN_TUNED).
    section: ConfigSection | None = None
    # Its refusals (refusals.py), called for every registered dimension: before a tune, and for a
    # script settled on DeepSpeed's engine.
    tune_refusals: tuple[TuneRefusal, ...] = ()
    deepspeed_refusals: tuple[DeepSpeedRefusal, ...] = ()

    def neutral_value(self) -> Any:
        if self.neutral is not None:
            return self.neutral
        return next(iter(self.values_for(0, Engine.OURS, False)), None)

    def values_for(self, stage: int, engine: Engine, cuda: bool) -> tuple[Any, ...]:
        if self.cuda_only and not cuda:
            return ()
        return tuple(self.values.get(engine, {}).get(stage, ()))


BUCKET_SIZES = (1_000_000, 6_553_600, 50_000_000)  # DDP's bucket_cap_mb of ~4, 25 (torch's default) and 190 MiB
DEEPSPEED_BUCKETS = (50_000_000, 500_000_000)  # around DeepSpeed's defaults; its autotuner sweeps 5e7..1e9
ON_OFF = (False, True)
OFFLOAD_SECTIONS = (("zero_optimization", "offload_optimizer"), ("zero_optimization", "offload_param"))


def _zero(name: str, tag: str, values: Mapping[Engine, Mapping[int, tuple[Any, ...]]]) -> Dimension:
    return Dimension(name, ("zero_optimization", name), tag, values, zero_knob_term(name))


REGISTRY: dict[str, Dimension] = {d.name: d for d in (
    _zero("reduce_bucket_size", "rbs", {
        Engine.OURS: {0: BUCKET_SIZES, 1: BUCKET_SIZES},
        Engine.DEEPSPEED: {1: DEEPSPEED_BUCKETS, 2: DEEPSPEED_BUCKETS, 3: DEEPSPEED_BUCKETS}}),
    _zero("allgather_bucket_size", "abs", {Engine.DEEPSPEED: {1: DEEPSPEED_BUCKETS, 2: DEEPSPEED_BUCKETS}}),
    _zero("overlap_comm", "oc", {Engine.OURS: {2: ON_OFF, 3: ON_OFF}, Engine.DEEPSPEED: {2: ON_OFF, 3: ON_OFF}}),
    _zero("contiguous_gradients", "cg", {Engine.OURS: {0: ON_OFF, 1: ON_OFF}, Engine.DEEPSPEED: {2: ON_OFF}}),
    _zero("stage3_prefetch_bucket_size", "pbs", {Engine.DEEPSPEED: {3: (5_000_000, 50_000_000)}}),
    _zero("stage3_param_persistence_threshold", "ppt",
          {Engine.OURS: {3: (0, 100_000)}, Engine.DEEPSPEED: {3: (10_000, 100_000)}}),
    _zero("stage3_max_live_parameters", "mlive", {Engine.DEEPSPEED: {3: (100_000_000, 1_000_000_000)}}),
    # CPU offload, on a GPU only: device "auto" searches it beside the stage, like a checkpointing
    # policy (it changes what fits). On DeepSpeed's engine the optimizer from stage 1 and the
    # parameters at 3, also swept in full mode when the user wrote no offload section; on ours
    # FSDP2's CPUOffloadPolicy at stages 2 and 3, which moves parameters, gradients and the
    # optimizer step together (so offload_param has nothing of its own to tune there).
    Dimension("offload_optimizer", ("zero_optimization", "offload_optimizer", "device"), "oo",
              {Engine.DEEPSPEED: {1: ("none", "cpu"), 2: ("none", "cpu"), 3: ("none", "cpu")},
               Engine.OURS: {2: ("none", "cpu"), 3: ("none", "cpu")}},
              _offload_optimizer, _is_cpu, cuda_only=True, user_sections=OFFLOAD_SECTIONS, role="variant",
              full_mode_engines=(Engine.DEEPSPEED,), neutral="none", fallback={1: "cpu", 2: "cpu", 3: "cpu"}),
    Dimension("offload_param", ("zero_optimization", "offload_param", "device"), "op",
              {Engine.DEEPSPEED: {3: ("none", "cpu")}},
              _offload_param, _is_cpu, cuda_only=True, user_sections=OFFLOAD_SECTIONS, role="variant",
              full_mode_engines=(Engine.DEEPSPEED,), neutral="none", fallback={3: "cpu"},
              untuned_reasons={Engine.OURS: "on our engine FSDP2's CPUOffloadPolicy moves parameters together with "
                                            "the optimizer: offload_optimizer.device \"auto\" tunes it"}),
    # On DeepSpeed's engine the script checkpoints (Hugging Face's --gradient_checkpointing, whole
    # blocks): "none" or "full" through the mapped flag.
    Dimension("activation_checkpointing", ("activation_checkpointing", "policy"), "ac",
              {Engine.OURS: {stage: CHECKPOINT_POLICIES for stage in range(4)},
               Engine.DEEPSPEED: {stage: ("none", "full") for stage in range(4)}},
              _checkpoint_policy, _policy_rank, role="variant", flag_text=lambda policy: _bool_text(policy != "none"),
              applied_by_script_on_deepspeed=True, step_time="per_sample", selects_activations=True,
              unmeasured_reasons=("the model has no repeated blocks (no nn.ModuleList) to checkpoint",
                                  "autotuning.model_info is given, so no profile measured what each policy holds"),
              script_flag="--gradient_checkpointing",
              script_applies="the script checkpoints activations itself (deepspeed.checkpointing, or Hugging "
                             "Face's --gradient_checkpointing)", deepspeed_refusals=(policy_on_deepspeed,)),
    # torch.compile of the blocks: the memory model keeps the eager figure (inductor's fusions
    # only lower it) and measured peaks refit it like any other launch.
    # On DeepSpeed's engine through the mapped flag (Hugging Face's --torch_compile, which has
    # accelerate call engine.compile()).
    Dimension("compile", ("compile", "enabled"), "c",
              {Engine.OURS: {stage: ON_OFF for stage in range(4)}, Engine.DEEPSPEED: {stage: ON_OFF for stage in range(4)}},
              _same_memory, role="finish", flag_text=lambda enabled: _bool_text(bool(enabled)),
              applied_by_script_on_deepspeed=True, script_flag="--torch_compile",
              tune_refusals=(compile_before_the_window,), deepspeed_refusals=(compile_on_deepspeed,)),
)}


def register_dimension(dim: Dimension) -> Dimension:
    """Add a dimension (a plugin's) and its config section; a name, tag or section already taken is
    refused, so none is replaced unseen."""
    taken = {d.tag: d.name for d in REGISTRY.values() if d.name != dim.name}
    if dim.name in REGISTRY and REGISTRY[dim.name] is not dim:
        raise ValueError(f"dimension {dim.name!r} is registered already")
    if dim.tag in taken:
        raise ValueError(f"dimension {dim.name!r}: tag {dim.tag!r} belongs to {taken[dim.tag]!r}")
    if dim.section is not None:
        if dim.path[0] != dim.section.key:
            raise ValueError(f"dimension {dim.name!r}: its path {dotted(dim)} is outside its section {dim.section.key!r}")
        register_section(dim.section)
    REGISTRY[dim.name] = dim
    return dim


def dotted(dim: Dimension) -> str:
    return ".".join(dim.path)


def per_sample_names() -> frozenset[str]:
    """Dimensions whose step-time term is per sample, not an offset group."""
    return frozenset(d.name for d in REGISTRY.values() if d.step_time == "per_sample")


def activation_selector() -> Dimension | None:
    """The dimension whose value selects the profile's activation figure, if one is registered."""
    return next((d for d in REGISTRY.values() if d.selects_activations), None)


def activation_value(knobs: tuple[tuple[str, Any], ...]) -> str:
    """Which measured activation figure an experiment's knobs select ("none": the plain one)."""
    selector = activation_selector()
    if selector is None:
        return "none"
    return str(dict(knobs).get(selector.name, selector.neutral_value()))


def finishing_names() -> frozenset[str]:
    """Dimensions tried last on the best configurations, with a one-off cost (compiling)."""
    return frozenset(d.name for d in REGISTRY.values() if d.role == "finish")


def fallback_knobs(stage: int, engine: Engine) -> dict[str, Any] | None:
    """What a stage that fits nothing on the GPU tries instead (CPU offload): each fallback
    dimension's value at `stage`, from the first stage where the engine offers any of them."""
    fallbacks = [d for d in REGISTRY.values() if d.fallback]
    offered = [s for d in fallbacks for s in d.values.get(engine, {})]
    if not offered or stage < min(offered):
        return None
    knobs = {d.name: d.fallback[stage] for d in fallbacks if stage in d.fallback}
    return knobs or None


def flag_text(dotted_key: str, value: Any) -> str:
    """A config value as a mapped script flag takes it: a dimension's own form, else str()."""
    path = tuple(dotted_key.split("."))
    found = next((d for d in REGISTRY.values() if d.path == path), None)
    return found.flag_text(value) if found is not None else str(value)


def writes_bool_flag(dotted_key: str) -> bool:
    """Whether the key's mapped flag is a bool flag (its value written true/false), whose value a
    user may leave out (`--gradient_checkpointing` alone)."""
    path = tuple(dotted_key.split("."))
    found = next((d for d in REGISTRY.values() if d.path == path), None)
    return found is not None and found.flag_text(found.neutral_value()) in ("true", "false")


def applied_by_the_script(engine: Engine) -> tuple[tuple[str, ...], ...]:
    """Config paths of dimensions the script applies itself on `engine` (through a mapped flag),
    which its config must not carry: DeepSpeed refuses compile.enabled, and never reads a policy."""
    if engine != Engine.DEEPSPEED:
        return ()
    return tuple(d.path for d in REGISTRY.values() if d.applied_by_script_on_deepspeed)


def neutral_at(path: tuple[str, ...]) -> Any:
    """The neutral value of the dimension written at `path` (what the profile launches run)."""
    return next(d.neutral_value() for d in REGISTRY.values() if d.path == path)


def dimension(name: str) -> Dimension:
    return REGISTRY[name]


def tag(name: str) -> str:
    found = REGISTRY.get(name)
    return found.tag if found is not None else name


def encode(name: str, value: Any) -> float:
    found = REGISTRY.get(name)
    return found.encode(value) if found is not None else log2_number(value)


def memory_term(settings: StageSettings, name: str, value: Any) -> StageSettings:
    """`settings` with one dimension's value folded in, by that dimension's term."""
    found = REGISTRY.get(name)
    return found.memory_term(settings, value) if found is not None else zero_knob_term(name)(settings, value)


def full_mode_values(user_config: Mapping[str, Any], engine: Engine = Engine.OURS,
                     cuda: bool = False) -> dict[int, dict[str, list[Any]]]:
    """Full mode's values per stage and dimension for the script's engine and device. The user's
    scalar fixes a dimension (it is not tuned), a user list replaces its values, and a user
    section listed in `user_sections` (offload) takes the dimension out of the search."""
    out: dict[int, dict[str, list[Any]]] = {}
    stages = sorted({s for d in REGISTRY.values() for s in d.values.get(engine, {})} | set(range(4)))
    for stage in stages:
        per_stage: dict[str, list[Any]] = {}
        for dim in REGISTRY.values():
            if dim.role != "knob" and engine not in dim.full_mode_engines:
                continue
            defaults = dim.values_for(stage, engine, cuda)
            if not defaults:
                continue
            if any(lookup(user_config, section)[0] for section in dim.user_sections):
                continue
            present, value = lookup(user_config, dim.path)
            if not present or value is None:
                per_stage[dim.name] = list(defaults)
            elif isinstance(value, list):
                per_stage[dim.name] = list(value)
        out[stage] = per_stage
    return out


def _asked_values(dim: Dimension, user_config: Mapping[str, Any], stage: int, engine: Engine,
                  cuda: bool) -> list[Any]:
    """A variant dimension's values the user asked to tune at `stage`, in its own order: all of
    them for "auto", theirs for a list; none for a scalar (fixed) or an absent key."""
    present, value = lookup(user_config, dim.path)
    offered = dim.values_for(stage, engine, cuda)
    if not present or not offered:
        return []
    if value == "auto":
        return list(offered)
    if isinstance(value, list):
        return [v for v in offered if v in value]
    return []


def variant_values(user_config: Mapping[str, Any], engine: Engine = Engine.OURS,
                   cuda: bool = False) -> dict[int, tuple[tuple[tuple[str, Any], ...], ...]]:
    """Per stage, the variants to search beside it (every combination of the variant dimensions
    the user asked to tune, each as sorted knobs), least memory-saving first; empty when none."""
    out: dict[int, tuple[tuple[tuple[str, Any], ...], ...]] = {}
    for stage in range(4):
        asked = {d.name: _asked_values(d, user_config, stage, engine, cuda)
                 for d in REGISTRY.values() if d.role == "variant"}
        asked = {name: values for name, values in asked.items() if values}
        if not asked:
            continue
        names = sorted(asked)
        out[stage] = tuple(tuple(sorted(zip(names, combo))) for combo in itertools.product(*(asked[n] for n in names)))
    return out


def finish_values(user_config: Mapping[str, Any], engine: Engine = Engine.OURS,
                  cuda: bool = False) -> dict[int, dict[str, list[Any]]]:
    """Per stage, the values of each finishing dimension the user asked to tune (compile)."""
    out: dict[int, dict[str, list[Any]]] = {}
    for stage in range(4):
        asked = {d.name: _asked_values(d, user_config, stage, engine, cuda)
                 for d in REGISTRY.values() if d.role == "finish"}
        asked = {name: values for name, values in asked.items() if len(values) > 1}
        if asked:
            out[stage] = asked
    return out


def settle_variants(config: dict[str, Any]) -> None:
    """Each tuned variant and finishing dimension at its first value, in place: the base that
    the profile launches run (and every experiment then overrides)."""
    for dim in REGISTRY.values():
        if dim.role == "knob":
            continue
        present, value = lookup(config, dim.path)
        if present and (value == "auto" or isinstance(value, list)):
            neutral = dim.neutral_value()
            write(config, dim.path, value if neutral is None else neutral)
