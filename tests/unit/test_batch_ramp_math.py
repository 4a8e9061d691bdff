"""The batch ramp's arithmetic (issue 70): which accumulation count goodput picks at a noise scale,
never a smaller batch, capped by max_train_batch_size; the learning rate's factor kept over the
schedule's own rate; the plan read back as written."""

from __future__ import annotations

import pytest
import torch

from autotuner.runtime.training.batch_ramp import RampPlan, StepCost, best_gas, goodput, scaled_schedule

# micro-batch 4: 10 ms a micro-step, 100 ms the rest of a step (a slow reduction): a larger gas amortises it
PLAN = RampPlan(reference_batch=8, lr_scaling="linear", interval=10, costs=(StepCost(4, 0.010, 0.100),))


def test_goodput_grows_the_batch_toward_the_noise_scale_and_no_further():
    small = best_gas(PLAN, b_noise=20.0, micro_batch_size=4, gas=1, dp=2)
    large = best_gas(PLAN, b_noise=2000.0, micro_batch_size=4, gas=1, dp=2)
    assert small.gradient_accumulation_steps < large.gradient_accumulation_steps
    for choice, b_noise in ((small, 20.0), (large, 2000.0)):
        around = [goodput(PLAN.costs[0], g, 2, b_noise, 8) for g in (choice.gradient_accumulation_steps - 1,
                                                                      choice.gradient_accumulation_steps + 1) if g >= 1]
        assert all(value <= choice.predicted_goodput for value in around)  # the optimum, not a neighbour
    assert large.global_batch == 4 * large.gradient_accumulation_steps * 2


def test_never_smaller_and_capped_by_the_largest_batch():
    assert best_gas(PLAN, b_noise=1.0, micro_batch_size=4, gas=6, dp=2).gradient_accumulation_steps == 6
    capped = RampPlan(8, "linear", 10, PLAN.costs, max_global_batch=32)
    assert best_gas(capped, b_noise=1e6, micro_batch_size=4, gas=1, dp=2).global_batch == 32
    assert best_gas(PLAN, b_noise=100.0, micro_batch_size=8, gas=1, dp=2) is None  # no cost measured at 8


def test_the_factor_rides_over_a_closed_form_and_a_chained_schedule():
    param = torch.nn.Parameter(torch.zeros(1))
    for make, expected in ((lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (step + 1)), 0.5),
                           (lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5), 0.5)):
        optimizer = torch.optim.SGD([param], lr=1.0)
        schedule = make(optimizer)
        for group in optimizer.param_groups:
            group["lr"] *= 4  # the ramp's factor applied when it changed the batch
        with scaled_schedule(optimizer, 4.0):
            optimizer.step()
            schedule.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(4.0 * expected)


def test_the_plan_reads_back_as_written(tmp_path):
    path = tmp_path / "plan.json"
    import json

    path.write_text(json.dumps(PLAN.to_json()))
    assert RampPlan.read(path) == PLAN
