"""Transfer from similar earlier runs: the workload signature (a model family that ignores sizes),
a prior that agrees with the profile is scaled to this model and cuts the launches that follow
it, one that disagrees is dropped with its reason, and a second tuning run of a larger model of
the same family finds the first one in the history."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autotuner.runtime.measure.model_family import model_family
from autotuner.tuning.models.cost_model import CostContext, Observation
from autotuner.tuning.searches.predictive_search import run_predictive_search
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.space.search_space import SearchPolicy, SearchSpace
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.models.transfer import (PriorRun, WorkloadSignature, experiment_of, run_noise,
                                       scale_prior, transfer_prior)


# ----- the model family -----
class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(width), nn.Linear(width, width)


class Gpt(nn.Module):
    def __init__(self, blocks: int, width: int, block=Block):
        super().__init__()
        self.embed = nn.Embedding(100, width)
        self.blocks = nn.ModuleList(block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 100)


class ConvBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv1d(width, width, 3)


def test_a_family_ignores_sizes_and_wrappers_and_tells_architectures_apart():
    small = model_family(Gpt(2, 16))
    assert small == model_family(Gpt(12, 64))  # depth and width are sizes
    assert small != model_family(Gpt(2, 16, block=ConvBlock))
    assert small != model_family(nn.Sequential(nn.Linear(4, 4)))
    class FSDPModule:  # as FSDP2's fully_shard subclasses a module: FSDP<Name>(FSDPModule, Name)
        pass

    sharded = Gpt(4, 16)
    for block in sharded.blocks:
        block.__class__ = type(f"FSDP{Block.__name__}", (FSDPModule, Block), {})
    assert model_family(sharded) == small
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = Gpt(4, 16)
    wrapped.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in wrapped.blocks)
    assert model_family(wrapped) == small


SIGNATURE = WorkloadSignature("fam", "autotuner", "cpu: x", 2, "fp32", 1_000_000, 4096, 2.0e9)


def test_similar_runs_share_family_engine_device_ranks_and_precision_not_size():
    bigger = dataclasses.replace(SIGNATURE, num_params=4_000_000, flops_per_sample=8.0e9)
    assert SIGNATURE.similar(bigger)
    for change in ({"family": "other"}, {"engine": "deepspeed"}, {"device": "cuda: H100"}, {"world_size": 4},
                   {"precision": "bf16"}):
        assert not SIGNATURE.similar(dataclasses.replace(SIGNATURE, **change))
    assert not dataclasses.replace(SIGNATURE, family="").similar(dataclasses.replace(SIGNATURE, family=""))
    assert WorkloadSignature.from_json(bigger.to_json()) == bigger


def test_a_trials_params_give_back_its_experiment():
    params = {"zero_stage": 1, "micro_batch_size": 8, "gradient_accumulation_steps": 2,
              "reduce_bucket_size": 6553600.0, "contiguous_gradients": True}
    experiment = experiment_of(params)
    assert experiment == Experiment(1, 8, 2).with_knobs({"reduce_bucket_size": 6_553_600, "contiguous_gradients": True})


# ----- scaling and checking a prior -----
def step_time(stage: int, micro: int, gas: int, compute_scale: float) -> float:
    """A saturating compute curve (a fixed cost per micro-step, a cost per sample) and a stage offset."""
    return gas * compute_scale * (0.02 + 0.004 * micro) + 0.01 * stage


SIZES = (2, 4, 8, 16, 32)
OLD = tuple(Observation(Experiment(s, m, 64 // (2 * m)), step_time(s, m, 64 // (2 * m), 1.0))
            for s in (0, 1) for m in SIZES)
PRIOR = PriorRun("autotuner:train.py:small", dataclasses.replace(SIGNATURE, num_params=250_000,
                                                                 flops_per_sample=0.5e9), OLD)


def measured(compute_scale: float, points=((0, 4), (0, 16))) -> list[Observation]:
    return [Observation(Experiment(s, m, 64 // (2 * m)), step_time(s, m, 64 // (2 * m), compute_scale))
            for s, m in points]


def test_a_prior_that_agrees_with_the_profile_is_scaled_to_this_model():
    scaled, why = scale_prior(PRIOR, SIGNATURE, CostContext(), measured(4.0))
    assert why.startswith("compute 3.9") and "FLOPs per sample: 4.00x" in why
    assert len(scaled) == len(OLD)
    for old, new in zip(OLD, scaled):
        e = old.experiment
        expected = step_time(e.zero_stage, e.micro_batch_size, e.gradient_accumulation_steps, 4.0)
        assert new.step_time_s == pytest.approx(expected, rel=0.15)  # the stage offset is not scaled apart
        assert new.relative_noise >= 0.03  # never narrower than a launch's


def test_an_earlier_run_that_measured_itself_noisy_gives_a_wider_prior():
    """Its re-measurements (one configuration launched more than once) show its run-to-run spread;
    a stage's lead there within that spread is no lead here, so every scaled step carries it."""
    quiet, _ = scale_prior(PRIOR, SIGNATURE, CostContext(), measured(4.0))
    again = [Observation(o.experiment, o.step_time_s * factor) for o in OLD[:2] for factor in (0.9, 1.1)]
    noisy_run = PriorRun(PRIOR.study_name, PRIOR.signature, (*OLD, *again))
    noisy, _ = scale_prior(noisy_run, SIGNATURE, CostContext(), measured(4.0))
    assert run_noise(OLD) == 0.03  # nothing measured twice: a launch's floor
    assert run_noise(noisy_run.steps) == pytest.approx(0.10)  # steps x (1, 0.9, 1.1)
    assert min(o.relative_noise for o in noisy) > max(o.relative_noise for o in quiet) + 0.04


