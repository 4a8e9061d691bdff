"""One launch of the tuner's, as data: its settings, its config, its measurement request and the
files of its directory, and how a measurement is scored under the run's budget and objective.
How a trial is started and judged is execution/trial_launch.py."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import AliasChoices

from autotuner.core.engine_kind import Engine
from autotuner.config.keys import section_model
from autotuner.config.models import DeepSpeedConfig
from autotuner.core.boundary import Measurement, MeasurementRequest
from autotuner.core.errors import ConfigError
from autotuner.core.frozen import freeze
from autotuner.launch.options import RankFlags
from autotuner.launch.script_args import set_flag
from autotuner.tuning.memory.varying_batches import longest_batch
from autotuner.tuning.space import dimensions
from autotuner.tuning.space.experiment import TENSOR_PARALLEL_KEY, Experiment
from autotuner.tuning.space.planned_run import planned_value
from autotuner.tuning.space.records import Objective, Reason, TrialResult, TrialState

METRICS_FILE = "metrics.json"
MODEL_INFO_FILE = "model_info.json"
CONFIG_FILE = "ds_config.json"
REQUEST_FILE = "request.json"
LAUNCH_REPORT_FILE = "launch_report.json"
RANK_ERRORS_DIR = "rank_errors"
WARM_RANKS_FILE = "warm_ranks.txt"  # what each rank of a warm launch ran
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class ExperimentSettings:
    """Everything fixed across experiments of one tuning run."""

    script: str
    script_args: tuple[str, ...]
    base_config: dict[str, Any] = field(hash=False)
    nproc_per_node: int
    data_parallel_size: int
    objective: Objective
    timeout_s: float
    start_profile_step: int = 3
    end_profile_step: int = 5
    min_window_s: float = 0.0  # profile windows are extended until they last this long ...
    max_steps_per_window: int = 0  # ... or hold this many steps
    arg_mappings: dict[str, str] = field(default_factory=dict, hash=False)
    rank_flags: RankFlags = RankFlags()  # the user's launcher flags every launch carries over
    memory_budget_bytes: int | None = None  # per rank; above it a CPU run counts as OOM
    user_config: dict[str, Any] = field(default_factory=dict, hash=False)  # the file as the user wrote it
    python: str = sys.executable
    engine: Engine = Engine.OURS  # whose engine the script trains on (app/engines.py settles it)
    # False for a script that imports both engines, until the profile launch's ranks say which they
    # built; meanwhile `engine` is the one expected, and launches get a config either engine reads.
    engine_settled: bool = True
    planned_steps: int | None = None  # the run's length: experiments are scored over it (planned_run.py)
    # The longest sequence a batch can hold, where declared: a launch's memory is judged there
    # when its batches vary in length (memory/varying_batches.py).
    max_sequence_length: int | None = None
    max_sequence_length_from: str = ""  # where it was read, for the summary
    lr_scaling: str = "none"  # metric goodput: how the optimal config's learning rate follows its global batch
    # Hugging Face's Trainer builds the engine: it checks the config's learning rate and batch sizes
    # against its own flags, so what is written must say the same in both.
    trainer: bool = False

    def __post_init__(self):
        # Read-only at every depth: a record frozen only at its surface could be written into after
        # every experiment was derived from it.
        for name in ("base_config", "arg_mappings", "user_config"):
            object.__setattr__(self, name, freeze(getattr(self, name)))


def config_value(config: dict[str, Any], dotted_key: str) -> Any:
    value: Any = config
    for part in dotted_key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"autotuning.arg_mappings: '{dotted_key}' is not a key of the experiment config")
        value = value[part]
    return value


def mapped_script_args(script_args: tuple[str, ...], arg_mappings: dict[str, str], config: dict[str, Any]) -> tuple[str, ...]:
    """The user's arguments with each mapped flag set to the experiment's value (added if absent)."""
    args = tuple(script_args)
    booleans = bool_flags(arg_mappings, config)
    for key, flag in arg_mappings.items():
        args = set_flag(args, flag, dimensions.flag_text(key, config_value(config, key)), boolean=flag in booleans)
    return args


def bool_flags(arg_mappings: dict[str, str], config: dict[str, Any]) -> frozenset[str]:
    """The mapped flags that are bool flags (a dimension's written true/false, or a key whose value
    is a bool): given bare, the token after one is the script's next argument, not its value."""
    found = set()
    for key, flag in arg_mappings.items():
        try:
            value = config_value(config, key)
        except ConfigError:
            value = None
        if isinstance(value, bool) or dimensions.writes_bool_flag(key):
            found.add(flag)
    return frozenset(found)


