"""Activation checkpointing as a tuned dimension: "auto" (or a list) asks for it, each policy is a
variant searched beside its stage above the micro-batch sizes the less-saving policies reach,
the memory model holds each policy's own bytes per sample, and the step-time model learns each
policy's recompute per sample."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from autotuner.config.models import DeepSpeedConfig
from autotuner.tuning.space.config_space import base_config, search_space
from autotuner.tuning.models.cost_model import CostContext, Observation, StepTimeModel
from autotuner.tuning.space.dimensions import full_mode_values, settle_variants, variant_values
from autotuner.tuning.memory.estimate import ModelProfile, PeakFit, StageSettings, estimate
from autotuner.tuning.searches.predictive_search import candidate_space
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.searches.stage_search import run_search
from autotuner.tuning.space.search_space import SearchPolicy, SearchSpace
from autotuner.tuning.space.experiment import Experiment

AC = "activation_checkpointing"
POLICIES = (((AC, "none"),), ((AC, "selective"),), ((AC, "full"),))


def config(policy) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "activation_checkpointing": {"policy": policy}}


# ----- what the user asks for -----

@pytest.mark.parametrize("policy, expected", [
    ("auto", POLICIES),
    (["full", "none"], (POLICIES[0], POLICIES[2])),  # the registry's order: least memory-saving first
    ("full", None), ("none", None)])
def test_auto_or_a_list_asks_for_the_policies_a_scalar_fixes_one(policy, expected):
    variants = variant_values(config(policy))
    if expected is None:
        assert variants == {}
    else:
        assert variants == {stage: expected for stage in range(4)}
    assert variant_values({}) == {}
    assert all(AC not in knobs for knobs in full_mode_values(config("auto")).values())  # not a full-mode knob


def test_the_base_config_runs_without_checkpointing_and_experiments_write_their_policy():
    for policy in ("auto", ["full", "selective"]):
        base = base_config(DeepSpeedConfig.model_validate(config(policy)))
        assert base[AC]["policy"] == "none"  # the profile launches measure every policy's bytes from it
    fixed = config("full")
    settle_variants(fixed)
    assert fixed[AC]["policy"] == "full"
    written = Experiment(0, 8, 1, POLICIES[2]).apply(base, data_parallel_size=2)
    assert written[AC]["policy"] == "full" and Experiment(0, 8, 1, POLICIES[2]).name == "z0_acfull_gas1_mbs8"


def test_the_space_carries_the_variants_of_the_users_config():
    space = search_space(DeepSpeedConfig.model_validate(config("auto")), data_parallel_size=2)
    assert space.variants_for(0) == POLICIES
    assert SearchSpace(stages=(0,), data_parallel_size=1).variants_for(0) == ((),)


# ----- the search -----

# Per policy: the largest micro-batch that runs, and the time per sample it costs (recompute).
RUNS_UP_TO = {"none": 8, "selective": 20, "full": 32}
SLOWER_BY = {"none": 1.0, "selective": 1.1, "full": 1.3}


def policy_of(experiment: Experiment) -> str:
    return dict(experiment.knobs).get(AC, "none")


class FakeRun:
    """OOM above the policy's limit; throughput grows with the micro-batch, less the recompute."""

    def __init__(self):
        self.calls: list[Experiment] = []

    def __call__(self, experiment: Experiment) -> TrialResult:
        self.calls.append(experiment)
        policy = policy_of(experiment)
        if experiment.micro_batch_size > RUNS_UP_TO[policy]:
            return TrialResult(experiment, TrialState.OOM, error="out of memory")
        return TrialResult(experiment, TrialState.OK,
                           value=100 * math.log2(1 + experiment.micro_batch_size) / SLOWER_BY[policy])


class Prunes(list):
    def __call__(self, stage, reason, text, variant=()):
        self.append((stage, variant, text))


def fits(experiment: Experiment) -> bool:
    """A memory model that is right (refitted, as the tuner's is, after a variant's first launch)."""
    return experiment.micro_batch_size <= RUNS_UP_TO[policy_of(experiment)]


def predicted() -> dict:
    return {(0, variant): RUNS_UP_TO[variant[0][1]] for variant in POLICIES}


