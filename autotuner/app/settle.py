"""The settle pass: from the command line and ds.json to a frozen job (`SettledJob`), before any
launch, with nothing left written (a results directory it probes is removed again).

Settled here, once: the launch plan; the data-parallel size (config/batch.py); the device facts
(tuning/space/devices.py); the search space, whose tuned sections' "auto" become their candidate
values, and the experiments' base config with every other "auto" of ours settled
(config_space.base_config); the batch triad's check; the engine where the script's imports say;
the planned steps and the longest batch; the experiment settings. Every
check of the request's config and flags that can refuse it runs here, except three that need
what comes later: the backend's own flags (the command line, before this), the results
directory's lock (tune.py), and a cluster's size (the Ray or Slurm runner, when it connects).
Once the runner has opened, `tuning_job` builds the job the tuner runs from the settled request
and the runner's placement, with the run's fingerprint: nothing is laid over it afterwards.

Settled later because a launch must say, each in one place:
- the engine of a script that imports both: `settle_built_engine`, from the profile launch's
  ranks, before any other launch;
- the memory budget on a GPU: the profile launch's device memory (the tuner's host may have no
  GPU, a Slurm login node say; tuning/models/memory_book.py `settle_budget`);
- activation checkpointing "auto" where the profile measured no per-policy figure
  (tuning/searches/variant_rules.py `checkpointing_settled`).
bf16.enabled "auto" stays in the experiments' configs: each rank settles it on its own device
(the memory model reads the tuner's device facts only where model_info skips the profile)."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from autotuner.core.engine_kind import Engine
from autotuner.app.engines import (EngineChoice, check_deepspeed_precision, check_our_engine_sections,
                                   script_engine, trains_on_ours, trains_with_trainer)
from autotuner.config import DeepSpeedConfig, load_config
from autotuner.config.batch import check_fixed_triad, data_parallel_size as data_parallel_size_of, train_batch_size
from autotuner.config.keys import field_names, section_model
from autotuner.config.loader import config_label, read_config_file
from autotuner.config.trainer_auto import passed_through_note, refuse_trainer_autos
from autotuner.app.trainer_checks import check_trainer_mappings, check_trainer_step_counts, script_max_steps
from autotuner.app.layout_checks import check_pipeline_tune, kept_layouts, settled_layouts
from autotuner.app.tensor_parallel_checks import check_tensor_parallel_tune
from autotuner.tuning.space.layout import Layout
from autotuner.core.errors import ConfigError, UsageError
from autotuner.execution.backends import BACKENDS, backend_spec
from autotuner.core.script_imports import own_modules
from autotuner.app.request import TuneRequest
from autotuner.launch import LaunchOptions, build_plan
from autotuner.launch.plan import LaunchPlan
from autotuner.launch.script_args import config_path
from autotuner.runtime.training.optim import check_optimizer_and_scheduler
from autotuner.tuning.space.config_space import base_config, search_space
from autotuner.tuning.space.dimensions import REGISTRY
from autotuner.tuning.memory.varying_batches import declared_max_length
from autotuner.tuning.trials.trial import ExperimentSettings, bool_flags, config_value
from autotuner.tuning.trials.journal import fingerprint_of, this_device, torch_version
from autotuner.tuning.trials.runner import Placement
from autotuner.tuning.profiling.job import TuningJob
from autotuner.tuning.space.records import Objective
from autotuner.tuning.space.devices import DeviceFacts, read_device_facts
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.search_space import SearchSpace
from autotuner.tuning.tuners import TUNERS


@dataclass(frozen=True)
class SettledJob:
    """A tuning request with everything settled that does not need a launch to know."""

    source: str  # the config file
    config: DeepSpeedConfig
    options: LaunchOptions  # on Ray: one node's (the cluster places each experiment's nodes)
    plan: LaunchPlan
    num_nodes: int  # the nodes each experiment spans
    engine: EngineChoice  # settled here, or (a script that imports both) by the profile launch's ranks
    settings: ExperimentSettings
    results_dir: Path
    exps_dir: Path
    devices: DeviceFacts  # read once, here
    space: SearchSpace  # built once, here, for the engine settled here (the orchestrator swaps in the
    # engine's dimensions after the profile only where the profile's ranks settle the engine), at layouts[0]
    layouts: tuple[Layout, ...] = ()  # the layouts a search runs in turn (none: the config's one)
    left_out: tuple[tuple[Layout, str], ...] = ()  # the layouts a search leaves out, with why


def say(line: str) -> None:
    print(f"autotuner: {line}", flush=True)


def check_arg_mappings(config: DeepSpeedConfig, source: str, base: dict | None = None) -> None:
    """Every mapped key must name a config key (dotted for nested ones). `base`: the config's
    experiment base (config_space.base_config), where the caller has it already."""
    for key in config.autotuning.arg_mappings:
        model = type(config)
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if model is None or part not in field_names(model):
                raise ConfigError(f"{source}: autotuning.arg_mappings: '{key}' is not a config key; map keys like "
                                  "train_micro_batch_size_per_gpu or gradient_accumulation_steps to script flags")
            model = section_model(model.model_fields[part].annotation) if depth < len(parts) - 1 else None
    for key, flag in config.autotuning.arg_mappings.items():
        if not flag.startswith("-"):
            raise ConfigError(f"{source}: autotuning.arg_mappings.{key}: got {flag!r}; expected a flag like --{key}")
    # What a mapped flag receives comes from the experiment's config: the keys every experiment
    # sets plus what the user gave. A key with no value there has nothing to pass.
    sample = Experiment(0, 1, 1).apply(base if base is not None else base_config(config), 1)
    for key in config.autotuning.arg_mappings:
        try:
            value = config_value(sample, key)
        except ConfigError:
            value = None
        if value is None:
            raise ConfigError(f"{source}: autotuning.arg_mappings: '{key}' has no value in the config, so there "
                              f"is nothing to pass to the script; set {key}, or map only keys the tuner sets "
                              "(train_micro_batch_size_per_gpu, gradient_accumulation_steps, ...)")


def check_some_batch_is_valid(space: SearchSpace, data_parallel_size: int, source: str) -> None:
    """At least one micro-batch size must give a valid global batch, or every launch is wasted."""
    if space.valid_micro_batch_sizes(space.max_micro_batch_size):
        return
    candidates = space.fixed_micro_batch_sizes or range(space.min_micro_batch_size, space.max_micro_batch_size + 1)
    smallest = train_batch_size(min(candidates), space.fixed_gradient_accumulation_steps or 1, data_parallel_size)
    if space.global_batch_exact:
        key = f"train_batch_size ({space.global_batch_size})"
        allowed = (f"it must equal micro-batch x gradient_accumulation_steps x {data_parallel_size} data-parallel "
                   f"ranks for some micro-batch size tried ({min(candidates)}..{max(candidates)})")
    else:
        key = f"autotuning.max_train_batch_size ({space.global_batch_size})"
        allowed = (f"with {data_parallel_size} data-parallel ranks the smallest global batch is {smallest}; "
                   f"raise it to at least {smallest} or use fewer ranks")
    raise ConfigError(f"{source}: {key}: no micro-batch size gives a valid global batch: {allowed}")


def check_trainer_autos(config: DeepSpeedConfig, choice: EngineChoice, script: str, source: str) -> None:
    """Hugging Face's "auto" values: refused for a script on our engine; on DeepSpeed's, passed
    through, saying so. With model_info given no profile launch measures the precision the Trainer
    picks, so fp16/bf16 "auto" must be settled in the file then."""
    if not choice.settled:
        return
    engine = choice.engine
    if engine == Engine.OURS and (choice.decided_by == "ranks" or trains_on_ours(script)):
        refuse_trainer_autos(config, source, choice.why)
    note = passed_through_note(config, source) if engine == Engine.DEEPSPEED else None
    if note:
        say(f"note: {note}")
    info = config.autotuning.model_info
    # bf16.enabled "auto" is ours to settle on our engine (bf16 where the device has it).
    auto = [key for key, value in (("fp16.enabled", config.fp16.enabled), ("bf16.enabled", config.bf16.enabled))
            if value == "auto" and (key == "fp16.enabled" or engine == Engine.DEEPSPEED)]
    if info is not None and info.num_params and auto:
        raise ConfigError(f"{source}: {auto[0]} is \"auto\" and autotuning.model_info is given, so no profile launch "
                          f"sees the precision Hugging Face's Trainer picks; set {auto[0]} to true or false, or drop "
                          "autotuning.model_info.num_params")


def check_results_dir(path: Path, key: str) -> None:
    """The directory exists or can be made, and a file can be written in it. Probed for real:
    os.access grants root everything, even under /proc. Directories made here are removed again."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"autotuning.{key}: {path} exists and is not a directory")
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UsageError(f"autotuning.{key}: {path} is not writable ({reason}); choose a directory you can "
                         "write to") from None
    finally:
        for directory in made:  # deepest first
            try:
                directory.rmdir()
            except OSError:
                pass


