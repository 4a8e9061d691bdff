"""Pydantic models of the DeepSpeed-compatible config.

Key names and meanings follow DeepSpeed. Values the autotuner may search
(`"auto"`, lists, `"all"`) are accepted here; `resolve` settles them before a
run, and the engine refuses anything still unsettled.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal, Union

from typing import Annotated

from pydantic import (AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, NonNegativeFloat, PositiveFloat,
                      field_validator, model_validator)

from autotuner.config.reporting import CSVConfig, FlopsProfilerConfig, TensorBoardConfig, TimersConfig, WandbConfig

logger = logging.getLogger("autotuner.config")

Auto = Literal["auto"]


def _no_bool(value: Any) -> Any:
    # JSON true is not a count; pydantic's lax mode would read it as 1.
    if isinstance(value, bool):
        raise ValueError("a boolean is not a count; expected a positive integer")
    return value


PositiveInt = Annotated[int, BeforeValidator(_no_bool), Field(gt=0)]
NonNegativeInt = Annotated[int, BeforeValidator(_no_bool), Field(ge=0)]


class _Section(BaseModel):
    # Unknown keys are caught earlier by keys.check_keys, with suggestions;
    # "forbid" is the backstop.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FP16Config(_Section):
    enabled: Union[bool, Auto] = Field(False, description='"auto": Hugging Face\'s Trainer sets it from --fp16')
    auto_cast: bool = False
    loss_scale: NonNegativeFloat = Field(0.0, description="0 means dynamic loss scaling")
    initial_scale_power: int = Field(16, ge=0, le=64, description="dynamic scaling starts at 2**power")
    loss_scale_window: PositiveInt = Field(1000, description="steps without overflow before the scale grows")
    hysteresis: PositiveInt = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: NonNegativeFloat = 1.0


class BF16Config(_Section):
    enabled: Union[bool, Auto] = Field(False, description='"auto": bf16 where the GPU supports it, else fp32')


OptimizerType = Literal["Adam", "AdamW", "SGD"]
SchedulerType = Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


class OptimizerConfig(_Section):
    type: OptimizerType
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_case(cls, value: Any) -> Any:
        # DeepSpeed matches optimizer names case-insensitively ("adamw").
        names = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
        return names.get(value.lower(), value) if isinstance(value, str) else value


class SchedulerConfig(_Section):
    type: SchedulerType
    params: dict[str, Any] = Field(default_factory=dict)


class OffloadConfig(_Section):
    device: Literal["none", "cpu", "auto"] = Field(
        "none", description='"cpu" offloads to host memory (on a GPU); "auto" is tuned: searched beside the '
                            'configurations that fit without it (GPU only; on a CPU everything is host memory already)')
    pin_memory: bool = False


ZeroStage = Literal[0, 1, 2, 3]


class ZeroConfig(_Section):
    """`zero_optimization`. A list or "all" for `stage` is only meaningful to the autotuner."""

    stage: Union[ZeroStage, list[ZeroStage], Literal["all"]] = 0
    overlap_comm: Union[bool, list[bool], None] = None
    reduce_bucket_size: Union[PositiveInt, list[PositiveInt], Auto, None] = Field(
        None, description="elements per gradient bucket (DDP bucket_cap_mb = elements * 4 B)"
    )
    allgather_bucket_size: Union[PositiveInt, list[PositiveInt], None] = None
    contiguous_gradients: Union[bool, list[bool], None] = None
    # "auto" in these three: Hugging Face's Trainer sets them from the model's hidden size.
    stage3_prefetch_bucket_size: Union[NonNegativeInt, list[NonNegativeInt], Auto, None] = None
    stage3_param_persistence_threshold: Union[NonNegativeInt, list[NonNegativeInt], Auto, None] = None
    stage3_max_live_parameters: Union[PositiveInt, list[PositiveInt], None] = Field(
        None, description="DeepSpeed's engine only: parameters held gathered at once at stage 3 (tuned there); "
                          "FSDP2 gathers one block at a time, so ours has no such cap"
    )
    offload_optimizer: OffloadConfig | None = None
    offload_param: OffloadConfig | None = None
    # DeepSpeed's name at stage 3, its stage-less name, and its deprecated fp16 name.
    gather_16bit_weights_on_model_save: bool = Field(False, validation_alias=AliasChoices(
        "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save"), description="save_16bit_model gathers ZeRO-3 shards")

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_list_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("an empty list tunes nothing; give stages 0-3, a list of them, or \"all\"")
        return value

    @property
    def stages(self) -> tuple[int, ...]:
        """Stages this config allows, sorted."""
        if self.stage == "all":
            return (0, 1, 2, 3)
        if isinstance(self.stage, list):
            return tuple(sorted(set(self.stage)))
        return (self.stage,)

    @property
    def tuned_offloads(self) -> tuple[str, ...]:
        """The offload sections whose device is "auto" (tuned), as written in the config."""
        return tuple(name for name in ("offload_optimizer", "offload_param")
                     if (section := getattr(self, name)) is not None and section.device == "auto")


CheckpointPolicy = Literal["none", "full", "selective"]


class ActivationCheckpointingConfig(_Section):
    """`activation_checkpointing`: ours, `policy`, which our engine applies itself. DeepSpeed's keys
    in the section are set aside with the loader's one warning (config/keys.py): only a script
    that calls `deepspeed.checkpointing.configure` reads them, from the file."""

    policy: CheckpointPolicy | Literal["auto"] | list[CheckpointPolicy] = Field(
        "none", description='ours: recompute activations of the model\'s repeated blocks (the entries of its '
                            'nn.ModuleLists, the blocks FSDP2 shards) in backward: "full" keeps only each block\'s '
                            'input, "selective" also keeps matmul outputs; "auto" (or a list of policies) tunes it '
                            'under --autotuning tune|run')

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_known(cls, value: Any) -> Any:
        allowed = 'give "none", "full" or "selective", a list of them, or "auto" (the list and "auto" are tuned)'
        if isinstance(value, list) and not value:
            raise ValueError(f"an empty list tunes nothing; {allowed}")
        for policy in value if isinstance(value, list) else [value]:
            if policy not in ("none", "full", "selective") and (isinstance(value, list) or policy != "auto"):
                raise ValueError(f"{json.dumps(policy)} is not a policy; {allowed}")
        return value

    @property
    def tuned(self) -> bool:
        return not isinstance(self.policy, str) or self.policy == "auto"


class CompileConfig(_Section):
    """`compile`: torch.compile of the model's repeated blocks on our engine. The keys are those of
    DeepSpeed's section before 0.16 (`enabled`, `backend`, `kwargs`); 0.16 on moved compiling to
    `engine.compile()`, which ours has too."""

    enabled: bool | Literal["auto"] = Field(
        False, description="compile each repeated block (the whole model if it has none) before DDP/FSDP2 wrap it, "
                           "as torchtitan does; \"auto\" tunes it under --autotuning tune|run (the best "
                           "configurations are measured compiled too, the one-off compile time counted against "
                           "autotuning.planned_steps)")
    backend: str = Field("inductor", description="torch.compile's backend")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="more torch.compile arguments (mode, dynamic, "
                                   "fullgraph, ...)")

    @property
    def tuned(self) -> bool:
        return self.enabled == "auto"


class ModelInfoSection(_Section):
    """`autotuning.model_info`: facts about the model the user gives, so the profile need not measure
    them (DeepSpeed's keys, plus ours). The measured record is boundary.ModelInfo."""

    profile: bool = False
    num_params: PositiveInt | None = None
    trainable_num_params: PositiveInt | None = None
    hidden_size: PositiveInt | None = None
    num_layers: PositiveInt | None = None
    activation_bytes_per_sample: int | None = Field(None, ge=0, description="ours: skips the profile's measurement")
    baseline_bytes: int | None = Field(None, ge=0, description="ours: per-rank memory held before the model")


MetricName = Literal["throughput", "latency", "FLOPS"]
TunerType = Literal["gridsearch", "random", "model_based", "bayes", "predictive"]


class OnlineConfig(_Section):
    """`autotuning.online`: tune communication knobs inside the training job, at optimizer-step
    boundaries (Horovod's and Bagua's online autotuning). `launcher --autotuning online` turns it on."""

    enabled: bool = Field(False, description="tune while this job trains (as launcher --autotuning online)")
    warmup_samples: NonNegativeInt = Field(3, description="samples measured and discarded first (Horovod's "
                                           "--autotune-warmup-samples)")
    steps_per_sample: PositiveInt = Field(10, description="optimizer steps per sample window (Horovod's "
                                          "--autotune-steps-per-sample)")
    max_samples: PositiveInt = Field(20, description="scored samples before the final re-measurement (Horovod's "
                                     "--autotune-bayes-opt-max-samples)")
    sampling_confidence_time: NonNegativeFloat = Field(
        5.0, description="seconds a sample window lasts at least; windows are extended to it (Bagua's "
                         "--autotune_sampling_confidence_time)")
    planned_steps: PositiveInt | None = Field(
        None, description="ours: the optimizer steps the training will run; each experiment is then scored by the "
                          "time to run them, one-off costs (compiling) included; unset: the script's --max_steps "
                          "when it has one, else the steady metric alone")
    remeasure_top: PositiveInt = Field(3, description="best points re-measured, interleaved, before the final pick")
    remeasure_rounds: PositiveInt = Field(3, description="windows per re-measured point; the pick is by median")
    sampler: Literal["gp", "tpe"] = Field("gp", description="optuna's GPSampler or TPESampler")
    seed: int = Field(0, description="the sampler's seed")
    log_file: str | None = Field(None, description="CSV log (default: <results_dir>/online_log.csv)")
    best_knobs_file: str | None = Field(None, description="the pick (default: <results_dir>/best_knobs.json)")
    knobs: Union[dict[str, Union[bool, int, float]], str] = Field(
        default_factory=dict, description="knobs fixed by the user, not tuned; or the path of a best_knobs.json")


class AutotuningConfig(_Section):
    """The `autotuning` section: DeepSpeed's keys plus our documented additions."""

    enabled: bool = Field(False, description="the section is read only when true")
    fast: bool = Field(True, description="true: stage x micro-batch x gas only; false: then ZeRO knobs too")
    results_dir: str = Field("autotuning_results", description="summary, experiments.csv, the optimal config")
    exps_dir: str = Field("autotuning_exps", description="one directory per experiment; the resume journal")
    history: bool = Field(True, description="ours: record every launch as a trial of an optuna study (needs "
                          "optuna: the history or bayes extra); `launcher --history` lists the runs")
    storage: str | None = Field(None, description="ours: the history's SQLAlchemy URL (a shared PostgreSQL for a "
                                "team, say); default sqlite:///<results_dir>/history.db")
    transfer: bool = Field(True, description="ours: tuner_type predictive starts from similar earlier runs in the "
                           "history (same model family, engine, device, ranks and precision, another size), scaled "
                           "to this model and checked against its profile; false tunes cold")
    overwrite: bool = Field(False, description="false resumes finished experiments; true starts afresh")
    metric: MetricName = Field("throughput", description="throughput | latency (minimised) | FLOPS")
    start_profile_step: PositiveInt = Field(3, description="the first optimizer step timed")
    end_profile_step: PositiveInt = Field(5, description="the last step timed (more with min_window_s)")
    min_window_s: NonNegativeFloat = Field(
        1.0, description="ours: a profile window goes on past end_profile_step until it has lasted this long "
                         "(Bagua's sampling_confidence_time); 0 keeps DeepSpeed's fixed window")
    max_steps_per_window: PositiveInt = Field(100, description="ours: ... or until it holds this many steps")
    metric_path: str | None = None
    model_info_path: str | None = None
    tuner_type: TunerType = Field("predictive", description="DeepSpeed's default is gridsearch; ours, predictive, "
                                  "won our benchmarks")
    tuner_early_stopping: PositiveInt = Field(5, description="stop after this many experiments without improvement")
    tuner_num_trials: PositiveInt = Field(50, description="at most this many experiments")
    tuner_seed: int = Field(0, description="seed of the random and model_based tuners")
    arg_mappings: dict[str, str] = Field(default_factory=dict, description="config key -> the script's flag that "
                                         "carries its tuned value")
    max_train_batch_size: PositiveInt | None = Field(None, description="the global batch: gas = it / (micro x dp)")
    min_train_micro_batch_size_per_gpu: PositiveInt = 1
    max_train_micro_batch_size_per_gpu: PositiveInt = 1024
    num_tuning_micro_batch_sizes: PositiveInt = Field(3, description="sizes tried per stage below its largest")
    mp_size: PositiveInt = Field(1, description="model-parallel size; only 1 (data parallel) here")
    model_info: ModelInfoSection | None = None
    exp_timeout_s: float = Field(600.0, gt=0, description="wall-clock limit of one experiment, seconds")
    memory_per_rank_bytes: PositiveInt | None = Field(
        None, description="overrides the detected per-rank device memory budget"
    )
    warm_start: bool = Field(True, description="fork experiment ranks from a forkserver that preloaded torch and the "
                             "script's imports; false starts every experiment's interpreters cold")
    warm_preload: list[str] = Field(default_factory=list, description="more modules for the forkserver to import, "
                                    "as 'module' or 'module:attribute'")
    online: OnlineConfig = Field(default_factory=OnlineConfig)
    planned_steps: PositiveInt | None = Field(
        None, description="ours: the optimizer steps the training will run; each experiment is then scored by the "
                          "time to run them, one-off costs (compiling) included; unset: the script's --max_steps "
                          "when it has one, else the steady metric alone")
    remeasure_top: PositiveInt = Field(3, description="the final pick re-measures up to this many candidates within "
                                       "twice the run's noise level of the best, interleaved, and takes the best median")
    remeasure_rounds: NonNegativeInt = Field(3, description="at most this many rounds of re-measurement, stopping "
                                             "once the best stands apart or the rest are within the noise of it "
                                             "(0: pick the best single measurement)")

    @field_validator("arg_mappings", mode="before")
    @classmethod
    def _strip_arg_mappings(cls, value: Any) -> Any:
        # DeepSpeed's published example maps "gradient_accumulation_steps " (trailing space), and
        # DeepSpeed accepts it; so do we, saying so.
        if not isinstance(value, dict):
            return value
        stripped = {}
        for key, flag in value.items():
            clean_key = key.strip() if isinstance(key, str) else key
            clean_flag = flag.strip() if isinstance(flag, str) else flag
            if (clean_key, clean_flag) != (key, flag):
                logger.warning("autotuning.arg_mappings: %r: %r has spaces around it; read as %r: %r",
                               key, flag, clean_key, clean_flag)
            stripped[clean_key] = clean_flag
        return stripped

    @field_validator("metric", mode="before")
    @classmethod
    def _metric_alias(cls, value: Any) -> Any:
        # DeepSpeed spells it "flops" in docs and FLOPS_per_gpu in metrics files.
        if isinstance(value, str) and value.lower() in ("flops", "flops_per_gpu"):
            return "FLOPS"
        return value

    @model_validator(mode="after")
    def _ranges(self) -> "AutotuningConfig":
        if self.start_profile_step >= self.end_profile_step:
            raise ValueError(
                f"start_profile_step ({self.start_profile_step}) must be less than "
                f"end_profile_step ({self.end_profile_step})"
            )
        if self.min_train_micro_batch_size_per_gpu > self.max_train_micro_batch_size_per_gpu:
            raise ValueError(
                f"min_train_micro_batch_size_per_gpu ({self.min_train_micro_batch_size_per_gpu}) is larger than "
                f"max_train_micro_batch_size_per_gpu ({self.max_train_micro_batch_size_per_gpu})"
            )
        return self


BatchValue = Union[PositiveInt, Auto, None]


class DeepSpeedConfig(_Section):
    """The whole config file. Batch values may be "auto" until `resolve_batch` runs."""

    train_batch_size: BatchValue = Field(
        None, description="samples per optimizer step over all ranks = micro-batch x gas x data-parallel size")
    train_micro_batch_size_per_gpu: Union[PositiveInt, Auto, list[PositiveInt], None] = Field(
        None, description='samples per rank per forward/backward; "auto" is tuned, a list is tried exactly')
    gradient_accumulation_steps: BatchValue = Field(
        None, description='micro-batches per optimizer step; "auto" is tuned (from max_train_batch_size)')
    gradient_clipping: Union[NonNegativeFloat, Auto] = Field(
        0.0, description='max grad norm; 0 disables clipping; "auto": the Trainer sets it from --max_grad_norm')
    steps_per_print: PositiveInt = Field(10, description="the progress line's period, in optimizer steps")
    wall_clock_breakdown: bool = Field(False, description="print forward/backward/step times (rank 0)")
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    # What a run reports, and how gradients are reduced: DeepSpeed's keys and meanings.
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    timers: TimersConfig = Field(default_factory=TimersConfig)
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="dtype of the gradient reduction; unset: the gradients' own dtype")
    prescale_gradients: bool = Field(False, description="divide by the world size before the all-reduce")
    gradient_predivide_factor: PositiveFloat = Field(
        1.0, description="without prescale_gradients: divide by this before the all-reduce, by world/this after")

    # DeepSpeed keys that change the training math; our engine refuses values other than the default
    # (config/engine_math.py), DeepSpeed's engine honours them.
    managed_gradient_accumulation: bool = Field(True, description="only true on our engine (refused otherwise)")
    gradient_allreduce_op: Literal["mean", "sum"] = Field("mean", description='only "mean" on our engine')
    torch_autocast: dict[str, Any] = Field(default_factory=dict, description="only disabled on our engine")

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _dtype_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value  # DeepSpeed lowercases it

    @field_validator("train_micro_batch_size_per_gpu", mode="before")
    @classmethod
    def _micro_list_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("an empty list tunes nothing; give a positive integer, \"auto\" or a list of them")
        return value

    @model_validator(mode="after")
    def _one_precision(self) -> "DeepSpeedConfig":
        if self.fp16.enabled is True and self.bf16.enabled is True:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
        return self

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        """Settled precision; call `with_device_precision` first when bf16.enabled is "auto".
        fp16.enabled "auto" is the Trainer's to settle (config/trainer_auto.py), never ours."""
        if self.fp16.enabled == "auto":
            raise ValueError('fp16.enabled is "auto"; Hugging Face\'s Trainer settles it, not autotuner')
        if self.fp16.enabled:
            return "fp16"
        if self.bf16.enabled == "auto":
            raise ValueError('bf16.enabled is "auto"; settle it with with_device_precision()')
        if self.bf16.enabled:
            return "bf16"
        return "fp32"

    def with_device_precision(self, bf16_supported: bool) -> "DeepSpeedConfig":
        """A copy with bf16.enabled "auto" settled: on where the device supports bf16 (and fp16 is off)."""
        if self.bf16.enabled != "auto":
            return self
        settled = bf16_supported and self.fp16.enabled is False
        return self.model_copy(update={"bf16": BF16Config(enabled=settled)})

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that loads back to an equal config (unset sections left out)."""
        return self.model_dump(mode="json", exclude_unset=True)