def test_each_policy_is_searched_only_above_the_sizes_the_less_saving_ones_reach():
    space = SearchSpace(stages=(0,), data_parallel_size=1, max_micro_batch_size=32, variants={0: POLICIES})
    run, prunes = FakeRun(), Prunes()
    results = run_search(space, SearchPolicy(Objective("throughput"), "gridsearch", 50, 50, 0, True), predicted(),
                         run, prunes, fits)
    by_policy = {p: sorted(e.micro_batch_size for e in run.calls if policy_of(e) == p) for p in RUNS_UP_TO}
    assert max(by_policy["none"]) == 8
    assert by_policy["selective"] and min(by_policy["selective"]) > 8
    assert by_policy["full"] and min(by_policy["full"]) > 20
    assert not any(r.state is TrialState.OOM for r in results)  # the memory model's limits were right
    best = max((r for r in results if r.state is TrialState.OK), key=lambda r: r.value)
    every = [Experiment(0, m, 1, v) for v in POLICIES for m in range(1, RUNS_UP_TO[v[0][1]] + 1)]
    assert best.value == max(FakeRun()(e).value for e in every)  # the true optimum: selective at 20
    assert prunes == []


def test_a_policy_that_fits_no_more_than_the_ones_before_it_is_pruned_with_its_reason():
    space = SearchSpace(stages=(0,), data_parallel_size=1, max_micro_batch_size=8, variants={0: POLICIES})
    run, prunes = FakeRun(), Prunes()
    run_search(space, SearchPolicy(Objective("throughput"), "gridsearch", 50, 50, 0, True),
               {(0, v): 8 for v in POLICIES}, run, prunes)
    assert {policy_of(e) for e in run.calls} == {"none"}
    assert [(stage, variant) for stage, variant, _ in prunes] == [(0, POLICIES[1]), (0, POLICIES[2])]
    assert all("no larger than the stage reaches with the variants before it (8)" in reason for *_, reason in prunes)


def test_the_predictive_candidates_of_a_policy_start_above_the_sizes_before_it():
    space = SearchSpace(stages=(0,), data_parallel_size=1, max_micro_batch_size=32, variants={0: POLICIES})
    candidates = candidate_space(space, predicted(), lambda e: True, Prunes(), lambda s, v: None, lambda line: None)
    sizes = {p: [c.micro_batch_size for c in candidates if policy_of(c) == p] for p in RUNS_UP_TO}
    assert max(sizes["none"]) == 8 and min(sizes["selective"]) > 8 and min(sizes["full"]) > 20


# ----- memory -----

def test_each_policy_holds_its_own_bytes_per_sample():
    mib = 2**20
    profile = ModelProfile(num_params=1000, activation_bytes_per_sample=32 * mib,
                           activation_bytes_per_sample_by_policy=(("none", 32 * mib), ("selective", 9 * mib),
                                                                  ("full", 8 * mib)))
    at = {p: estimate(profile, StageSettings(0, activation_policy=p), 10).activations for p in RUNS_UP_TO}
    assert at == {"none": 320 * mib, "selective": 90 * mib, "full": 80 * mib}
    # Measured peaks (CUDA): a policy drops the saved bytes it does not keep; the rest of the
    # measured slope (backward's temporaries) stays.
    fitted = ModelProfile(**{**profile.__dict__, "peak_fits": (PeakFit(0, "fp32", 0, 40 * mib, 0),)})
    assert estimate(fitted, StageSettings(0, activation_policy="full"), 10).activations == (40 - 24) * 10 * mib
    unmeasured = ModelProfile(num_params=1000, activation_bytes_per_sample=32 * mib)  # model_info: never under-counted
    assert estimate(unmeasured, StageSettings(0, activation_policy="full"), 10).activations == 320 * mib


# ----- the step-time model -----

def test_the_recompute_of_each_policy_is_learned_and_unsure_until_launched():
    def step_s(e: Experiment) -> float:
        return e.gradient_accumulation_steps * (0.01 + 0.002 * e.micro_batch_size * SLOWER_BY[policy_of(e)])

    seen = [Experiment(0, m, 1, POLICIES[0]) for m in (2, 4, 8)] + [Experiment(0, m, 1, POLICIES[2]) for m in (16, 32)]
    model = StepTimeModel([Observation(e, step_s(e)) for e in seen], CostContext(), largest_micro_batch=32)
    full_24 = model.predict(Experiment(0, 24, 1, POLICIES[2]))
    assert full_24.mean_s == pytest.approx(step_s(Experiment(0, 24, 1, POLICIES[2])), rel=0.05)
    selective = model.predict(Experiment(0, 24, 1, POLICIES[1]))  # never launched: only its prior
    assert selective.std_s > 2 * full_24.std_s