def settle(request: TuneRequest) -> SettledJob:
    """Check the request and settle it, or raise a one-line ConfigError/UsageError. Reads the config
    file, the script and the device; writes nothing (a results directory it probes is removed)."""
    script, script_args = request.script, request.script_args
    if request.launch.tuned_values is not None:  # each experiment's values are its request's
        raise UsageError(f"--tuned_values {request.launch.tuned_values}: a tune writes the pick's own (named in its "
                         "cmd_optimal.txt); drop it with --autotuning")
    given = config_path(script_args)
    if given is None:
        raise UsageError("--autotuning needs the script's config: add --deepspeed ds.json after the script")
    config = load_config(given)
    source = config_label(given)  # what messages call it: its path, or that it came base64-encoded
    tuning = config.autotuning
    if not tuning.enabled:
        # The flag states the intent; DeepSpeed would silently do nothing here.
        say(f"{source}: autotuning.enabled is false; tuning anyway because --autotuning {request.mode} was given")
    base = base_config(config)  # every experiment's config starts from it: the tuned sections' "auto" settled
    check_arg_mappings(config, source, base)
    check_tuner_type(tuning.tuner_type, source)
    options = request.launch
    placed = backend_spec(request.backend.backend).places_nodes
    num_nodes = options.num_nodes
    if placed:  # the cluster places each experiment's nodes: one node's plan describes the ranks
        options = replace(options, num_nodes=1, node_rank=0, master_addr=None)
    plan = build_plan(options, sys.executable)  # validates the launch options before anything starts
    for note in plan.notes:
        say(f"note: {note}")
    if plan.num_nodes > 1:
        placing = " or ".join(name for name, spec in BACKENDS.items() if spec.places_nodes)
        raise UsageError(f"--autotuning runs on one node, or on a cluster whose backend places the nodes (--backend "
                         f"{placing}); drop --num_nodes or add --backend")
    world_size = plan.world_size * (num_nodes if placed else 1)
    results_dir, exps_dir = Path(tuning.results_dir), Path(tuning.exps_dir)
    check_results_dir(results_dir, "results_dir")
    check_results_dir(exps_dir, "exps_dir")
    layouts, searched = settled_layouts(config, world_size, plan.nproc_per_node, source)
    # A search runs each layout in turn, counted from no split; else every experiment sets the one layout.
    layout = Layout() if searched else layouts[0]
    left_out: tuple[tuple[Layout, str], ...] = ()
    # DeepSpeed's engine splits each sequence over sequence_parallel_size ranks, and its batch
    # arithmetic divides the world by it as by a model-parallel size (ours refuses it at initialize).
    sequence_parallel = config.set_aside.get("sequence_parallel_size", 1)
    sequence_parallel = sequence_parallel if isinstance(sequence_parallel, int) and sequence_parallel > 1 else 1
    if sequence_parallel > 1 and world_size % (tuning.mp_size * sequence_parallel):
        raise ConfigError(f"{source}: sequence_parallel_size {sequence_parallel} x autotuning.mp_size "
                          f"{tuning.mp_size} must divide the world size ({world_size})")
    data_parallel_size = data_parallel_size_of(world_size, tuning.mp_size * sequence_parallel * layout.model_ranks,
                                               source)
    if not searched:  # (a search checks the triad at each layout)
        check_fixed_triad(config, world_size if layout.model_ranks > 1 else data_parallel_size, source)
    engine = script_engine(script, request.engine)
    if max(l.tensor_parallel for l in layouts) > 1:
        check_tensor_parallel_tune(config, engine, source)
    if any(l.pipeline for l in layouts):
        check_pipeline_tune(config, engine, source)
    # The search space, built once for the run from the device facts read once (the engine's own
    # dimensions are swapped in after the profile where only its ranks can tell the engine).
    devices = read_device_facts()
    space = search_space(config, data_parallel_size, engine.engine, devices.on_gpu)
    if searched:
        layouts, left_out = kept_layouts(config, space, layouts, data_parallel_size, source, say,
                                         check_some_batch_is_valid)
        layout = layouts[0]
    if searched or layout != Layout():  # each experiment sets its layout
        space = space.at_layout(layout, data_parallel_size * (1 if searched else layout.model_ranks))
        data_parallel_size = space.data_parallel_size
    check_some_batch_is_valid(space, data_parallel_size, source)
    if trains_with_trainer(script):
        check_trainer_mappings(space, dict(tuning.arg_mappings), source)
        check_trainer_step_counts(config, space, script_args, source)
        if tuning.adapt_batch:  # its loop counts gas from its flag and steps its schedule by that count
            raise ConfigError(f"{source}: autotuning.adapt_batch: {script} trains with Hugging Face's Trainer, "
                              "which counts gradient accumulation itself (--gradient_accumulation_steps) and would "
                              "not follow a batch the ramp grows; leave adapt_batch out")
    if tuning.metric == "goodput" and isinstance(config.train_batch_size, int):
        raise ConfigError(f"{source}: train_batch_size: got {config.train_batch_size}; metric \"goodput\" picks the "
                          "global batch, so leave it \"auto\" or absent")
    if tuning.metric == "goodput" and space.global_batch_size is not None and space.fixed_gradient_accumulation_steps is None:
        # The batch triad's rule: gas fills the cap, so every candidate's global batch is about the same.
        say(f"goodput: max_train_batch_size {space.global_batch_size} sets each candidate's gradient accumulation "
            "to fill it, so every candidate's global batch is close to it and goodput cannot trade the batch "
            "against its samples; leave max_train_batch_size out (gas 1: the global batch is micro-batch x "
            "data-parallel ranks) or fix gradient_accumulation_steps")
    check_optimizer_and_scheduler(config, source)
    if engine.settled:
        check_engine(config, engine, script, script_args, source)
    elif tuning.model_info is not None and tuning.model_info.num_params:
        raise UsageError(f"{engine.reason}, so only the profile launch's ranks can tell which engine it trains on, "
                         f"and {source}'s autotuning.model_info skips that launch; pass --engine deepspeed or --engine "
                         "autotuner, or drop autotuning.model_info.num_params")
    else:
        say(f"engine: {engine.reason}; the profile launch's ranks tell which engine it trains on, and what "
            "depends on the engine is settled from them, before any other launch")
    for dim in REGISTRY.values():  # each dimension's own refusals of what it cannot tune (compile's window)
        for refusal in dim.tune_refusals:
            refusal(dim, config, source)
    max_length, max_length_from = declared_max_length(script_args, tuning.max_sequence_length)
    settings = ExperimentSettings(
        script=script,
        script_args=script_args,
        base_config=base,
        nproc_per_node=plan.nproc_per_node,
        data_parallel_size=data_parallel_size,
        # The reference batch is goodput's (efficiency, and the learning rate's scaling from it).
        objective=Objective(tuning.metric, reference_batch=tuning.reference_batch_size if tuning.metric == "goodput"
                            else None),
        timeout_s=tuning.exp_timeout_s,
        start_profile_step=tuning.start_profile_step,
        end_profile_step=tuning.end_profile_step,
        min_window_s=tuning.min_window_s,
        max_steps_per_window=tuning.max_steps_per_window,
        arg_mappings=dict(tuning.arg_mappings),
        memory_budget_bytes=tuning.memory_per_rank_bytes,
        user_config=read_config_file(given),
        rank_flags=options.rank_flags(),
        engine=engine.engine,
        engine_settled=engine.settled,
        planned_steps=tuning.planned_steps or script_max_steps(script_args),
        max_sequence_length=max_length,
        max_sequence_length_from=max_length_from,
        lr_scaling=tuning.lr_scaling,
        trainer=trains_with_trainer(script),
    )
    return SettledJob(source, config, options, plan, num_nodes, engine, settings, results_dir, exps_dir,
                      devices, space, layouts if searched else (), left_out)


