"""Transfer in simulation: how a prior step's noise is set, A/B, on a known surface with noisy launches.

    python benchmarks/transfer_simulated.py [--seeds 300] [--noise 0.02,0.05] [--fastest 8 --prior_fastest 16]
                                            [--common_draws] [--bound_z 1.64] [--noise_floor 0.03]

The predictive search (tuning/searches/predictive_search.py) and the prior (tuning/models/transfer.py) as the
tuner runs them, with each launch replaced by a draw: a known step-time surface (a saturating
curve per micro-step, a ZeRO 1 offset of about 5% and a ZeRO 2 offset of about 20%, as flat as
the GPT-2 family on 2 CPU ranks) times log-normal noise of the given spread. Per seed:
1. the smaller model (compute x1) is tuned cold: the profile (ZeRO 0 at micro-batch 4 and 16),
   the search, and one re-measurement of its best two (what a real run's history holds);
2. the larger model (compute x2) is tuned three ways from the same first launch (ZeRO 0,
   micro-batch 4): cold; with that run as a prior at a launch's noise for every step ("launch
   floor", before 2026-11-26); and at that run's own re-measured spread ("run spread", run_noise,
   now). The profile's second launch is at half the largest size in every arm (since 2026-11-27 a
   prior no longer chooses it); then the search, then the final pick's re-measurements
   (final_pick.py, the config's defaults).
Reported per arm: the search's launches after the profile (mean), the share of seeds where the arm
launched more than cold did (issue 49: a warm start must never cost more), and the pick's true
regret (the best configuration's true samples/s over the pick's, less one: mean, 90th percentile,
worst). `--prior_fastest` gives the earlier model another shape than the larger one's. By default each arm
draws its launches' noise from one stream in launch order, so two arms that launch in another
order draw differently for the same experiment; with `--common_draws` the n-th launch of an
experiment draws the same in every arm (common random numbers), so arms differ by their
decisions alone. `--bound_z` and `--noise_floor` replace the launch bound's one-sided z and the
noise the step-time model assumes for each launch (the worthwhile gain stays 3%): what a tuner
that launched on less evidence would save, and what its picks would lose.
Pure computation: nothing is launched, so this isolates the model from a machine's noise.
"""

from __future__ import annotations

import argparse
import collections
import math
import zlib
import statistics
import sys
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotuner.tuning.models import cost_model, transfer  # noqa: E402
from autotuner.tuning.tuners import predictive  # noqa: E402
from autotuner.tuning.models.cost_model import NOISE_FLOOR, CostContext, Observation  # noqa: E402
from autotuner.tuning.searches.final_pick import final_pick_rounds  # noqa: E402
from autotuner.tuning.tuners.predictive import pooled_rule  # noqa: E402
from autotuner.tuning.searches.predictive_search import run_predictive_search  # noqa: E402
from autotuner.core.boundary import Measurement  # noqa: E402
from autotuner.tuning.space.records import Objective, TrialResult, TrialState  # noqa: E402
from autotuner.tuning.space.search_space import SearchPolicy, SearchSpace  # noqa: E402
from autotuner.tuning.space.experiment import Experiment  # noqa: E402

GLOBAL_BATCH, RANKS = 64, 2
SPACE = SearchSpace(stages=(0, 1, 2), data_parallel_size=RANKS, max_micro_batch_size=32,
                    global_batch_size=GLOBAL_BATCH)
POLICY = SearchPolicy(Objective("throughput"), "predictive", 50, 50, 0, True)
LARGEST = {stage: 32 for stage in SPACE.stages}
SMALL = transfer.WorkloadSignature("gpt", "autotuner", "cpu", RANKS, "fp32", 1_000_000, 4096, 1.0e9)
LARGE = transfer.WorkloadSignature("gpt", "autotuner", "cpu", RANKS, "fp32", 2_000_000, 8192, 2.0e9)
STAGE_OFFSET_S = {0: 0.0, 1: 0.011, 2: 0.045}  # of a step near 0.22 s at compute x1


CURVATURE = {16: 0.00005, 8: 0.0002}  # per-sample time's rise with the micro-batch: the fastest size it leaves


def true_step_s(experiment: Experiment, compute: float) -> float:
    m, g = experiment.micro_batch_size, experiment.gradient_accumulation_steps
    q = CURVATURE[FASTEST[0] if compute > 1.0 else FASTEST[1]]  # the larger model's, or the earlier run's
    return g * compute * (0.02 + 0.004 * m + q * m * m) + STAGE_OFFSET_S[experiment.zero_stage] * compute