class FailingSelective(FakeRun):
    """Selective checkpointing crashes the script (not out of memory) at every size."""

    def __call__(self, experiment: Experiment) -> TrialResult:
        if policy_of(experiment) == "selective":
            self.calls.append(experiment)
            return TrialResult(experiment, TrialState.FAILED, error="RuntimeError: not found in storage")
        return super().__call__(experiment)


@pytest.mark.parametrize("tuner", ["gridsearch", "predictive"])
def test_a_policy_that_fails_other_than_by_memory_is_launched_once(tuner):
    from autotuner.tuning.searches.predictive_search import run_predictive_search

    space = SearchSpace(stages=(0, 1), data_parallel_size=1, max_micro_batch_size=32,
                        variants={0: POLICIES, 1: POLICIES})
    largest = {(stage, v): RUNS_UP_TO[v[0][1]] for stage in (0, 1) for v in POLICIES}
    run = FailingSelective()
    policy = SearchPolicy(Objective("throughput"), tuner, 50, 50, 0, True)
    if tuner == "predictive":
        results = list(run_predictive_search(space, policy, largest, run, Prunes(), CostContext(), [], fits).results)
    else:
        results = run_search(space, policy, largest, run, Prunes(), fits)
    assert sum(policy_of(e) == "selective" for e in run.calls) == 1
    refused = [r for r in results if r.state is TrialState.PRUNED and "not launched again" in (r.error or "")]
    assert tuner == "predictive" or refused  # the grid's later selective sizes say why they were not launched
    assert any(policy_of(r.experiment) == "full" and r.state is TrialState.OK for r in results)


@pytest.mark.parametrize("tuner", ["gridsearch", "predictive"])
def test_a_policy_is_first_launched_at_its_smallest_size_then_as_its_refitted_model_allows(tuner):
    """The profile's figures under-count a policy's peak (on a CPU, by a factor ~2 for selective
    on GPT-2): until one of its launches is fitted, it is not trusted beyond its smallest size."""
    from autotuner.tuning.searches.predictive_search import run_predictive_search

    run = FakeRun()

    def learning_fits(experiment: Experiment) -> bool:
        seen = any(policy_of(e) == policy_of(experiment) for e in run.calls)
        return fits(experiment) if seen or policy_of(experiment) == "none" else True  # unfitted: too optimistic

    space = SearchSpace(stages=(0,), data_parallel_size=1, max_micro_batch_size=32, variants={0: POLICIES[:2]})
    policy = SearchPolicy(Objective("throughput"), tuner, 50, 50, 0, True)
    largest = {(0, POLICIES[0]): 8, (0, POLICIES[1]): 32}  # the profile's optimistic figure for selective
    if tuner == "predictive":
        results = list(run_predictive_search(space, policy, largest, run, Prunes(), CostContext(), [],
                                             learning_fits).results)
    else:
        results = run_search(space, policy, largest, run, Prunes(), learning_fits)
    selective = [e.micro_batch_size for e in run.calls if policy_of(e) == "selective"]
    assert selective[0] == min(selective) and selective[0] > 8
    assert not any(r.state is TrialState.OOM for r in results)


@pytest.mark.parametrize("tuner", ["gridsearch", "predictive"])
def test_a_policy_is_not_launched_where_larger_micro_batches_do_not_pay(tuner):
    """Throughput that falls with the micro-batch (a CPU, often): memory bought with recompute
    buys nothing, and no checkpointing launch is made once the stage's curve shows it."""
    from autotuner.tuning.searches.predictive_search import run_predictive_search

    def falling(experiment: Experiment) -> float:
        return 100.0 / (1 + 0.05 * experiment.micro_batch_size) / SLOWER_BY[policy_of(experiment)]

    calls = []

    def evaluate(experiment: Experiment) -> TrialResult:
        calls.append(experiment)
        if experiment.micro_batch_size > RUNS_UP_TO[policy_of(experiment)]:
            return TrialResult(experiment, TrialState.OOM, error="out of memory")
        return TrialResult(experiment, TrialState.OK, value=falling(experiment))

    space = SearchSpace(stages=(0,), data_parallel_size=1, max_micro_batch_size=32, variants={0: POLICIES})
    policy = SearchPolicy(Objective("throughput"), tuner, 50, 50, 0, True)
    prunes = Prunes()
    if tuner == "predictive":
        run_predictive_search(space, policy, predicted(), evaluate, prunes, CostContext(), [], fits)
    else:
        run_search(space, policy, predicted(), evaluate, prunes, fits)
    assert {policy_of(e) for e in calls} == {"none"}
    if tuner == "gridsearch":
        assert any("so larger micro-batches do not pay here" in reason for *_, reason in prunes)