def experiment_config(experiment: Experiment, settings: ExperimentSettings) -> dict[str, Any]:
    """The config a rank sees: the user's, with this experiment's values, without the autotuning
    section (what to measure travels in the request file). Also the optimum's training config."""
    config = experiment.apply(settings.base_config, settings.data_parallel_size)
    config.pop("autotuning", None)
    if derives_train_batch_size(settings):
        config.pop("train_batch_size")
    return config


def script_config(config: dict[str, Any], engine: Engine) -> dict[str, Any]:
    """The config file the script reads: on DeepSpeed's engine without the dimensions the script
    applies itself through their mapped flags (a section left empty goes too)."""
    return _without(config, dimensions.applied_by_the_script(engine))


def either_engine_config(config: dict[str, Any]) -> dict[str, Any]:
    """For a launch before the engine is settled: without the dimensions DeepSpeed's engine leaves
    to the script where they hold their neutral value (no checkpointing, not compiled), which is
    also how our engine runs without them. DeepSpeed refuses our compile keys; a value that is not
    neutral stays, for the engine the ranks build to act on or for the tuner to refuse then."""
    neutral = [path for path in dimensions.applied_by_the_script(Engine.DEEPSPEED)
               if dimensions.lookup(config, path)[1] == dimensions.neutral_at(path)]
    return _without(config, tuple(neutral))