# Set from --fastest and --prior_fastest: the larger model's best micro-batch (16: the cold profile's
# second size; 8: not), and the earlier, smaller model's (another: the shape changed, as a fourfold
# width moves where the compute saturates).
FASTEST = [16, 16]
# Set from --remeasure_top and --remeasure_rounds: the larger model's final pick (autotuning keys of
# the same names); the earlier run's keeps the defaults, as its history was written.
FINAL_PICK = [3, 3]
COMMON_DRAWS = [False]  # set from --common_draws


def samples_per_s(experiment: Experiment, step_s: float) -> float:
    return experiment.train_batch_size(RANKS) / step_s


class Launches:
    """Noisy launches of one model: each a draw around the true step time; now and then (`outliers`)
    a window disturbed by another process, 10-30% slower."""

    def __init__(self, compute: float, noise: float, rng: np.random.Generator, outliers: float,
                 common_seed: int | None = None):
        self.compute, self.noise, self.rng, self.outliers, self.count = compute, noise, rng, outliers, 0
        self.common_seed = common_seed  # set: each experiment's n-th launch draws from its own stream
        self.launched: collections.Counter = collections.Counter()

    def _draws(self, experiment: Experiment) -> np.random.Generator:
        self.launched[experiment] += 1
        if self.common_seed is None:
            return self.rng
        return np.random.default_rng([self.common_seed, zlib.crc32(experiment.name.encode()),
                                      self.launched[experiment]])

    def __call__(self, experiment: Experiment, run: int = 0) -> TrialResult:
        self.count += 1
        rng = self._draws(experiment)
        step = true_step_s(experiment, self.compute) * math.exp(rng.normal(0.0, self.noise))
        if rng.random() < self.outliers:
            step *= rng.uniform(1.1, 1.3)
        value = samples_per_s(experiment, step)
        return TrialResult(experiment, TrialState.OK, value=value, measurement=Measurement(value, step))


def profile(launch: Launches) -> list[TrialResult]:
    return [launch(SPACE.experiment(0, m)) for m in (4, 16)]


def search(launch: Launches, known: list[TrialResult], prior: tuple[Observation, ...]) -> list[TrialResult]:
    context = CostContext(num_params=0, world_size=RANKS, prior=prior)
    outcome = run_predictive_search(SPACE, POLICY, LARGEST, launch, lambda *a, **k: None, context, known)
    return [r for r in outcome.results if r.state is TrialState.OK]


def final_pick(launch: Launches, results: list[TrialResult], settings: tuple[int, int] | None = None,
               prior: tuple[Observation, ...] = ()) -> tuple[Experiment, list[TrialResult]]:
    """The tuner's final pick (final_pick.py) with (remeasure_top, remeasure_rounds): `settings`,
    else FINAL_PICK; the search's step-time model (with `prior`) may rule contenders out, as the
    orchestrator's does."""
    top, rounds = settings or FINAL_PICK
    ruled_out = pooled_rule(results, POLICY.objective, CostContext(num_params=0, world_size=RANKS, prior=prior))
    pick, remeasured, _ = final_pick_rounds(results, POLICY.objective, top, rounds,
                                            lambda experiment, run, reuse: launch(experiment, run), lambda line: None,
                                            ruled_out=ruled_out)
    return pick.experiment, [result for _, result in remeasured]


def prior_run(noise: float, rng: np.random.Generator, outliers: float) -> transfer.PriorRun:
    """The smaller model tuned cold, re-measurements included, as the history keeps it."""
    launch = Launches(1.0, noise, rng, outliers)
    known = profile(launch)
    results = known + search(launch, known, ())
    results += final_pick(launch, results, (3, 3))[1]  # the defaults, as its history was written
    steps = tuple(Observation(r.experiment, r.measurement.latency) for r in results)
    return transfer.PriorRun("small", SMALL, steps)


def regret(pick: Experiment) -> float:
    best_true = max(samples_per_s(e, true_step_s(e, 2.0)) for e in candidates())
    return best_true / samples_per_s(pick, true_step_s(pick, 2.0)) - 1


def candidates() -> list[Experiment]:
    return [SPACE.experiment(s, m) for s in SPACE.stages for m in (2, 4, 8, 16, 32)]