# ----- on DeepSpeed's engine: the script applies them through the mapped flags -----

def test_on_deepspeeds_engine_the_mapped_flags_carry_the_policy_and_compile_and_the_config_does_not():
    from fakes import experiment_settings

    from autotuner.execution.trial_launch import trial_script_args
    from autotuner.tuning.trials.trial import Trial, experiment_config, script_config

    user = DeepSpeedConfig.model_validate({**config("auto"), "compile": {"enabled": "auto"}})
    # Hugging Face's --gradient_checkpointing checkpoints whole blocks: "none" and "full" only.
    assert variant_values(user.to_dict(), "deepspeed")[2] == (POLICIES[0], POLICIES[2])
    mappings = {"activation_checkpointing.policy": "--gradient_checkpointing", "compile.enabled": "--torch_compile"}
    settings = experiment_settings(user, engine="deepspeed", arg_mappings=mappings,
                                   script_args=("--gradient_checkpointing", "false", "--deepspeed", "ds.json"))
    for policy, compiled, flags in (("full", True, ("true", "true")), ("none", False, ("false", "false"))):
        experiment = Experiment(2, 4, 1, ((AC, policy), ("compile", compiled)))
        trial = Trial(experiment, Path("/tmp/exp"), settings)
        args = trial_script_args(trial)
        assert args.count("--gradient_checkpointing") == 1  # the user's value replaced, not repeated
        assert (args[args.index("--gradient_checkpointing") + 1], args[args.index("--torch_compile") + 1]) == flags
        written = script_config(experiment_config(experiment, settings), "deepspeed")
        assert AC not in written and "compile" not in written  # DeepSpeed refuses compile.enabled
        ours = script_config(experiment_config(experiment, settings), "autotuner")
        assert ours[AC] == {"policy": policy} and ours["compile"]["enabled"] is compiled


@pytest.mark.parametrize("tuner", ["gridsearch", "predictive"])
def test_a_fixed_micro_batch_list_holds_for_every_variant(tuner):
    """Issue 68's bug: with the user's list [2, 4], a variant searched above the sizes the ones
    before it reach (none runs micro-batch 2 only, here) must still try only the listed sizes;
    its first launch (at its smallest size) once went to 3, a size the user never allowed."""
    from autotuner.tuning.searches.predictive_search import run_predictive_search

    limits = {"none": 2, "selective": 2, "full": 8}

    class Run(FakeRun):
        def __call__(self, experiment: Experiment) -> TrialResult:
            self.calls.append(experiment)
            if experiment.micro_batch_size > limits[policy_of(experiment)]:
                return TrialResult(experiment, TrialState.OOM, error="out of memory")
            return TrialResult(experiment, TrialState.OK, value=float(experiment.micro_batch_size))

    space = SearchSpace(stages=(0,), data_parallel_size=1, max_micro_batch_size=32, fixed_micro_batch_sizes=(2, 4),
                        variants={0: POLICIES})
    largest = {(0, v): limits[v[0][1]] for v in POLICIES}
    run, policy = Run(), SearchPolicy(Objective("throughput"), tuner, 50, 50, 0, True)
    fits_limits = lambda e: e.micro_batch_size <= limits[policy_of(e)]  # noqa: E731
    if tuner == "predictive":
        results = list(run_predictive_search(space, policy, largest, run, Prunes(), CostContext(), [],
                                             fits_limits).results)
    else:
        results = run_search(space, policy, largest, run, Prunes(), fits_limits)
    assert {e.micro_batch_size for e in run.calls} <= {2, 4}, [e.name for e in run.calls]
    best = max((r for r in results if r.state is TrialState.OK), key=lambda r: r.value)
    assert best.experiment == Experiment(0, 4, 1, POLICIES[2])  # full checkpointing reaches the listed 4
