"""The `autotuning` section: DeepSpeed's keys (its autotuner's) plus ours, the model facts a user
may give, and the online tuning subsection."""

from __future__ import annotations

import logging
from typing import Any, Literal, Union

from pydantic import AliasChoices, Field, NonNegativeFloat, PositiveFloat, field_validator, model_validator

from autotuner.config.base import NonNegativeInt, PositiveInt, Section

logger = logging.getLogger("autotuner.config")


class ModelInfoSection(Section):
    """`autotuning.model_info`: facts about the model the user gives, so the profile need not measure
    them (DeepSpeed's keys, plus ours). The measured record is boundary.ModelInfo."""

    profile: bool = False
    num_params: PositiveInt | None = None
    trainable_num_params: PositiveInt | None = None
    hidden_size: PositiveInt | None = None
    num_layers: PositiveInt | None = None
    activation_bytes_per_sample: int | None = Field(None, ge=0, description="ours: skips the profile's measurement")
    baseline_bytes: int | None = Field(None, ge=0, description="ours: per-rank memory held before the model")


MetricName = Literal["throughput", "latency", "FLOPS", "goodput"]


class OnlineConfig(Section):
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
    remeasure_windows: PositiveInt = Field(
        3, validation_alias=AliasChoices("remeasure_windows", "remeasure_rounds"),
        description="windows per re-measured point, interleaved; the pick is by median (the old name "
                    "remeasure_rounds is read, with a warning)")
    sampler: Literal["gp", "tpe"] = Field("gp", description="optuna's GPSampler or TPESampler")
    seed: int = Field(0, description="the sampler's seed")
    log_file: str | None = Field(None, description="CSV log (default: <results_dir>/online_log.csv)")
    best_knobs_file: str | None = Field(None, description="the pick (default: <results_dir>/best_knobs.json)")
    knobs: Union[dict[str, Union[bool, int, float]], str] = Field(
        default_factory=dict, description="knobs fixed by the user, not tuned; or the path of a best_knobs.json")

    @model_validator(mode="before")
    @classmethod
    def _old_remeasure_name(cls, data: Any) -> Any:
        # Here it always meant windows per point; autotuning.remeasure_rounds counts rounds of launches.
        if isinstance(data, dict) and "remeasure_rounds" in data:
            if "remeasure_windows" in data:
                raise ValueError("give remeasure_windows only (remeasure_rounds is its old name)")
            logger.warning("autotuning.online.remeasure_rounds is deprecated: it is the windows per re-measured point, "
                           "now autotuning.online.remeasure_windows")
        return data


