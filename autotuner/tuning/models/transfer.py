"""Transfer: the predictive tuner's warm start from similar runs in the tuning history.

A run's workload signature (its model family, engine, device, ranks and precision, with the
model's size: parameters, activations and FLOPs per sample) is kept on its study in the history
(tuning/trials/history.py). A later run of the same family, engine, device, ranks and precision, at
another size, reads those studies' measured step times and scales each to its own model:

    step = compute + communication
    compute scales with the FLOPs per sample (the ratio is measured on this run's profile
    launches, and must agree with the FLOPs ratio within a factor of PHYSICS_FACTOR);
    communication is costed afresh from this model's bytes (cost_model.CostContext).

The scaled steps enter the step-time model as observations with a wider noise than a launch's
(the spread of the ratios the profile launches measured, or PRIOR_NOISE when one launch did,
beside the earlier run's own run-to-run spread as its re-measurements show it), so this run's own
launches outweigh them. The profile still runs: it is what
checks the prior. A prior whose scaled curve disagrees with the profile launches beyond their
uncertainty is dropped, with one line. Nothing is launched here.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, replace
from typing import Any, Callable

from autotuner.core.engine_kind import Engine
from autotuner.core.boundary import ModelInfo
from autotuner.tuning.models.cost_model import BOUND_Z, NOISE_FLOOR, CostContext, Observation, StepTimeModel
from autotuner.tuning.models.noise import NoiseLevel
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.space.experiment import Experiment

PRIOR_NOISE = 0.08  # relative spread given to a scaled prior step: wider than a launch's (cost_model.NOISE_FLOOR)
PHYSICS_FACTOR = 2.0  # the measured compute ratio must lie within this factor of the FLOPs ratio
SHAPE_TOLERANCE = 0.25  # profile launches' compute ratios may differ by this much (plus their uncertainty)
MAX_PRIOR_RUNS = 3  # the most recent similar runs read
MIN_PRIOR_STEPS = 2


@dataclass(frozen=True)
class WorkloadSignature:
    family: str  # runtime/measure/model_family.py: module types and block structure, sizes left out
    engine: Engine
    device: str
    world_size: int
    precision: str
    num_params: int
    activation_bytes_per_sample: int
    flops_per_sample: float | None = None
    sequence_length: int = 0  # of the model's input; a change is a change of size (FLOPs, activations)

    def similar(self, other: "WorkloadSignature") -> bool:
        """Same family, engine, device, ranks and precision: the size may differ."""
        return bool(self.family) and (self.family, self.engine, self.device, self.world_size, self.precision) == (
            other.family, other.engine, other.device, other.world_size, other.precision)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "WorkloadSignature":
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def flops_per_sample(results: list[TrialResult]) -> float | None:
    """FLOPs per sample per rank, from a profile launch's FLOP count (FLOPS x step time)."""
    for result in results:
        m = result.measurement
        if result.state is TrialState.OK and m is not None and m.FLOPS_per_gpu and m.latency > 0:
            e = result.experiment
            return m.FLOPS_per_gpu * m.latency / (e.micro_batch_size * e.gradient_accumulation_steps)
    return None


def signature_of(info: ModelInfo, engine: Engine, activation_bytes_per_sample: int,
                 profile_results: list[TrialResult]) -> WorkloadSignature:
    return WorkloadSignature(info.model_family, engine, info.device_name, info.world_size, info.precision,
                             info.num_params, int(activation_bytes_per_sample), flops_per_sample(profile_results),
                             info.sequence_length)


@dataclass(frozen=True)
class PriorRun:
    """One earlier similar run, as its study in the history holds it."""

    study_name: str
    signature: WorkloadSignature
    steps: tuple[Observation, ...]  # measured step times, at the earlier model's size
    last_run_unix: float = 0.0


@dataclass(frozen=True)
class TransferPrior:
    observations: tuple[Observation, ...] = ()  # scaled to this run's model
    used: tuple[str, ...] = ()  # study names
    lines: tuple[str, ...] = ()  # what the summary says about each prior run, used or dropped


def _number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def experiment_of(params: dict[str, Any]) -> Experiment:
    knobs = {k: _number(v) for k, v in params.items()
             if k not in ("zero_stage", "micro_batch_size", "gradient_accumulation_steps", "tensor_parallel",
                           "pipeline", "stages_per_rank")}
    return Experiment(int(params["zero_stage"]), int(params["micro_batch_size"]),
                      int(params["gradient_accumulation_steps"]),
                      tensor_parallel=int(params.get("tensor_parallel", 0)),
                      pipeline=int(params.get("pipeline", 0)),
                      stages_per_rank=int(params.get("stages_per_rank", 0))).with_knobs(knobs)


def load_prior_runs(storage, signature: WorkloadSignature, own_study: str) -> list[PriorRun]:
    """The most recent similar runs in `storage` (optuna's), other than this run's own study."""
    import optuna

    found = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        data = summary.user_attrs.get("signature")
        if summary.study_name == own_study or not isinstance(data, dict):
            continue
        try:
            theirs = WorkloadSignature.from_json(data)
        except TypeError:
            continue
        if not signature.similar(theirs):
            continue
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        steps = []
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            latency = trial.user_attrs.get("latency")
            if isinstance(latency, (int, float)) and latency > 0:
                steps.append(Observation(experiment_of(trial.params), float(latency)))
        if len(steps) >= MIN_PRIOR_STEPS:
            found.append(PriorRun(summary.study_name, theirs, tuple(steps),
                                  float(summary.user_attrs.get("last_run_unix") or 0.0)))
    return sorted(found, key=lambda run: -run.last_run_unix)[:MAX_PRIOR_RUNS]


