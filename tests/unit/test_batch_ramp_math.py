"""The batch ramp's arithmetic (issue 70): which accumulation count goodput picks at a noise scale,
never a smaller batch, capped by max_train_batch_size; the micro-batch grown only where allowed,
to a size the plan has costs for; the learning rate's factor kept over the schedule's own rate; the
plan read back as written; the engine loader's batches follow a change of size."""

from __future__ import annotations

import pytest
import torch

from autotuner.runtime.training.batch_ramp import RampPlan, StepCost, best_batch, goodput, scaled_schedule

# micro-batch 4: 10 ms a micro-step, 100 ms the rest of a step (a slow reduction): a larger gas amortises it
PLAN = RampPlan(reference_batch=8, lr_scaling="linear", interval=10, costs=(StepCost(4, 0.010, 0.100),))


def test_goodput_grows_the_batch_toward_the_noise_scale_and_no_further():
    small = best_batch(PLAN, b_noise=20.0, micro_batch_size=4, gas=1, dp=2)
    large = best_batch(PLAN, b_noise=2000.0, micro_batch_size=4, gas=1, dp=2)
    assert small.gradient_accumulation_steps < large.gradient_accumulation_steps
    for choice, b_noise in ((small, 20.0), (large, 2000.0)):
        around = [goodput(PLAN.costs[0], g, 2, b_noise, 8) for g in (choice.gradient_accumulation_steps - 1,
                                                                      choice.gradient_accumulation_steps + 1) if g >= 1]
        assert all(value <= choice.predicted_goodput for value in around)  # the optimum, not a neighbour
    assert large.global_batch == 4 * large.gradient_accumulation_steps * 2


def test_never_smaller_and_capped_by_the_largest_batch():
    assert best_batch(PLAN, b_noise=1.0, micro_batch_size=4, gas=6, dp=2).gradient_accumulation_steps == 6
    capped = RampPlan(8, "linear", 10, PLAN.costs, max_global_batch=32)
    assert best_batch(capped, b_noise=1e6, micro_batch_size=4, gas=1, dp=2).global_batch == 32
    assert best_batch(PLAN, b_noise=100.0, micro_batch_size=8, gas=1, dp=2) is None  # no cost measured at 8


# Micro-batch 8 costs 12 ms a micro-step where 4 costs 10: twice the samples for 1.2x the time.
SIZES = RampPlan(reference_batch=8, lr_scaling="linear", interval=10,
                 costs=(StepCost(4, 0.010, 0.001), StepCost(8, 0.012, 0.001), StepCost(16, 0.040, 0.001)))


def test_the_micro_batch_grows_only_where_allowed_and_only_to_sizes_with_costs():
    kept = best_batch(SIZES, b_noise=2000.0, micro_batch_size=4, gas=2, dp=2)
    assert kept.micro_batch_size == 4  # the script's own loader: gas only
    grown = best_batch(SIZES, b_noise=2000.0, micro_batch_size=4, gas=2, dp=2, grow_micro=True)
    assert grown.micro_batch_size == 8 and grown.global_batch >= 16  # never below today's batch (4 x 2 x 2)
    assert grown.predicted_goodput > kept.predicted_goodput
    # At a small noise scale the larger batch's efficiency outweighs the throughput: the batch stays 16,
    # reached through the cheaper micro-batch (8 x 1 x 2) rather than more accumulation.
    same = best_batch(SIZES, b_noise=4.0, micro_batch_size=4, gas=2, dp=2, grow_micro=True)
    assert (same.micro_batch_size, same.gradient_accumulation_steps, same.global_batch) == (8, 1, 16)
    assert best_batch(SIZES, b_noise=1e6, micro_batch_size=16, gas=1, dp=2, grow_micro=True).micro_batch_size == 16


def test_the_engine_loader_hands_out_batches_of_the_size_set_between_them():
    from autotuner.runtime.training.batch_ramp import ResizableBatchSampler

    sampler = ResizableBatchSampler(range(20), 2)
    loader = torch.utils.data.DataLoader(list(range(20)), batch_sampler=sampler)
    batches = iter(loader)
    assert next(batches).tolist() == [0, 1] and sampler.drawn == 1
    sampler.batch_size = 4
    assert next(batches).tolist() == [2, 3, 4, 5]
    assert [len(b) for b in batches] == [4, 4, 4]  # the last 2 indices dropped, as drop_last drops them
    assert len(sampler) == 5


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


class _Engine:
    """What ramp_after_step reads of an engine, recording the batch it is given."""

    def __init__(self, boundary_override):
        from autotuner.config.batch import BatchSizes
        from autotuner.runtime.training.batch_ramp import BatchRamp

        self._boundary_override = boundary_override
        self._ramp = BatchRamp(RampPlan(8, "linear", 1, PLAN.costs, initial_b_noise=1e6), rank=0)
        self._noise = None
        self.global_steps = 2
        self.batch = BatchSizes(8, 4, 1, 2)
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        self.set = []

    def get_lr(self):
        return [self.optimizer.param_groups[0]["lr"]]

    def set_train_batch_size(self, size):
        self.set.append(size)


@pytest.mark.parametrize("override, changed", [(None, True), (True, False)])
def test_the_ramp_leaves_a_boundary_the_script_drives_alone(override, changed):
    from autotuner.runtime.training.batch_ramp import ramp_after_step

    engine = _Engine(override)
    ramp_after_step(engine)
    assert bool(engine.set) == changed  # B_noise 1e6 and a 100 ms step ask for more gas, unless the script counts it