def tuning_job(job: SettledJob, placement: Placement) -> TuningJob:
    """The job the tuner runs: the settled request where the runner places its experiments. The
    fingerprint's device is the runner's hardware (a cluster's nodes) where it names one, so a
    resume elsewhere reuses no record."""
    settings, tuning = job.settings, job.config.autotuning
    fingerprint = fingerprint_of(script=settings.script, script_args=settings.script_args,
                                 mapped_flags=tuple(tuning.arg_mappings.values()), base_config=settings.base_config,
                                 nproc_per_node=job.plan.nproc_per_node, num_nodes=job.num_nodes,
                                 launcher_args=settings.rank_flags.to_argv(), torch_version=torch_version(),
                                 device=placement.hardware or this_device(), user_config=settings.user_config,
                                 measured_as=measured_as(settings), own_modules=tuple(own_modules(settings.script)),
                                 bool_flags=bool_flags(dict(tuning.arg_mappings), settings.base_config))
    return TuningJob.settled(job.config, settings, job.space, job.devices, fingerprint, placement, job.layouts,
                             job.left_out)


def measured_as(settings: ExperimentSettings) -> str:
    """What each launch measures beside its config, in words: a record measured otherwise is not reused."""
    return (f"steps {settings.start_profile_step}-{settings.end_profile_step}, at least {settings.min_window_s:g} s, "
            f"at most {settings.max_steps_per_window} steps a window; gradient noise "
            f"{'read' if settings.objective.metric == 'goodput' else 'not read'}; exp_timeout_s {settings.timeout_s:g}; "
            f"flags mapped: {', '.join(f'{k}={v}' for k, v in sorted(settings.arg_mappings.items())) or 'none'}")


