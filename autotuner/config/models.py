"""Pydantic models of the DeepSpeed-compatible config.

Key names and meanings follow DeepSpeed. Values the autotuner may search
(`"auto"`, lists, `"all"`) are accepted here; the tuner's settle pass
(app/settle.py) turns them into each experiment's concrete values, and the
engine refuses anything still unsettled (a config run without the tuner).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, Union

from pydantic import AliasChoices, Field, NonNegativeFloat, PositiveFloat, PrivateAttr, field_validator, model_validator

from autotuner.config.autotuning import AutotuningConfig
from autotuner.config.base import Auto, BatchCount, NonNegativeInt, PositiveInt, Section
from autotuner.config.reporting import CSVConfig, FlopsProfilerConfig, TensorBoardConfig, TimersConfig, WandbConfig
from autotuner.config.pipeline import PipelineConfig
from autotuner.config.tensor_parallel import TensorParallelConfig


class FP16Config(Section):
    enabled: Union[bool, Auto] = Field(False, description='"auto": Hugging Face\'s Trainer sets it from --fp16')
    auto_cast: bool = False
    loss_scale: NonNegativeFloat = Field(0.0, description="0 means dynamic loss scaling")
    initial_scale_power: int = Field(16, ge=0, le=64, description="dynamic scaling starts at 2**power")
    loss_scale_window: PositiveInt = Field(1000, description="steps without overflow before the scale grows")
    hysteresis: PositiveInt = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: NonNegativeInt = Field(1, description="the dynamic scale's floor; an integer, as DeepSpeed's")

    @model_validator(mode="after")
    def _dynamic_scaling_has_a_floor(self) -> "FP16Config":
        # As DeepSpeed checks it: a floor of 0 lets the dynamic scale collapse to nothing.
        if self.enabled is True and self.loss_scale == 0 and self.min_loss_scale == 0:
            raise ValueError("min_loss_scale must be at least 1 with dynamic loss scaling (loss_scale 0)")
        return self


class BF16Config(Section):
    enabled: Union[bool, Auto] = Field(False, description='"auto": bf16 where the GPU supports it, else fp32')
    check_grad_overflow: bool = Field(
        True, description="false: at ZeRO 1-2 a step whose gradients hold an inf or NaN is applied, not skipped "
                          "(DeepSpeed's ZeRO 1/2 optimizer then checks neither the gradients nor their norm)")


OptimizerType = Literal["Adam", "AdamW", "SGD"]
SchedulerType = Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


class OptimizerConfig(Section):
    type: OptimizerType
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_case(cls, value: Any) -> Any:
        # DeepSpeed matches optimizer names case-insensitively ("adamw").
        names = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
        return names.get(value.lower(), value) if isinstance(value, str) else value


# DeepSpeed's defaults for its schedulers' params (deepspeed/runtime/lr_schedules.py).
SCHEDULER_DEFAULTS: dict[str, dict[str, Any]] = {
    # WarmupLR's max: each group's own lr where not given (WarmupDecayLR's is 0.001).
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {
        "total_num_steps": None,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": None,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
    },
}


class SchedulerConfig(Section):
    type: SchedulerType
    params: dict[str, Any] = Field(default_factory=dict)


class OffloadConfig(Section):
    device: Literal["none", "cpu", "auto"] = Field(
        "none", description='"cpu" offloads to host memory (on a GPU); "auto" is tuned: searched beside the '
                            'configurations that fit without it (GPU only; on a CPU everything is host memory already)')
    pin_memory: bool = False


ZeroStage = Literal[0, 1, 2, 3]


class ZeroConfig(Section):
    """`zero_optimization`. A list or "all" for `stage` is only meaningful to the autotuner."""

    # DeepSpeed's deprecated booleans for a section (true: its device "cpu"), read as it reads them
    # (config/loader.py); the tuned config writes the section, never both (DeepSpeed refuses both).
    other_spellings: ClassVar[dict[str, tuple[str, ...]]] = {"offload_optimizer": ("cpu_offload",),
                                                             "offload_param": ("cpu_offload_param",)}

    stage: Union[ZeroStage, list[ZeroStage], Literal["all"]] = 0
    overlap_comm: Union[bool, list[bool], None] = None
    reduce_bucket_size: Union[PositiveInt, list[PositiveInt], Auto, None] = Field(
        None, description="elements per gradient bucket (DDP bucket_cap_mb = elements * 4 B)"
    )
    allgather_bucket_size: Union[PositiveInt, list[PositiveInt], None] = None
    contiguous_gradients: Union[bool, list[bool], None] = None
    # "auto" in these three: Hugging Face's Trainer sets them from the model's hidden size.
    # DeepSpeed takes each of these three without its stage3_ prefix too (its field names).
    stage3_prefetch_bucket_size: Union[NonNegativeInt, list[NonNegativeInt], Auto, None] = Field(
        None, validation_alias=AliasChoices("stage3_prefetch_bucket_size", "prefetch_bucket_size"))
    stage3_param_persistence_threshold: Union[NonNegativeInt, list[NonNegativeInt], Auto, None] = Field(
        None, validation_alias=AliasChoices("stage3_param_persistence_threshold", "param_persistence_threshold"))
    stage3_max_live_parameters: Union[PositiveInt, list[PositiveInt], None] = Field(
        None, validation_alias=AliasChoices("stage3_max_live_parameters", "max_live_parameters"),
        description="DeepSpeed's engine only: parameters held gathered at once at stage 3 (tuned there); "
                    "FSDP2 gathers one block at a time, so ours has no such cap"
    )
    offload_optimizer: OffloadConfig | None = None
    offload_param: OffloadConfig | None = None
    # DeepSpeed's name at stage 3, its stage-less name, and its deprecated fp16 name.
    gather_16bit_weights_on_model_save: bool = Field(False, validation_alias=AliasChoices(
        "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save"), description="save_16bit_model gathers ZeRO-3 shards")
    compute_grad_norm: bool = Field(
        True, description="false (ZeRO 1-2, gradient_clipping 0, no optimizer offload): no gradient norm is "
                          "computed, get_global_grad_norm() gives None, and in fp32 a non-finite step is applied")

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_list_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("an empty list tunes nothing; give stages 0-3, a list of them, or \"all\"")
        return value

    @model_validator(mode="after")
    def _grad_norm_off_only_at_stages_1_and_2(self) -> "ZeroConfig":
        # As DeepSpeed checks it; a tuned list may not reach another stage either.
        if not self.compute_grad_norm and not set(self.stages) <= {1, 2}:
            raise ValueError(f"compute_grad_norm false is supported only at ZeRO stage 1 or 2, as in DeepSpeed; got "
                             f"stage {json.dumps(self.stage)}")
        if not self.compute_grad_norm and self.offload_optimizer is not None and \
                self.offload_optimizer.device != "none":
            raise ValueError("compute_grad_norm false does not support optimizer offload, as in DeepSpeed")
        return self

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


class ActivationCheckpointingConfig(Section):
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


class CompileConfig(Section):
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


BatchValue = Union[BatchCount, Auto, None]


class DeepSpeedConfig(Section):
    """The whole config file. Batch values may be "auto" until `resolve_batch` runs."""

    other_spellings: ClassVar[dict[str, tuple[str, ...]]] = {"bf16": ("bfloat16",)}  # DeepSpeed's older name

    # DeepSpeed's sections we do not act on, as the file gave them (config/keys.py sets them aside):
    # our engine reads them only to refuse those that would change its training (config/engine_math.py).
    _set_aside: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def set_aside(self) -> dict[str, Any]:
        return self._set_aside  # read-only (the loader freezes it)

    # The sections plugins' dimensions bring (config/sections.py), validated by their own models.
    _sections: dict[str, Any] = PrivateAttr(default_factory=dict)

    def section(self, key: str) -> Any:
        """A registered section as its model validated it; None where the file has none."""
        return self._sections.get(key)

    train_batch_size: BatchValue = Field(
        None, description="samples per optimizer step over all ranks = micro-batch x gas x data-parallel size")
    train_micro_batch_size_per_gpu: Union[BatchCount, Auto, list[BatchCount], None] = Field(
        None, description='samples per rank per forward/backward; "auto" is tuned, a list is tried exactly')
    gradient_accumulation_steps: BatchValue = Field(
        None, description='micro-batches per optimizer step; "auto" is tuned (from max_train_batch_size)')
    gradient_clipping: Union[NonNegativeFloat, Auto] = Field(
        1.0, description='max grad norm (DeepSpeed 0.19.8\'s default 1.0); 0 disables clipping; "auto": the Trainer '
                         'sets it from --max_grad_norm')
    steps_per_print: PositiveInt = Field(10, description="the progress line's period, in optimizer steps")
    wall_clock_breakdown: bool = Field(False, description="print forward/backward/step times (rank 0)")
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    data_parallel_size: PositiveInt | None = Field(
        None, description="DeepSpeed's AutoTP examples state it; checked against world / tensor_parallel.autotp_size")
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
        clipping = self.gradient_clipping
        if not self.zero_optimization.compute_grad_norm and clipping != "auto" and clipping > 0:
            raise ValueError(f"gradient_clipping is {clipping:g} (DeepSpeed's default is 1.0) and "
                             "zero_optimization.compute_grad_norm is false, which needs gradient_clipping 0, as in "
                             "DeepSpeed")
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
        return self.dump(exclude_unset=True)

    def dump(self, **options: Any) -> dict[str, Any]:
        """model_dump(mode="json", **options) with the registered sections beside the fields
        (pydantic's own dump knows only the fields)."""
        sections = {key: section.model_dump(mode="json", **options) for key, section in self._sections.items()}
        return {**self.model_dump(mode="json", **options), **sections}
