"""benchmarks/tuning_quality.py's one-launch spread: the noise figure the docs cite for the
machine, pooled over the grid's repeated configurations."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import TrialResult, TrialState

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _benchmark():
    spec = importlib.util.spec_from_file_location("tuning_quality", BENCHMARKS / "tuning_quality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["tuning_quality"] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def _rounds(experiment: Experiment, *values) -> list[TrialResult]:
    return [TrialResult(experiment, TrialState.OK, value=v) if v else TrialResult(experiment, TrialState.OOM)
            for v in values]


def test_one_launchs_spread_is_pooled_over_configurations_whose_every_round_ran():
    a, b, c = Experiment(0, 8, 4), Experiment(0, 16, 2), Experiment(1, 32, 1)
    rounds = {a: _rounds(a, 100.0, 104.0), b: _rounds(b, 200.0, 196.0), c: _rounds(c, 300.0, None)}
    spread, configurations = _benchmark().launch_spread(rounds)
    # Two rounds: each configuration's variance of log values is (log ratio)^2 / 2.
    expected = math.sqrt((math.log(1.04) ** 2 / 2 + math.log(196 / 200) ** 2 / 2) / 2)
    assert configurations == 2  # the one with an OOM round says nothing about one launch's noise
    assert math.isclose(spread, expected)
    assert 0.02 < spread < 0.025
    assert _benchmark().launch_spread({a: _rounds(a, 100.0)}) is None  # one round: no spread


def test_the_noise_benchmark_launches_each_workloads_grid_best():
    """benchmarks/launch_noise.py repeats the configuration the committed grid measured fastest,
    passing over the points that ran out of memory (no median)."""
    import pandas as pd

    _benchmark()  # launch_noise imports its sibling by name
    spec = importlib.util.spec_from_file_location("launch_noise", BENCHMARKS / "launch_noise.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    grid = pd.read_csv(BENCHMARKS / "results" / "tuning_quality_grid.csv")
    for workload, rows in grid.dropna(subset=["samples_per_s_median"]).groupby("workload"):
        best = rows.loc[rows.samples_per_s_median.idxmax()]
        chosen = module.grid_best(workload)
        assert (chosen.zero_stage, chosen.micro_batch_size, chosen.gradient_accumulation_steps) == \
            (best.zero_stage, best.micro_batch_size, best.gradient_accumulation_steps)