class AutotuningConfig(Section):
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
    metric: MetricName = Field("throughput", description="throughput | latency (minimised) | FLOPS | goodput "
                               "(ours: throughput x the statistical efficiency of the global batch, from the gradient "
                               "noise scale the profile measures; needs reference_batch_size)")
    reference_batch_size: PositiveInt | None = Field(
        None, description="ours, with metric goodput: the global batch the config's learning rate was chosen for")
    critical_batch_size: PositiveInt | None = Field(
        None, description="ours, with metric goodput: the critical batch B_crit of E(B) = E_min (1 + B/B_crit), used "
                          "in place of the B_noise the profile measures (measured early in training, it can be far "
                          "below the critical batch at the loss you train to: benchmarks/sample_efficiency.py)")
    lr_scaling: Literal["linear", "sqrt", "none"] = Field(
        "none", description="ours, with metric goodput: how the optimal config's learning rate follows its global "
                            "batch against reference_batch_size (linear: Goyal et al.; sqrt: for Adam-like optimizers)")
    adapt_batch: bool = Field(False, description="ours, with metric goodput: the training run (--autotuning run, or "
                              "the optimal config) keeps reading B_noise and grows the global batch through gradient "
                              "accumulation (and the micro-batch, on the engine's own loader) when goodput says a "
                              "larger one reaches the loss sooner (Pollux); the learning rate follows by lr_scaling, "
                              "which must then be given")
    adapt_interval: PositiveInt = Field(100, description="ours: the batch changes at most once in this many optimizer "
                                        "steps (also the noise estimate's smoothing window)")
    adapt_plan: str | None = Field(None, description="written by the tuner into the optimal config: the step costs "
                                   "the batch ramp reads (batch_ramp.json)")
    start_profile_step: PositiveInt = Field(3, description="the first optimizer step timed")
    end_profile_step: PositiveInt = Field(5, description="the last step timed (more with min_window_s)")
    min_window_s: NonNegativeFloat = Field(
        1.0, description="ours: a profile window goes on past end_profile_step until it has lasted this long "
                         "(Bagua's sampling_confidence_time); 0 keeps DeepSpeed's fixed window")
    max_steps_per_window: PositiveInt = Field(100, description="ours: ... or until it holds this many steps")
    metric_path: str | None = None
    model_info_path: str | None = None
    # Checked against the tuner registry when a tune is settled (app/settle.py): a plugin's tuner is a
    # name this layer cannot know, and ranks validate the file without the tuners loaded.
    tuner_type: str = Field("predictive", description='gridsearch, random, model_based, bayes, predictive or '
                            "first_fit (grid's order, stopping at the first that runs), or a plugin's tuner "
                            "(docs/architecture.md); DeepSpeed's default is gridsearch; ours, predictive, "
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
    mp_size: PositiveInt = Field(1, description="model-parallel size of a script on DeepSpeed's engine with its "
                                 "own model parallelism (an mpu): the data-parallel size is the world over it; "
                                 "only 1 on our engine")
    model_info: ModelInfoSection | None = None
    exp_timeout_s: float = Field(600.0, gt=0, description="wall-clock limit of one experiment, seconds")
    memory_per_rank_bytes: PositiveInt | None = Field(
        None, description="overrides the detected per-rank device memory budget"
    )
    max_sequence_length: PositiveInt | None = Field(
        None, description="ours: the longest sequence a batch can hold; where batches vary in length, every "
                          "launch's memory is judged there. Unset: the script's --max_seq_length, --max_length, "
                          "--block_size, --max_source_length or --seq_len, else the longest seen plus the spread")
    warm_start: bool = Field(True, description="fork experiment ranks from a forkserver that preloaded torch and the "
                             "script's imports; false starts every experiment's interpreters cold")
    warm_preload: list[str] = Field(default_factory=list, description="more modules for the forkserver to import, "
                                    "as 'module' or 'module:attribute'")
    online: OnlineConfig = Field(default_factory=OnlineConfig)
    planned_steps: PositiveInt | None = Field(
        None, description="ours: the optimizer steps the training will run; each experiment is then scored by the "
                          "time to run them, one-off costs (compiling) included; unset: the script's --max_steps "
                          "when it has one, else the steady metric alone")
    bound_layouts: bool = Field(True, description="ours: a tensor-parallel degree whose bound from degree 1's launches "
                                                  "cannot beat degree 1's best is not profiled; false profiles it all "
                                                  "the same (to hold the predictions against its launches)")
    cost_per_gpu_hour: PositiveFloat | None = Field(
        None, description="ours: the price of one device (GPU) for an hour, in your currency; the summary then gives "
                          "the planned run's price at the pick and the runner-up beside its device-hours")
    remeasure_top: PositiveInt = Field(3, description="the final pick re-measures up to this many candidates, the "
                                       "best and those that could still beat it by more than 3%, interleaved, and "
                                       "takes the best median")
    # 1: in simulation (benchmarks/transfer_simulated.py, docs/benchmarks/transfer.md) rounds 2 and 3
    # cost 0.3-0.5 launches a tune and changed no pick's regret measurably.
    remeasure_rounds: NonNegativeInt = Field(1, description="at most this many rounds of re-measurement, stopping "
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
        if self.critical_batch_size is not None and self.metric != "goodput":
            raise ValueError(f'critical_batch_size is read only with metric "goodput" (metric is "{self.metric}")')
        if self.metric == "goodput" and self.reference_batch_size is None:
            raise ValueError('metric "goodput" needs reference_batch_size: the global batch the learning rate was '
                             "chosen for (efficiency is measured against it)")
        if self.adapt_batch and self.metric != "goodput":
            raise ValueError(f'adapt_batch grows the batch by goodput: it needs metric "goodput" (metric is '
                             f'"{self.metric}")')
        if self.adapt_batch and "lr_scaling" not in self.model_fields_set:
            raise ValueError('adapt_batch changes the global batch during training: give lr_scaling ("linear", '
                             '"sqrt", or "none" to keep the learning rate)')
        if self.min_train_micro_batch_size_per_gpu > self.max_train_micro_batch_size_per_gpu:
            raise ValueError(
                f"min_train_micro_batch_size_per_gpu ({self.min_train_micro_batch_size_per_gpu}) is larger than "
                f"max_train_micro_batch_size_per_gpu ({self.max_train_micro_batch_size_per_gpu})"
            )
        return self
