"""The throughput model behind tuner_type "predictive": step time with an uncertainty. Pure.

Step time of one optimizer step, for ZeRO stage s, micro-batch m and gas g:

    T = g x compute(m) + communication(s, g) + offset(group)

- g is gas + pp - 1 on a pipeline of pp stages: its schedules (1F1B and GPipe alike) take m + pp - 1
  stage-steps for m micro-batches, the bubble (pp - 1) / m; compute(m) is then one stage's
  micro-step. With v virtual stages per rank (Interleaved1F1B, LoopedBFS) a rank's step is
  v m + pp - 1 chunk-steps of 1/v of that each: g = gas + (pp - 1) / v. The point-to-point sends of a micro-step's activations and their gradients grow
  with m as a + b m does, so within one layout's launches they are in its fit.
- compute(m) = a + b m + q m^2 is the time of one micro-step's forward and backward. a + b m
  alone is the saturating curve (throughput m / (a + b m) rises to 1/b); q lets the per-sample
  time turn up again (caches spill on a CPU), so the knee can sit anywhere.
- communication(s, g) is costed from the bytes each stage moves per step and the links the
  profile timed on the real process group (comm_fit.LinkFit): DDP all-reduces the fp32
  gradients; ZeRO 1 then also gathers the updated parameters; FSDP2 gathers the compute copy
  of the parameters (stage 2 once per step, stage 3 before forward and backward of every
  micro-step) and reduce-scatters the gradients. On DeepSpeed's engine its own ZeRO optimizers'
  collectives are costed instead (communication_s).
- under activation checkpointing, g x r_p m adds policy p's recompute, learned per policy from
  its launches (its prior: zero, within half the compute per sample).
- offset(group) is what the costing misses for one stage and knob setting (overlap with
  backward, the optimizer step, sharding's bookkeeping), learned from its launches; ZeRO 2 and 3,
  one sharded engine, lend each other theirs until their own is measured.
- g x d_f m is engine family f's own time per sample beside the shared b (DDP and FSDP2 run
  different kernels and hooks per sample: on an H200, FSDP2's step grew 0.26 ms per sample where
  DDP's grew 2 ms, and ZeRO 3 at micro-batch 128 ran 30% faster than ZeRO 0). Zero-mean prior,
  so with one family measured it is the shared curve; the profile times both.

All parameters are fitted at once by Bayesian linear regression with known noise: measured
steps vary by NOISE_FLOOR at least (run to run, on these machines), the curvature q and the
offsets have priors scaled to the times measured, so with few launches the prediction is
uncertain exactly where it extrapolates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autotuner.core.engine_kind import Engine
from autotuner.tuning.models.comm_fit import LinkFit
from autotuner.tuning.space import dimensions
from autotuner.tuning.space.experiment import Experiment

NOISE_FLOOR = 0.03  # relative run-to-run spread of one measured step time
BOUND_Z = 1.64  # one-sided 95%: a candidate is launched while its bound could beat the best
CURVATURE_PRIOR = 3.0  # q m^2 at the largest size: a few times the compute time a line would give there
OFFSET_PRIOR = 0.5  # an unmeasured group's offset: within this fraction of its costed communication
OFFSET_FLOOR = 0.05  # ... and of the step time (the optimizer step, overlap: not costed)
RECOMPUTE_PRIOR = 0.5  # checkpointing's recompute per sample: within half the compute per sample (a forward's share)
FAMILY_SLOPE_PRIOR = 0.5  # an engine family's own time per sample: within half the shared one
FP32_BYTES = 4


@dataclass(frozen=True)
class CostContext:
    """What the model knows without timing a step: the model's size and the links' speed."""

    num_params: int = 0
    world_size: int = 1
    compute_bytes: int = FP32_BYTES  # 2 under bf16/fp16: what FSDP2 gathers per parameter
    links: tuple[LinkFit, ...] = ()
    # Step times of similar earlier runs, scaled to this model (tuning/models/transfer.py): fitted with
    # the launches, at their wider noise.
    prior: tuple["Observation", ...] = ()
    engine: Engine = Engine.OURS  # whose engine runs the launches: which stages share a family

    def family(self, stage: int) -> str:
        from autotuner.tuning.memory.estimate import engine_family

        return engine_family(stage, self.engine)

    def link(self, op: str) -> LinkFit | None:
        found = {link.op: link for link in self.links}
        # gloo has no reduce_scatter on CPU; an all_reduce moves at least as much.
        return found.get(op) or (found.get("all_reduce") if op == "reduce_scatter" else None)

    def communication_s(self, stage: int, gradient_accumulation_steps: int) -> float:
        """Seconds of collectives per optimizer step, as the stage runs them."""
        if self.world_size <= 1 or self.num_params <= 0:
            return 0.0
        gradients = FP32_BYTES * self.num_params
        weights = self.compute_bytes * self.num_params
        calls: list[tuple[str, float, int]] = []
        if self.engine == Engine.DEEPSPEED and stage >= 1:
            # DeepSpeed's ZeRO optimizers: stage 1 all-reduces the gradients, 2 and 3 reduce-scatter
            # them; stages 1 and 2 then all-gather the updated compute copy of every partition, and
            # stage 3 gathers the parameters before forward and backward of every micro-step.
            calls.append(("all_reduce" if stage == 1 else "reduce_scatter", gradients, 1))
            calls.append(("all_gather", weights, 1 if stage < 3 else 2 * gradient_accumulation_steps))
        elif stage <= 1:
            calls.append(("all_reduce", gradients, 1))
            if stage == 1:
                calls.append(("all_gather", FP32_BYTES * self.num_params, 1))
        else:
            gathers = 1 if stage == 2 else 2 * gradient_accumulation_steps
            calls += [("all_gather", weights, gathers), ("reduce_scatter", gradients, 1)]
        total = 0.0
        for op, nbytes, count in calls:
            link = self.link(op)
            if link is not None:
                total += count * link.seconds(nbytes)
        return total


@dataclass(frozen=True)
class Observation:
    """One measured launch: its experiment and step time in seconds."""

    experiment: Experiment
    step_time_s: float
    relative_noise: float = NOISE_FLOOR


@dataclass(frozen=True)
class StepTimePrediction:
    mean_s: float
    std_s: float  # the model's uncertainty about the mean, plus one measurement's noise

    def bounds(self, z: float = BOUND_Z) -> tuple[float, float]:
        """(fastest, slowest) plausible step time; the fastest never below a tenth of the mean."""
        return max(self.mean_s - z * self.std_s, 0.1 * self.mean_s), self.mean_s + z * self.std_s


def stage_steps(experiment: Experiment) -> float:
    """The micro-steps on a step's critical path: gas, and on a pipeline the bubble's pp - 1 too,
    (pp - 1) / v with v virtual stages per rank (each chunk-step 1/v of a stage's micro-step).
    InterleavedZeroBubble is costed so too, though its action lists leave about a third of that
    idle (pp - 1 slots of a third of a chunk-step): a bound on the slow side, which the layout's
    own launches fit past."""
    bubble = max(0, experiment.pipeline - 1) / max(1, experiment.stages_per_rank)
    return experiment.gradient_accumulation_steps + bubble


def group_of(experiment: Experiment) -> tuple:
    """Experiments that share an offset: one stage with one setting of the offset dimensions (a
    dimension whose cost grows with the micro-batch has a per-sample term instead: below)."""
    per_sample = dimensions.per_sample_names()
    return (experiment.zero_stage, tuple(kv for kv in experiment.knobs if kv[0] not in per_sample))


def recompute_of(experiment: Experiment) -> tuple | None:
    """The per-sample dimensions' values whose time per sample the step pays (activation
    checkpointing's recompute), or None at their neutral values."""
    paid = tuple((name, value) for name, value in experiment.knobs if name in dimensions.per_sample_names()
                 and value != dimensions.dimension(name).neutral_value())
    return paid or None


class StepTimeModel:
    """Fitted once from observations; predicts any experiment of the candidate space."""

    def __init__(self, observations: list[Observation], context: CostContext, largest_micro_batch: int):
        self.context = context
        self.scale_m = float(max(1, largest_micro_batch))
        self.groups = sorted({group_of(o.experiment) for o in observations}, key=repr)
        # Recompute under checkpointing: a per-sample time per policy, learned from its launches;
        # unmeasured, it is only a prior (zero mean: the bound stays optimistic, its spread wide).
        self.recomputes = sorted({r for o in observations if (r := recompute_of(o.experiment)) is not None})
        families = sorted({context.family(o.experiment.zero_stage) for o in observations})
        self.families = families if len(families) > 1 else []  # one family: the shared slope is its own
        times = [o.step_time_s for o in observations]
        self.typical_s = float(np.median(times)) if times else 1.0
        per_sample = [o.step_time_s / (stage_steps(o.experiment) * o.experiment.micro_batch_size)
                      for o in observations]
        compute_at_largest = (float(np.median(per_sample)) if per_sample else 1.0) * self.scale_m
        wide = (100.0 * self.typical_s) ** 2
        self._prior_var = np.array([wide, wide, (CURVATURE_PRIOR * compute_at_largest) ** 2])
        self._recompute_var = (RECOMPUTE_PRIOR * compute_at_largest) ** 2
        self._family_var = (FAMILY_SLOPE_PRIOR * compute_at_largest) ** 2
        if not observations:
            self._mean = np.zeros(3)
            self._cov = np.diag(self._prior_var)
            return
        rows = np.array([self._features(o.experiment, fitted_groups=True) for o in observations])
        targets = np.array([o.step_time_s - self._costed_s(o.experiment) for o in observations])
        noise = np.array([max(o.relative_noise, NOISE_FLOOR) * o.step_time_s for o in observations])
        prior_var = np.concatenate([self._prior_var, [self._offset_var(g) for g in self.groups],
                                    [self._recompute_var] * len(self.recomputes),
                                    [self._family_var] * len(self.families)])
        self._fit(rows, targets, noise, prior_var)
        if self._mean[0] < 0:
            # A micro-step's fixed cost is never negative; pinned at 0, the curvature explains the data.
            # The pin settles the mean only: the uncertainty stays the unpinned fit's, which holds
            # what the launches leave open. Pinned with no variance, a two-size profile's posterior
            # was 5-8x narrower than its error on a noiseless curved surface.
            unpinned_cov = self._cov
            prior_var[0] = (1e-9 * self.typical_s) ** 2
            self._fit(rows, targets, noise, prior_var)
            self._cov = unpinned_cov

    def _fit(self, rows: np.ndarray, targets: np.ndarray, noise: np.ndarray, prior_var: np.ndarray) -> None:
        precision = np.diag(1.0 / prior_var) + rows.T @ (rows / noise[:, None] ** 2)
        self._cov = np.linalg.inv(precision)
        self._mean = self._cov @ (rows.T @ (targets / noise**2))

    def _costed_s(self, experiment: Experiment) -> float:
        return self.context.communication_s(experiment.zero_stage, experiment.gradient_accumulation_steps)

    def _offset_var(self, group: tuple) -> float:
        costed = self.context.communication_s(group[0], 1)
        return (OFFSET_PRIOR * costed + OFFSET_FLOOR * self.typical_s) ** 2

    def _features(self, experiment: Experiment, fitted_groups: bool) -> np.ndarray:
        g = float(stage_steps(experiment))
        m = experiment.micro_batch_size / self.scale_m
        base = [g, g * m, g * m * m]
        if fitted_groups:
            base += [1.0 if group_of(experiment) == group else 0.0 for group in self.groups]
            base += [g * m if recompute_of(experiment) == policy else 0.0 for policy in self.recomputes]
            family = self.context.family(experiment.zero_stage)
            base += [g * m if family == f else 0.0 for f in self.families]
        return np.array(base)

    def _posterior(self, experiment: Experiment) -> tuple[float, float, np.ndarray]:
        """The true step's posterior mean and variance (no launch's noise), and the features whose
        fitted part it shares with other experiments."""
        x = self._features(experiment, fitted_groups=True) if self.groups else self._features(experiment, False)
        mean = float(x @ self._mean) + self._costed_s(experiment)
        variance = float(x @ self._cov @ x)
        group = group_of(experiment)
        if group not in self.groups:
            variance += self._offset_var(group)  # an offset never measured: its prior
            # ZeRO 2 and 3 run one sharded engine (its bookkeeping, its sharded optimizer step): an
            # unmeasured one starts from the other's measured offset rather than from nothing.
            twin = (5 - group[0], group[1]) if group[0] >= 2 else None
            if twin in self.groups:
                mean += float(self._mean[3 + self.groups.index(twin)])
        policy = recompute_of(experiment)
        if policy is not None and policy not in self.recomputes:
            # A policy never launched: its recompute per sample is the prior's.
            g, m = stage_steps(experiment), experiment.micro_batch_size / self.scale_m
            variance += (g * m) ** 2 * self._recompute_var
        if self.families and self.context.family(experiment.zero_stage) not in self.families:
            g, m = stage_steps(experiment), experiment.micro_batch_size / self.scale_m
            variance += (g * m) ** 2 * self._family_var  # a family never launched: its prior
        return max(mean, 1e-9 * self.typical_s), max(variance, 0.0), x

    def predict(self, experiment: Experiment) -> StepTimePrediction:
        """What a launch of `experiment` would measure: the true step's posterior plus one launch's noise."""
        mean, variance, _ = self._posterior(experiment)
        noise = NOISE_FLOOR * mean
        return StepTimePrediction(mean, math.sqrt(variance + noise**2))

    def compare(self, candidate: Experiment, incumbent: Experiment) -> StepRatio:
        """The candidate's true step against the incumbent's, from one posterior: what the two share
        (the slope, a group's offset) cancels in the difference, and neither carries a launch's
        noise. The incumbent's own measurements are in the fit, so a lucky window of its own is
        shrunk toward what its neighbours measured."""
        mean_c, var_c, x_c = self._posterior(candidate)
        mean_i, var_i, x_i = self._posterior(incumbent)
        covariance = float(x_c @ self._cov @ x_i)
        relative_var = var_c / mean_c**2 + var_i / mean_i**2 - 2 * covariance / (mean_c * mean_i)
        return StepRatio(mean_c, mean_i, math.sqrt(max(relative_var, 0.0)))


@dataclass(frozen=True)
class StepRatio:
    """A candidate's true step time over an incumbent's, as the fitted model sees the pair."""

    candidate_s: float  # posterior means
    incumbent_s: float
    relative_std: float  # of (candidate step / incumbent step), relative to the ratio of the means


@dataclass(frozen=True)
class Prediction:
    """The objective's predicted value for one experiment, and its plausible range (same units)."""

    value: float
    low: float
    high: float
