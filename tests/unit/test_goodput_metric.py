"""metric "goodput" (issue 50): the gradient noise scale's estimator, the metric's ordering, the
learning-rate rewrite and the config's refusals. Pure."""

from __future__ import annotations

import pytest
import torch

from autotuner.config.models import DeepSpeedConfig
from autotuner.core.boundary import Measurement
from autotuner.core.noise_scale import estimate, statistical_efficiency
from autotuner.tuning.reports.goodput import goodput_lines, scale_learning_rate
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import Objective, TrialResult, TrialState


def synthetic_launch(true_gradient: torch.Tensor, sigma: float, per_rank: int, ranks: int, steps: int,
                     seed: int = 0) -> Measurement:
    """Per-sample gradients G + N(0, sigma^2 I): each rank averages `per_rank` of them, the
    all-reduce averages the ranks; the pairs the engine's probe would record."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(steps):
        samples = true_gradient + sigma * torch.randn(ranks, per_rank, true_gradient.numel(), generator=generator,
                                                      dtype=torch.float64)
        local = samples.mean(dim=1)  # (ranks, dims)
        small = float(local.pow(2).sum(dim=1).mean())
        big = float(local.mean(dim=0).pow(2).sum())
        pairs.append((small, big))
    return Measurement(throughput=1.0, latency=1.0, gradient_norms=tuple(pairs),
                       gradient_noise_batches=(per_rank, per_rank * ranks))


def test_the_estimator_recovers_a_known_noise_scale():
    """B_noise = tr(Sigma) / |G|^2 = dims x sigma^2 / |G|^2: here 256 x 4 / 16 = 64."""
    dims = 256
    gradient = torch.full((dims,), 0.25, dtype=torch.float64)  # |G|^2 = 16
    launches = [synthetic_launch(gradient, 2.0, per_rank=8, ranks=4, steps=40, seed=s) for s in range(3)]
    noise = estimate(launches)
    assert noise.b_noise == pytest.approx(64, rel=0.15)
    assert noise.gradient_sq == pytest.approx(16, rel=0.15) and noise.trace_sigma == pytest.approx(1024, rel=0.1)
    assert 0 < noise.spread < 0.3 * noise.b_noise and noise.steps == 120


def test_the_profiles_micro_batch_1_steps_do_not_swamp_the_estimate():
    """A profile launch at micro-batch 1 (2 ranks: B 1 and 2) gives |G|^2 estimates that are mostly
    noise when B_noise is far above 1; a launch at 128 per rank gives precise ones. Weighted by
    their precision, the estimate stays near the truth (400 here); alike, it is far off."""
    dims = 400
    gradient = torch.full((dims,), 0.05, dtype=torch.float64)  # |G|^2 = 1, tr(Sigma) = 400: B_noise 400
    tiny = synthetic_launch(gradient, 1.0, per_rank=1, ranks=2, steps=8, seed=1)
    large = synthetic_launch(gradient, 1.0, per_rank=128, ranks=2, steps=8, seed=2)
    noise = estimate([tiny, large])
    assert noise.b_noise == pytest.approx(400, rel=0.5)


def test_too_few_steps_or_no_pairs_give_no_estimate():
    gradient = torch.ones(8, dtype=torch.float64)
    assert estimate([synthetic_launch(gradient, 1.0, 4, 2, steps=2)]) is None
    assert estimate([Measurement(throughput=1.0, latency=1.0)]) is None


def test_goodput_orders_a_fast_large_batch_below_a_slower_small_one_past_the_noise_scale():
    objective = Objective("goodput", reference_batch=32, noise_scale=64.0)
    assert objective.efficiency(32) == 1.0
    assert objective.efficiency(512) == pytest.approx(96 / 576)
    # 512 at 1,000 samples/s against 64 at 400: throughput prefers the first, goodput the second.
    assert 1000 * objective.efficiency(512) < 400 * objective.efficiency(64)
    assert Objective("goodput", reference_batch=32).efficiency(512) == 1.0  # before B_noise is measured
    assert Objective("throughput").efficiency(512) == 1.0
    assert statistical_efficiency(128, 128, 10.0) == 1.0


def result(name_batch: int, throughput: float, objective: Objective) -> TrialResult:
    experiment = Experiment(0, name_batch // 2)
    return TrialResult(experiment, TrialState.OK, value=throughput * objective.efficiency(name_batch),
                       measurement=Measurement(throughput=throughput, latency=name_batch / throughput))


def test_the_summary_compares_the_two_picks_time_to_the_same_loss():
    from autotuner.core.noise_scale import NoiseScale

    objective = Objective("goodput", reference_batch=32, noise_scale=64.0)
    results = [result(512, 1000.0, objective), result(64, 400.0, objective)]
    line = goodput_lines(results, objective, NoiseScale(64.0, 5.0, 12, 1.0, 64.0), 2)[0]
    # time to a loss ~ (1 + B / B_noise) / throughput: (1 + 1) / 400 against (1 + 8) / 1000
    assert "global batch 512" in line and "global batch 64" in line
    assert f"{(2 / 400) / (9 / 1000):.2f}x" in line


def test_a_critical_batch_from_the_config_stands_in_for_the_profiles_noise_scale_in_the_summary():
    from autotuner.core.noise_scale import NoiseScale

    # B_crit 4096 where the profile read 64: the large batch is now the quicker to the loss.
    objective = Objective("goodput", reference_batch=32, noise_scale=4096.0)
    results = [result(512, 1000.0, objective), result(64, 400.0, objective)]
    line = goodput_lines(results, objective, NoiseScale(64.0, 5.0, 12, 1.0, 64.0), 2, critical_batch=4096)[0]
    assert line.startswith("Goodput: critical batch 4096 (autotuning.critical_batch_size; the profile's B_noise 64.0")
    assert "goodput pick z0_gas1_mbs256 (global batch 512" in line
    # (1 + 512/4096) / 1000 for both picks: the same configuration
    assert "1.00x the throughput pick's" in line
    unmeasured = goodput_lines(results, objective, None, 2, critical_batch=4096)[0]
    assert "B_noise not measured" in unmeasured


def test_critical_batch_size_is_read_only_with_the_goodput_metric():
    with pytest.raises(ValueError, match='critical_batch_size is read only with metric "goodput"'):
        DeepSpeedConfig.model_validate({"autotuning": {"enabled": True, "critical_batch_size": 4096}})
    config = DeepSpeedConfig.model_validate({"autotuning": {"enabled": True, "metric": "goodput",
                                                            "reference_batch_size": 32, "critical_batch_size": 4096}})
    assert config.autotuning.critical_batch_size == 4096


def test_the_learning_rate_follows_the_picks_global_batch():
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3}}}
    scaled, args, line = scale_learning_rate(config, ("--learning_rate", "2e-4", "--epochs", "1"), 128, 32, "linear")
    assert scaled["optimizer"]["params"]["lr"] == pytest.approx(4e-3)
    assert scaled["scheduler"]["params"]["warmup_max_lr"] == pytest.approx(4e-3)
    assert config["optimizer"]["params"]["lr"] == 1e-3  # the user's dict is left alone
    assert args == ("--learning_rate", "0.0008", "--epochs", "1")
    assert "x4 (linear, global batch 128 against reference_batch_size 32)" in line
    sqrt, _, sqrt_line = scale_learning_rate(config, (), 128, 32, "sqrt")
    assert "x2 (sqrt, global batch 128" in sqrt_line
    assert sqrt["optimizer"]["params"]["lr"] == pytest.approx(2e-3)
    same, same_args, line = scale_learning_rate(config, ("--lr=1",), 128, 32, "none")
    assert same is config and same_args == ("--lr=1",) and "left as it is" in line
    _, eq_args, _ = scale_learning_rate({"optimizer": {"params": {"lr": "auto"}}}, ("--lr=1",), 64, 32, "linear")
    assert eq_args == ("--lr=2",)


def test_with_hugging_faces_trainer_the_config_rate_and_its_flag_stay_one_number():
    # The Trainer refuses optimizer.params.lr (and a given warmup_max_lr) other than --learning_rate.
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}}}
    # Its parser takes the dashed spelling too: scaled like the other.
    scaled, args, _ = scale_learning_rate(config, ("--learning-rate", "2e-4"), 64, 32, "linear", trainer=True)
    assert scaled["optimizer"]["params"]["lr"] == pytest.approx(4e-4) and args == ("--learning-rate", "0.0004")
    # No flag: the Trainer's default (5e-5) would not match the scaled config, so the flag is given.
    scaled, args, line = scale_learning_rate(config, ("--do_train",), 64, 32, "linear", trainer=True)
    assert args == ("--do_train", "--learning_rate", "0.0004") and "--learning_rate 0.0004 added" in line
    # WarmupDecayLR's warmup_max_lr left to DeepSpeed's default: not written, which the Trainer would
    # check against the flag; the line says so.
    assert "warmup_max_lr" not in scaled["scheduler"]["params"] and "left to DeepSpeed's default" in line
    # Without the Trainer the default bound is written, scaled, and no flag is added.
    plain, plain_args, _ = scale_learning_rate(config, ("--do_train",), 64, 32, "linear")
    assert plain["scheduler"]["params"]["warmup_max_lr"] == pytest.approx(2e-3) and plain_args == ("--do_train",)
    # An "auto" rate is the Trainer's: only its flag is scaled.
    auto, auto_args, _ = scale_learning_rate({"optimizer": {"params": {"lr": "auto"}}}, ("--learning-rate", "1e-4"),
                                             64, 32, "linear", trainer=True)
    assert auto["optimizer"]["params"]["lr"] == "auto" and auto_args == ("--learning-rate", "0.0002")


def test_the_summary_names_the_final_pick_with_its_re_measured_figure():
    # A's first window scored best, but the re-measurement rounds picked B: the line names B, as
    # ds_config_optimal.json does (it named A).
    objective = Objective("goodput", reference_batch=32, noise_scale=64.0)
    a, b = result(32, 400.0, objective), result(64, 480.0, objective)
    assert a.value > b.value
    picked = TrialResult(b.experiment, TrialState.OK, value=b.value * 1.2, measurement=b.measurement)
    line = goodput_lines([a, b], objective, None, 2, pick=picked)[0]
    assert "goodput pick z0_gas1_mbs32 (global batch 64" in line


def test_a_planned_run_is_compared_on_the_figures_the_pick_was_made_on():
    # Same global batch; the compiled one is faster per step but its one-off compile dominates a
    # 200-step run: scored 88 against 399. The line compares those, not the steady windows.
    objective = Objective("goodput", reference_batch=32, noise_scale=64.0)
    compiled = TrialResult(Experiment(0, 16).with_knobs({"compile": True}), TrialState.OK, value=88.0,
                           measurement=Measurement(throughput=500.0, latency=0.064))
    plain = TrialResult(Experiment(0, 16), TrialState.OK, value=399.0, measurement=Measurement(throughput=400.0,
                                                                                               latency=0.08))
    line = goodput_lines([compiled, plain], objective, None, 2, pick=plain)[0]
    assert "Throughput pick z0_gas1_mbs16 (global batch 32, 399 samples/s)" in line
    assert "1.00x the throughput pick's" in line


def test_where_goodput_fell_back_to_throughput_the_summary_says_so():
    line = goodput_lines([], Objective("throughput", reference_batch=32), None, 2)
    assert line == ["Goodput: the gradient noise scale was not measured, so the pick is by throughput (the learning "
                    "rate still follows its global batch, autotuning.lr_scaling)"]
    assert goodput_lines([], Objective("throughput"), None, 2) == []


def test_a_schedules_default_bounds_are_written_out_scaled():
    # WarmupDecayLR's warmup_max_lr defaults to 0.001 whatever the optimizer's lr: scaling only the
    # optimizer's lr left the schedule training at the reference batch's rate.
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}}}
    scaled, _, line = scale_learning_rate(config, (), 64, 32, "linear")
    assert scaled["scheduler"]["params"] == {"warmup_num_steps": 10, "total_num_steps": 100,
                                             "warmup_max_lr": pytest.approx(0.002)}
    assert "scheduler warmup_max_lr" in line
    # WarmupLR's follows each group's lr where not given (as DeepSpeed's): the optimizer's, scaled.
    warmup = {**config, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    scaled, _, _ = scale_learning_rate(warmup, (), 64, 32, "linear")
    assert scaled["scheduler"]["params"] == {"warmup_num_steps": 10}
    assert scaled["optimizer"]["params"]["lr"] == pytest.approx(0.002)
    # The config's rate and the flag's are the same number (6 significant digits).
    odd, args, _ = scale_learning_rate({"optimizer": {"params": {"lr": 3e-4}}}, ("--learning_rate", "3e-4"), 64, 32,
                                       "sqrt")
    assert odd["optimizer"]["params"]["lr"] == float(args[1])


def test_goodput_needs_its_reference_batch():
    with pytest.raises(ValueError, match="needs reference_batch_size"):
        DeepSpeedConfig.model_validate({"autotuning": {"enabled": True, "metric": "goodput"}})
    config = DeepSpeedConfig.model_validate({"autotuning": {"enabled": True, "metric": "goodput",
                                                            "reference_batch_size": 32, "lr_scaling": "sqrt"}})
    assert config.autotuning.lr_scaling == "sqrt"


@pytest.mark.parametrize("divide_by_gas", [True, False])
def test_one_ranks_micro_steps_give_the_pair_of_squared_norms_whatever_the_loss_scaling(divide_by_gas):
    from autotuner.runtime.measure.gradient_noise import FIRST_STEP, MicroStepNoiseProbe

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    micro, gas = 4, 3
    probe = MicroStepNoiseProbe(list(model.parameters()), micro, gas)
    batches = [(torch.randn(micro, 6), torch.randn(micro, 1)) for _ in range(gas)]
    per_micro = []  # each micro-batch's mean gradient, computed apart
    for x, y in batches:
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        per_micro.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    probe._micro = torch.zeros((), dtype=torch.float64)  # the reference pass above went through the hooks too
    model.zero_grad()
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss / gas if divide_by_gas else loss).backward()
    probe.step_done(FIRST_STEP, whole=True)
    small, big = probe.steps[0]
    scale = 1 / gas ** 2 if divide_by_gas else 1.0
    expected_small = statistics_mean([float(g @ g) for g in per_micro]) * scale
    mean_gradient = sum(per_micro) / gas
    assert probe.batches == (micro, micro * gas)
    assert small == pytest.approx(expected_small, rel=1e-6)
    assert big == pytest.approx(float(mean_gradient @ mean_gradient) * scale, rel=1e-6)


def statistics_mean(values: list[float]) -> float:
    return sum(values) / len(values)