def load_late_noise(storage, signature: WorkloadSignature, own_study: str) -> tuple[float, str, int] | None:
    """The latest B_noise a similar earlier run's training read (History.record_late_noise), by
    when that run was tuned: (B_noise, its study, the step it was read at), or None."""
    import optuna

    found = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        late, data = summary.user_attrs.get("late_noise_scale"), summary.user_attrs.get("signature")
        if summary.study_name == own_study or not isinstance(late, dict) or not isinstance(data, dict):
            continue
        try:
            similar = signature.similar(WorkloadSignature.from_json(data))
        except TypeError:
            continue
        if similar and isinstance(late.get("b_noise"), (int, float)) and late["b_noise"] > 0:
            found.append((float(summary.user_attrs.get("last_run_unix") or 0.0), float(late["b_noise"]),
                          summary.study_name, int(late.get("step", 0))))
    if not found:
        return None
    _, b_noise, study, step = max(found)
    return b_noise, study, step


def run_noise(steps: tuple[Observation, ...]) -> float:
    """An earlier run's relative run-to-run spread, as its final pick measured it (the configurations
    it launched more than once), never below a launch's NOISE_FLOOR."""
    by_experiment: dict[Experiment, list[float]] = {}
    for observation in steps:
        by_experiment.setdefault(observation.experiment, []).append(observation.step_time_s)
    return max(NOISE_FLOOR, NoiseLevel.of(by_experiment).relative)


def _compute_part(step_s: float, context: CostContext, experiment: Experiment) -> float:
    communication = context.communication_s(experiment.zero_stage, experiment.gradient_accumulation_steps)
    return max(step_s - communication, 0.05 * step_s)


def scale_prior(prior: PriorRun, signature: WorkloadSignature, context: CostContext,
                measured: list[Observation]) -> tuple[tuple[Observation, ...], str]:
    """The prior's steps scaled to this run's model, checked against this run's profile launches
    (`measured`); ((), why) when it disagrees with them."""
    theirs = prior.signature
    their_context = replace(context, num_params=theirs.num_params)
    largest = max(o.experiment.micro_batch_size for o in prior.steps)
    their_model = StepTimeModel(list(prior.steps), their_context, largest)
    ratios, spreads = [], []
    for observation in measured:
        predicted = their_model.predict(observation.experiment)
        their_compute = _compute_part(predicted.mean_s, their_context, observation.experiment)
        ratios.append(_compute_part(observation.step_time_s, context, observation.experiment) / their_compute)
        spreads.append(predicted.std_s / predicted.mean_s)
    if not ratios:
        return (), "no profile launch was measured to check it against"
    ratio = statistics.median(ratios)
    if theirs.flops_per_sample and signature.flops_per_sample:
        expected, basis = signature.flops_per_sample / theirs.flops_per_sample, "FLOPs per sample"
    else:
        expected, basis = signature.num_params / max(1, theirs.num_params), "parameters"
    if not expected / PHYSICS_FACTOR <= ratio <= expected * PHYSICS_FACTOR:
        return (), (f"the profile measured {ratio:.2f}x its compute per step where its {basis} say "
                    f"{expected:.2f}x")
    tolerance = SHAPE_TOLERANCE + BOUND_Z * math.sqrt(2) * max(spreads)
    if max(ratios) / min(ratios) - 1 > tolerance:
        return (), (f"its curve disagrees with the profile launches: compute ratios "
                    f"{', '.join(f'{r:.2f}' for r in ratios)} differ by more than {tolerance:.0%}")
    # How far one ratio scales the whole curve, as the profile launches show it: their ratios'
    # spread; with one launch to show it, PRIOR_NOISE. Beside it, the earlier run's own noise, as
    # its repeated launches measured it: a stage's lead there within that noise is no lead here.
    shape = max(ratios) / min(ratios) - 1 if len(ratios) > 1 else PRIOR_NOISE
    noise = math.hypot(run_noise(prior.steps), shape)
    scaled = tuple(Observation(o.experiment, _compute_part(o.step_time_s, their_context, o.experiment) * ratio
                               + context.communication_s(o.experiment.zero_stage,
                                                         o.experiment.gradient_accumulation_steps),
                               noise)
                   for o in prior.steps)
    return scaled, f"compute {ratio:.2f}x (its {basis}: {expected:.2f}x), each step within {noise:.0%}"


def size_text(signature: WorkloadSignature) -> str:
    """A workload's size as a line names it: its parameters, and its sequence length where it has one."""
    length = f", sequence length {signature.sequence_length}" if signature.sequence_length else ""
    return f"{signature.num_params:,} parameters{length}"


def transfer_prior(priors: list[PriorRun], signature: WorkloadSignature, context: CostContext,
                   measured: list[Observation], report: Callable[[str], None]) -> TransferPrior:
    observations: list[Observation] = []
    used, lines = [], []
    for prior in priors:
        size = size_text(prior.signature)
        scaled, why = scale_prior(prior, signature, context, measured)
        if scaled:
            observations += scaled
            used.append(prior.study_name)
            line = f"transfer: using {len(scaled)} measured steps of {prior.study_name} ({size}): {why}"
        else:
            line = f"transfer: prior {prior.study_name} ({size}) dropped: {why}"
        report(line)
        lines.append(line)
    return TransferPrior(tuple(observations), tuple(used), tuple(lines))