def one_seed(seed: int, noise: float, outliers: float) -> dict[str, tuple[int, int, float]]:
    """Each arm's (search launches, re-measurements, regret); the profile's second launch is at
    half the largest size in every arm, as the tuner places it with a prior or without."""
    rng = np.random.default_rng(seed)
    earlier = prior_run(noise, rng, outliers)
    first = Launches(2.0, noise, rng, outliers, seed + 10_000 if COMMON_DRAWS[0] else None)(SPACE.experiment(0, 4))
    context = CostContext(world_size=RANKS)
    arms = {}
    for arm in ("cold", "launch floor", "run spread"):
        run_noise = (lambda steps: NOISE_FLOOR) if arm == "launch floor" else transfer.run_noise
        arm_launch = Launches(2.0, noise, np.random.default_rng(seed + 10_000), outliers,  # each arm: the same stream
                              seed + 10_000 if COMMON_DRAWS[0] else None)
        arm_launch.launched[first.experiment] += 1  # `first` was its first launch: a re-measurement draws anew
        prior: tuple[Observation, ...] = ()
        with mock.patch.object(transfer, "run_noise", run_noise):
            known = [first, arm_launch(SPACE.experiment(0, 16))]  # the profile's second: half the largest, every arm
            if arm != "cold":
                measured = [Observation(r.experiment, r.measurement.latency) for r in known]
                prior = transfer.transfer_prior([earlier], LARGE, context, measured, lambda line: None).observations
        profiled = arm_launch.count
        results = known + search(arm_launch, known, prior)
        searched = arm_launch.count - profiled
        pick, _ = final_pick(arm_launch, results, prior=prior)
        arms[arm] = (searched, arm_launch.count - profiled - searched, regret(pick))
    return arms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=300)
    parser.add_argument("--noise", default="0.02,0.05", help="launches' log-normal spreads, one table row each")
    parser.add_argument("--outliers", type=float, default=0.05, help="share of disturbed windows (10-30%% slower)")
    parser.add_argument("--fastest", type=int, choices=sorted(CURVATURE), default=16,
                        help="the true surface's fastest micro-batch (16 is where a cold profile's second launch goes)")
    parser.add_argument("--prior_fastest", type=int, choices=sorted(CURVATURE), default=None,
                        help="the earlier run's fastest micro-batch (default: --fastest; another: a changed shape)")
    parser.add_argument("--remeasure_top", type=int, default=3,
                        help="the larger model's final pick: autotuning.remeasure_top (default 3)")
    parser.add_argument("--remeasure_rounds", type=int, default=3,
                        help="... and autotuning.remeasure_rounds (default 3; 0 re-measures nothing)")
    parser.add_argument("--common_draws", action="store_true",
                        help="the n-th launch of an experiment draws the same noise in every arm")
    parser.add_argument("--bound_z", type=float, default=predictive.BOUND_Z,
                        help="the launch bound's one-sided z (the tuner's: %(default)s)")
    parser.add_argument("--noise_floor", type=float, default=cost_model.NOISE_FLOOR,
                        help="the step-time model's assumed noise of one launch (the tuner's: %(default)s)")
    args = parser.parse_args()
    # What-if settings for this simulation only: the launch decision reads predictive.BOUND_Z and
    # the fit reads cost_model.NOISE_FLOOR; the worthwhile gain keeps the tuner's 3%.
    predictive.BOUND_Z, cost_model.NOISE_FLOOR = args.bound_z, args.noise_floor
    COMMON_DRAWS[0] = args.common_draws
    FASTEST[:] = [args.fastest, args.prior_fastest or args.fastest]
    FINAL_PICK[:] = [args.remeasure_top, args.remeasure_rounds]
    print(f"{args.seeds} seeds, {args.outliers:.0%} disturbed windows, fastest micro-batch {FASTEST[0]} "
          f"(the earlier run's: {FASTEST[1]}); final pick: remeasure_top {args.remeasure_top}, remeasure_rounds "
          f"{args.remeasure_rounds}; {'common draws per experiment' if args.common_draws else 'one draw stream per arm'}; "
          f"launch bound z {args.bound_z}, model noise floor {args.noise_floor:.1%}; launches after the profile's 2, means")
    print("| launch noise | arm | search | re-measured | all (with the profile's 2) | seeds with more launches "
          "than cold | regret mean | regret p90 | regret worst | picks 2%+ behind |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for noise in (float(n) for n in args.noise.split(",")):
        per_arm: dict[str, list[tuple[int, int, float]]] = {}
        for seed in range(args.seeds):
            for arm, outcome in one_seed(seed, noise, args.outliers).items():
                per_arm.setdefault(arm, []).append(outcome)
        cold = [searched + remeasured for searched, remeasured, _ in per_arm["cold"]]
        for arm, outcomes in per_arm.items():
            more = sum(n + r > c for (n, r, _), c in zip(outcomes, cold)) / len(outcomes)
            searched = statistics.fmean(n for n, _, _ in outcomes)
            remeasured = statistics.fmean(n for _, n, _ in outcomes)
            regrets = sorted(r for _, _, r in outcomes)
            p90 = regrets[int(0.9 * (len(regrets) - 1))]
            behind = sum(r >= 0.02 for r in regrets) / len(regrets)
            print(f"| {noise:.0%} | {arm} | {searched:.2f} | {remeasured:.2f} | {2 + searched + remeasured:.2f} | {more:.1%} | "
                  f"{statistics.fmean(regrets):.2%} | {p90:.2%} | {regrets[-1]:.2%} | {behind:.0%} |")


if __name__ == "__main__":
    main()