@pytest.mark.parametrize("profile, says", [
    (measured(12.0), "its compute per step where its FLOPs per sample say 4.00x"),
    ([Observation(Experiment(0, 4, 8), step_time(0, 4, 8, 4.0)), Observation(Experiment(0, 16, 2),
                                                                              step_time(0, 16, 2, 7.0))],
     "its curve disagrees with the profile launches"),
    ([], "no profile launch was measured"),
], ids=["level", "shape", "nothing-measured"])
def test_a_prior_that_disagrees_with_the_profile_is_dropped_with_one_line(profile, says):
    lines: list[str] = []
    prior = transfer_prior([PRIOR], SIGNATURE, CostContext(), profile, lines.append)
    assert prior.observations == () and prior.used == ()
    assert len(lines) == 1 and "dropped" in lines[0] and says in lines[0], lines


def test_with_an_agreeing_prior_the_search_after_the_profile_launches_less_and_picks_alike():
    """Candidates at every stage and size; the truth is the new model's curve. The profile (two
    sizes at ZeRO 0) is known to both runs; the prior comes from the smaller model."""
    space = SearchSpace(stages=(0, 1, 2), data_parallel_size=2, max_micro_batch_size=32, global_batch_size=64)
    policy = SearchPolicy(Objective("throughput"), "predictive", 50, 50, 0, True)
    launched: dict[str, list[Experiment]] = {"cold": [], "transfer": []}

    def truth(run: str):
        def evaluate(experiment: Experiment) -> TrialResult:
            launched[run].append(experiment)
            t = step_time(experiment.zero_stage, experiment.micro_batch_size,
                          experiment.gradient_accumulation_steps, 4.0)
            return TrialResult(experiment, TrialState.OK, value=64 / t)
        return evaluate

    profile = [TrialResult(o.experiment, TrialState.OK, value=64 / o.step_time_s) for o in measured(4.0)]
    largest = {stage: 32 for stage in (0, 1, 2)}
    old = PriorRun(PRIOR.study_name, PRIOR.signature,
                   OLD + tuple(Observation(Experiment(2, m, 64 // (2 * m)), step_time(2, m, 64 // (2 * m), 1.0))
                               for m in SIZES))
    prior = transfer_prior([old], SIGNATURE, CostContext(), measured(4.0), lambda line: None)
    picks = {}
    for run, context in (("cold", CostContext(world_size=2)),
                         ("transfer", CostContext(world_size=2, prior=prior.observations))):
        outcome = run_predictive_search(space, policy, largest, truth(run), lambda *a: None, context, list(profile))
        results = [r for r in list(outcome.results) + profile if r.state is TrialState.OK]
        picks[run] = max(results, key=lambda r: r.value)
    assert prior.used == (old.study_name,)
    # Here the prior rules out ZeRO 2 unlaunched; ZeRO 0 and 1 stay within the noise of each other.
    assert len(launched["transfer"]) < len(launched["cold"]), launched
    assert not any(e.zero_stage == 2 for e in launched["transfer"])
    assert picks["transfer"].experiment == picks["cold"].experiment


def test_the_sequence_length_is_read_from_the_models_first_input_where_it_has_one():
    from autotuner.runtime.measure.profile import ActivationProbe, sequence_length_of

    assert sequence_length_of([torch.zeros(4, 128, dtype=torch.long)]) == 128  # token ids
    assert sequence_length_of([None, torch.zeros(4, 64, 16)]) == 64  # embeddings, after a non-tensor
    assert sequence_length_of([torch.zeros(4, 32)]) == 0 and sequence_length_of([3, "x"]) == 0  # an MLP's features
    model = Gpt(2, 8)
    model.forward = lambda input_ids: model.head(model.embed(input_ids))  # noqa: E731 - a GPT called by keyword
    probe = ActivationProbe(list(model.parameters()), list(model.blocks), model=model)
    probe.start()
    model(input_ids=torch.zeros(2, 24, dtype=torch.long))
    probe.stop()
    model(input_ids=torch.zeros(2, 7, dtype=torch.long))  # after the probe: not seen
    assert probe.sequence_length == 24


# ----- through the orchestrator and the history -----
def test_a_larger_model_of_the_same_family_starts_from_the_smaller_ones_run_in_the_history(tmp_path):
    optuna = pytest.importorskip("optuna")
    from fakes import FakeRunner, fingerprint, model_info, ok, tuner

    from autotuner.core.boundary import Measurement

    def runner(num_params: int, compute_scale: float) -> FakeRunner:
        def answer(trial):
            e = trial.experiment
            t = step_time(e.zero_stage, e.micro_batch_size, e.gradient_accumulation_steps, compute_scale)
            result = ok(trial, e.micro_batch_size * e.gradient_accumulation_steps * 2 / t, 200 * 2**20)
            flops = compute_scale * 1e9 * e.micro_batch_size * e.gradient_accumulation_steps
            result = dataclasses.replace(result, measurement=Measurement(
                throughput=result.value, latency=t, FLOPS_per_gpu=flops / t, peak_memory_bytes=200 * 2**20))
            if trial.profile:
                info = model_info(e.micro_batch_size, e.zero_stage, num_params=num_params, model_family="fam",
                                  device_name="cpu: test", activation_bytes=e.micro_batch_size * 2**20,
                                  sequence_length=128)
                result = dataclasses.replace(result, model_info=info)
            return result
        return FakeRunner(answer)

    storage = f"sqlite:///{tmp_path / 'history.db'}"
    autotuning = {"history": True, "storage": storage, "tuner_type": "predictive"}
    small = tuner(tmp_path / "small", runner(1_000_000, 1.0), autotuning=autotuning,
                  print_fingerprint=fingerprint(script_args=("--width", "256")),
                  train_micro_batch_size_per_gpu=[2, 4, 8, 16])
    small.tune()
    lines: list[str] = []
    large = tuner(tmp_path / "large", runner(4_000_000, 4.0), autotuning=autotuning, print_to=lines,
                  print_fingerprint=fingerprint(script_args=("--width", "512")),
                  train_micro_batch_size_per_gpu=[2, 4, 8, 16])
    large.tune()
    used = [line for line in lines if line.startswith("transfer: using")]
    assert len(used) == 1 and small.history.study_name in used[0], lines
    assert "(1,000,000 parameters, sequence length 128)" in used[0]
    # The profile's sizes are a cold run's (its second at half the largest that fits): a prior
    # checked against one launch does not choose them (issue 49: a model of another shape).
    assert "profile: ZeRO 0, micro-batch 8 ..." in lines and "profile: ZeRO 0, micro-batch 16 ..." not in lines
    assert not any("next, where similar earlier runs" in line for line in lines)
    summary = (tmp_path / "large" / "results" / "summary.txt").read_text()
    assert used[0] in summary  # the summary says which earlier run was used
    study = optuna.load_study(study_name=large.history.study_name, storage=storage)
    assert study.user_attrs["signature"]["family"] == "fam" and study.user_attrs["signature"]["num_params"] == 4_000_000
    assert study.user_attrs["signature"]["sequence_length"] == 128
    from autotuner.app.history import history_rows

    models = {row["model"] for row in history_rows(storage)}  # launcher --history's column
    assert models == {"1,000,000 parameters, sequence length 128", "4,000,000 parameters, sequence length 128"}
    # Off in the config: the same history, no prior.
    lines.clear()
    tuner(tmp_path / "cold", runner(4_000_000, 4.0), autotuning={**autotuning, "transfer": False}, print_to=lines,
          print_fingerprint=fingerprint(script_args=("--width", "1024")), train_micro_batch_size_per_gpu=[2, 4, 8, 16]
          ).tune()
    assert not any(line.startswith("transfer:") for line in lines)
    assert "profile: ZeRO 0, micro-batch 8 ..." in lines and not any("(transfer)" in line for line in lines)


def test_in_simulation_transfer_searches_less_than_cold_and_its_picks_stay_close():
    """benchmarks/transfer_simulated.py: the real search, prior and final pick on a known surface
    with noisy launches. With a prior from the smaller model, the search after the profile
    launches fewer configurations than cold, and the picks stay within the surface's near ties."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "transfer_simulated.py"
    spec = importlib.util.spec_from_file_location("transfer_simulated", path)
    simulated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(simulated)
    outcomes = [simulated.one_seed(seed, 0.02, 0.0) for seed in range(30)]
    searched = {arm: sum(o[arm][0] for o in outcomes) / len(outcomes) for arm in outcomes[0]}
    assert set(searched) == {"cold", "launch floor", "run spread"}
    assert searched["run spread"] < 0.6 * searched["cold"], searched
    assert max(o["run spread"][2] for o in outcomes) < 0.05  # no pick more than 5% behind the true best
    # The earlier model's best micro-batch 8, this one's 16 (a shape a fourfold width can move):
    # when the prior chose the profile's second size, the picks fell 4.6% behind on average.
    simulated.FASTEST[:] = [16, 8]
    try:
        changed = [simulated.one_seed(seed, 0.02, 0.0) for seed in range(30)]
    finally:
        simulated.FASTEST[:] = [16, 16]
    assert sum(o["run spread"][2] for o in changed) / len(changed) < 0.01