def _without(config: dict[str, Any], paths: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    if not paths:
        return config
    config = copy.deepcopy(config)
    for path in paths:
        parent = dimensions.lookup(config, path[:-1])[1]
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
            if not parent and len(path) == 2:
                config.pop(path[0], None)
    return config


def derives_train_batch_size(settings: ExperimentSettings) -> bool:
    """On DeepSpeed's engine, unless the user fixed train_batch_size (or maps it to a flag), the
    experiment's config leaves it out and DeepSpeed derives it: micro-batch x gas x its world size.
    Written out, Hugging Face's Trainer checks it against its own product, whose world size on a
    CPU-only machine is 1 (accelerate sees no distributed backend) while DeepSpeed's is not."""
    return (settings.engine == Engine.DEEPSPEED and not isinstance(settings.base_config.get("train_batch_size"), int)
            and "train_batch_size" not in settings.arg_mappings)


def with_user_keys(user_config: dict[str, Any], tuned: dict[str, Any]) -> dict[str, Any]:
    """The tuned config laid over the user's file, so keys we accept but do not act on (DeepSpeed's
    own) stay and DeepSpeed can train with the result: merged at every depth (a user's
    offload_optimizer.ratio stays beside the tuned device), the tuned value winning. The autotuning
    section is left out, and the batch keys are the tuned config's alone (an "auto" of the user's is
    settled there, or derived)."""
    merged = {key: copy.deepcopy(value) for key, value in user_config.items()
              if key != "autotuning" and key not in BATCH_KEYS}
    user, tuned = _in_user_spelling(merged, tuned, DeepSpeedConfig)
    return _laid_over(user, tuned)


def _other_spellings(model: type) -> dict[str, tuple[str, ...]]:
    others = dict(getattr(model, "other_spellings", {}))
    for name, info in model.model_fields.items():
        if isinstance(info.validation_alias, AliasChoices):
            others[name] = tuple(c for c in info.validation_alias.choices if isinstance(c, str) and c != name)
    return others


def _in_user_spelling(user: dict[str, Any], tuned: dict[str, Any],
                      model: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the user's keys, the tuned config) with one spelling of each key: both at once are refused
    by our config and DeepSpeed's. A key the user spelt otherwise (stage3_gather_16bit_weights_on_model_save
    for gather_16bit_weights_on_model_save, DeepSpeed's older "bfloat16" for "bf16") is written in
    the user's spelling: Hugging Face's Trainer checks "bf16" against its --bf16 flag where the user's
    "bfloat16" passed. A deprecated form of another shape (cpu_offload: true for offload_optimizer)
    is dropped for the tuned section."""
    others = _other_spellings(model)
    user, renamed = dict(user), dict(tuned)
    for name, spellings in others.items():
        used = next((spelling for spelling in spellings if spelling in user), None)
        if name not in renamed or name in user or used is None:
            continue
        if type(user[used]) is type(renamed[name]):
            renamed = {used if key == name else key: value for key, value in renamed.items()}
        else:
            del user[used]
    for name, info in model.model_fields.items():
        section = section_model(info.annotation)
        key = next((k for k in (name, *others.get(name, ())) if isinstance(renamed.get(k), dict)), None)
        if section is not None and key is not None and isinstance(user.get(key), dict):
            user[key], renamed[key] = _in_user_spelling(user[key], renamed[key], section)
    return user, renamed


def _laid_over(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = _laid_over(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def picked_config(experiment: Experiment, settings: ExperimentSettings) -> dict[str, Any]:
    """The config the user trains with once `experiment` is picked: theirs, with its values."""
    return with_user_keys(settings.user_config, experiment_config(experiment, settings))


def launched_config(experiment: Experiment, settings: ExperimentSettings) -> dict[str, Any]:
    """The config file an experiment's ranks read: on DeepSpeed's engine the picked config
    (DeepSpeed acts on the user's DeepSpeed-only keys, so what is measured is what the pick trains
    with), on ours only what it acts on; less what the script applies through its mapped flags.
    Before the engine is settled, the picked config as either engine reads it."""
    if not settings.engine_settled:
        return either_engine_config(picked_config(experiment, settings))
    config = picked_config(experiment, settings) if settings.engine == Engine.DEEPSPEED else \
        experiment_config(experiment, settings)
    return script_config(config, settings.engine)


@dataclass(frozen=True)
class Trial:
    """One launch the tuner asks a runner for: an experiment in its directory. `profile`: also
    record the model's profile (ModelInfo) after its first optimizer step; the launch still times
    the profile window, so a profile launch is an experiment like any other."""

    experiment: Experiment
    directory: Path
    settings: ExperimentSettings
    profile: bool = False
    predicted_memory_bytes: int | None = None

    @property
    def request_path(self) -> Path:
        return self.directory / REQUEST_FILE

    @property
    def report_path(self) -> Path:
        return self.directory / LAUNCH_REPORT_FILE

    def request(self) -> MeasurementRequest:
        settings = self.settings
        model_info = str(self.directory / MODEL_INFO_FILE) if self.profile else None
        return MeasurementRequest(settings.start_profile_step, settings.end_profile_step,
                                  metrics_path=str(self.directory / METRICS_FILE), model_info_path=model_info,
                                  oom_marker_prefix=str(self.directory / METRICS_FILE),
                                  min_window_s=settings.min_window_s,
                                  max_steps_per_window=settings.max_steps_per_window,
                                  gradient_noise=settings.objective.metric == "goodput",
                                  tuned=self.experiment.tuned_values_in(settings.base_config))


def rank_count_flags(settings: ExperimentSettings) -> tuple[str, ...]:
    """--nproc_per_node N, unless the user's --include/--exclude/--hostfile already set the count."""
    return () if settings.rank_flags.picks_ranks_itself else ("--nproc_per_node", str(settings.nproc_per_node))


# The flag a script usually gives each of the triad's keys (DeepSpeed-Chat's, Hugging Face's), for the
# arg_mappings entry a mismatch suggests; a dimension suggests its own script flag.
_USUAL_FLAGS = {"zero_optimization.stage": "--zero_stage",
                "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                "gradient_accumulation_steps": "--gradient_accumulation_steps"}


def built_mismatch(experiment: Experiment, measurement: Measurement, settings: ExperimentSettings) -> str | None:
    """Why the ranks did not train the experiment, from what they reported building: the first tuned
    key whose value differs (a script's own config won over the experiment's), else None. Keys an
    engine cannot read back (a dimension the script applies on DeepSpeed's engine) are not judged."""
    reported = {"zero_optimization.stage": measurement.zero_stage,
                "train_micro_batch_size_per_gpu": measurement.micro_batch_size,
                "gradient_accumulation_steps": measurement.gradient_accumulation_steps}
    reported.update(measurement.built)
    by_path = {".".join(d.path): d for d in dimensions.REGISTRY.values()}
    for key, wanted in experiment.tuned_values_in(settings.base_config):
        got = reported.get(key)
        dim = by_path.get(key)
        if key not in reported or (dim is None and got is None):
            continue  # not read back (a metrics file of DeepSpeed's own without these fields)
        if dim is not None and measurement.engine == Engine.DEEPSPEED and dim.applied_by_script_on_deepspeed:
            continue  # (the engine the ranks built: a script importing both may settle it only now)
        if got is None and dim is not None and dim.neutral is not None:
            got = dim.neutral  # a section left out is the engine's default: off
        if key == TENSOR_PARALLEL_KEY and isinstance(got, int):
            got = max(1, got)  # DeepSpeed's 0 and 1 both mean no tensor parallelism
        if got == wanted:
            continue
        flag = settings.arg_mappings.get(key)
        where = (f"the script did not apply its mapped flag {flag}" if flag else
                 "the script's own config set it; map the key to the script's flag in autotuning.arg_mappings, "
                 f"e.g. \"{key}\": \"{(dim.script_flag if dim is not None else '') or _USUAL_FLAGS.get(key) or '--' + key.rsplit('.', 1)[-1]}\"")
        return f"the ranks built {key} = {got!r}, not the experiment's {wanted!r} ({where})"
    return None


def scored(measurement: Measurement, settings: ExperimentSettings, common: dict) -> TrialResult:
    """A measured launch judged under this run's budget and objective (`common`: the result's
    other fields)."""
    mismatch = built_mismatch(common["experiment"], measurement, settings)
    if mismatch is not None:  # never recorded under a name it did not train
        return TrialResult(state=TrialState.FAILED, measurement=measurement, error=mismatch,
                           reason=Reason.BUILT_OTHERWISE, **common)
    measured = measurement.peak_memory_bytes
    longest = longest_batch(measurement, settings.max_sequence_length)
    at = ""
    if longest is not None:  # batches vary in length: the run's peak is at its longest batch
        measured = longest.planned_peak_bytes
        at = f" at its longest batch ({longest.planned_length} positions; the window saw up to {longest.seen_max})"
    common = dict(common, measured_memory_bytes=measured)
    if settings.memory_budget_bytes and measured and measured > settings.memory_budget_bytes:
        return TrialResult(state=TrialState.OOM, measurement=measurement, error=f"peak {measured / 2**20:.0f} MiB{at} "
                           f"over the per-rank budget of {settings.memory_budget_bytes / 2**20:.0f} MiB",
                           reason=Reason.OVER_BUDGET, **common)
    value = measurement.value(settings.objective.key)
    if value is None:
        return TrialResult(state=TrialState.FAILED, measurement=measurement,
                           error=f"metrics.json has no '{settings.objective.key}'", reason=Reason.MISSING_METRIC,
                           **common)
    spread = measurement.throughput_std if settings.objective.metric in ("throughput", "goodput") else None
    planned = planned_value(measurement, settings.objective, settings.planned_steps, float(value))
    planned *= settings.objective.efficiency(measurement.train_batch_size)  # goodput; else 1
    if spread is not None and value:
        spread *= planned / float(value)
    return TrialResult(state=TrialState.OK, value=planned, value_std=spread, measurement=measurement, **common)


def rescored(result: TrialResult, settings: ExperimentSettings) -> TrialResult:
    """A journaled result judged again under this run's budget, metric and planned steps, which
    sit in the autotuning section outside the fingerprint: a value scored under another objective
    must never be compared with this run's. Results without a measurement stay as they are; so does
    a failure, unless all it lacked was an earlier metric's figure (this run's may be there)."""
    lacked_metric = result.state is TrialState.FAILED and result.reason is Reason.MISSING_METRIC
    if result.measurement is None or (result.state not in (TrialState.OK, TrialState.OOM) and not lacked_metric):
        return result
    common = dict(experiment=result.experiment, predicted_memory_bytes=result.predicted_memory_bytes,
                  wall_time_s=result.wall_time_s, model_info=result.model_info, hosts=result.hosts)
    return scored(result.measurement, settings, common)
