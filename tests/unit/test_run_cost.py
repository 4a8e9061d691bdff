"""What the planned run costs (issue 70's part 5): device-hours at the pick and the runner-up, from
their launches' steady step and one-off costs over their ranks, priced with cost_per_gpu_hour."""

from __future__ import annotations

import pytest

from autotuner.config import load_config
from autotuner.core.boundary import Measurement
from autotuner.core.errors import ConfigError
from autotuner.tuning.reports.run_cost import cost_lines
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from fakes import FakeRunner, by_micro, experiment_settings, orchestrator


def result(micro: int, step_s: float, ranks: int = 4) -> TrialResult:
    measurement = Measurement(throughput=micro * ranks / step_s, latency=step_s, world_size=ranks,
                              train_batch_size=micro * ranks)
    return TrialResult(Experiment(0, micro, 1), TrialState.OK, value=measurement.throughput, measurement=measurement)


def test_the_pick_and_the_runner_up_cost_their_planned_steps_over_their_ranks():
    fast, slow, worst = result(8, 0.36), result(4, 0.2), result(2, 0.2)
    lines = cost_lines([worst, slow, fast], fast, Objective("throughput"), 10_000, 2.5, on_gpu=True)
    # 10,000 steps x 0.36 s = 1 h on 4 ranks: 4 GPU-hours, 10.00 at 2.5 an hour; the runner-up 33.3 min.
    assert lines == [
        "run cost, pick z0_gas1_mbs8: the 10000 planned steps in 1 h 00 min on 4 rank(s), 4 GPU-hours, 10.00 at 2.5 "
        "per hour (autotuning.cost_per_gpu_hour)",
        "run cost, runner-up z0_gas1_mbs4: the 10000 planned steps in 33.3 min on 4 rank(s), 2.22 GPU-hours, 5.56 at "
        "2.5 per hour (autotuning.cost_per_gpu_hour)"]


def test_without_planned_steps_a_thousand_steps_without_a_price_no_price():
    lines = cost_lines([result(8, 0.36)], result(8, 0.36), Objective("throughput"), None, None, on_gpu=False)
    assert lines == ["run cost, pick z0_gas1_mbs8: 1000 steps (set autotuning.planned_steps for the run's own) in "
                     "6.0 min on 4 rank(s), 0.4 device-hours (CPU processes)"]
    assert cost_lines([], None, Objective("throughput"), None, 1.0, on_gpu=True) == []


@pytest.mark.parametrize("price", [0, -1, "cheap"])
def test_a_price_that_is_not_a_positive_number_is_refused(price):
    with pytest.raises(ConfigError, match="autotuning.cost_per_gpu_hour"):
        load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": {"cost_per_gpu_hour": price}})


def test_a_tunes_summary_states_the_cost(tmp_path):
    config = load_config({"train_micro_batch_size_per_gpu": [2, 4], "zero_optimization": {"stage": 0},
                          "autotuning": {"enabled": True, "tuner_type": "gridsearch", "history": False,
                                         "cost_per_gpu_hour": 3.0}})
    runner = FakeRunner(by_micro({2: 100.0, 4: 150.0}))
    outcome = orchestrator(tmp_path, config, runner, experiment_settings(config, planned_steps=500)).tune()
    assert "run cost, pick z0_gas1_mbs4: the 500 planned steps" in outcome.summary
    assert "run cost, runner-up z0_gas1_mbs2: the 500 planned steps" in outcome.summary
    assert "at 3 per hour (autotuning.cost_per_gpu_hour)" in outcome.summary


def test_the_pick_and_runner_up_cost_what_the_final_pick_compared_their_medians_at():
    # The runner-up's one lucky window (120) was re-measured at 90 and 95: its run is costed at its
    # median (95), as the final pick compared it with the pick's (100), not at the lucky window.
    from dataclasses import replace

    pick = replace(result(4, 0.16), value=100.0)  # its re-measured median
    lucky = replace(result(2, 0.1), value=120.0)
    again = [(1, replace(lucky, value=90.0)), (2, replace(lucky, value=95.0))]
    lines = cost_lines([pick, lucky], pick, Objective("throughput"), 1000, None, on_gpu=True, remeasurements=again)
    assert lines[0].startswith("run cost, pick z0_gas1_mbs4: the 1000 planned steps in 2.7 min")  # 1000 x 16 / 100
    assert lines[1].startswith("run cost, runner-up z0_gas1_mbs2: the 1000 planned steps in 1.4 min")  # x 8 / 95