def check_engine(config: DeepSpeedConfig, engine: EngineChoice, script: str, script_args: tuple[str, ...],
                 source: str) -> None:
    """Refuse in one line what is wrong for the engine the script trains on, saying which and why."""
    check_trainer_autos(config, engine, script, source)
    check_model_parallel(config.autotuning.mp_size, engine, source)
    if engine.settled and engine.engine == Engine.OURS:  # what our engine would train otherwise, before any launch
        from autotuner.config.engine_math import refuse_other_math

        refuse_other_math(config, source)
    check_deepspeed_precision(config.fp16.enabled, engine, script_args, source)
    check_our_engine_sections(config, engine, source, dict(config.autotuning.arg_mappings))


def check_model_parallel(mp_size: int, engine: EngineChoice, source: str) -> None:
    """Our engine trains every rank data parallel: an mp_size above 1 would size every global batch
    for a data-parallel world that many times smaller than the one that trains."""
    if mp_size > 1 and engine.settled and engine.engine == Engine.OURS:
        raise ConfigError(f"{source}: autotuning.mp_size: got {mp_size}; {engine.why}, whose every rank is data "
                          "parallel (no tensor or pipeline parallelism), so only 1 is allowed; mp_size above 1 is "
                          "for a script on DeepSpeed's engine with model parallelism of its own")


def settle_built_engine(job: SettledJob, built: str) -> str:
    """The engine the profile launch's ranks built, for a script whose engine was not settled
    before (or not as they built it): what is wrong for it is refused in one line (ConfigError,
    exit code 2), else the line to report, saying which engine and why."""
    engine = job.engine.built(built)
    check_engine(job.config, engine, job.settings.script, job.settings.script_args, job.source)
    return f"engine: {engine.why}; every experiment runs there"


def check_tuner_type(name: str, source: str) -> None:
    """autotuning.tuner_type names a registered tuner (built in, or a plugin's) whose needs are installed."""
    spec = TUNERS.get(name)
    if spec is None:
        allowed = ", ".join(f'"{known}"' for known in TUNERS)
        raise ConfigError(f'{source}: autotuning.tuner_type: got "{name}"; expected one of {allowed} '
                          "(or a plugin's tuner: entry point group autotuner.plugins)")
    if spec.check is not None:
        spec.check(f'{source}: autotuning.tuner_type "{name}"')

