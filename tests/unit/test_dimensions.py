"""The dimension registry: the tables it yields are the ones the search always used, every entry's
config path is a key the config accepts, and a new dimension declared in a test alone (its entry,
with its memory term) is searched, named, encoded, written into the config and costed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autotuner.config import load_config, sections
from autotuner.config.keys import check_keys
from autotuner.config.models import DeepSpeedConfig
from autotuner.tuning.space import dimensions
from autotuner.tuning.space.dimensions import Dimension, full_mode_values
from autotuner.tuning.trials.trial import Trial, experiment_config
from autotuner.tuning.memory.estimate import StageSettings
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.space.experiment import Experiment
from autotuner.core.errors import ConfigError
from fakes import OUR_ENGINE_KNOBS, FakeRunner, experiment_settings, model_info, ok, orchestrator
from plugins.toy_dimension import DIMENSION as TOY

DS_BUCKETS = [50_000_000, 500_000_000]
DEEPSPEED_KNOBS = {
    0: {},
    1: {"reduce_bucket_size": DS_BUCKETS, "allgather_bucket_size": DS_BUCKETS},
    2: {"overlap_comm": [False, True], "contiguous_gradients": [False, True],
        "reduce_bucket_size": DS_BUCKETS, "allgather_bucket_size": DS_BUCKETS},
    3: {"overlap_comm": [False, True], "reduce_bucket_size": DS_BUCKETS,
        "stage3_prefetch_bucket_size": [5_000_000, 50_000_000],
        "stage3_param_persistence_threshold": [10_000, 100_000],
        "stage3_max_live_parameters": [100_000_000, 1_000_000_000]},
}
DEEPSPEED_OFFLOAD = {1: {"offload_optimizer": ["none", "cpu"]}, 2: {"offload_optimizer": ["none", "cpu"]},
                     3: {"offload_optimizer": ["none", "cpu"], "offload_param": ["none", "cpu"]}}


@pytest.mark.parametrize("cuda", [False, True])
def test_our_engine_tries_the_same_values_on_any_device(cuda):
    assert full_mode_values({}, "autotuner", cuda) == OUR_ENGINE_KNOBS


def test_deepspeeds_engine_adds_offload_on_cuda_only_and_not_over_a_users_offload_section():
    assert full_mode_values({}, "deepspeed", cuda=False) == DEEPSPEED_KNOBS
    on_cuda = {stage: {**knobs, **DEEPSPEED_OFFLOAD.get(stage, {})} for stage, knobs in DEEPSPEED_KNOBS.items()}
    assert full_mode_values({}, "deepspeed", cuda=True) == on_cuda
    user = {"zero_optimization": {"offload_param": {"device": "none"}}}
    assert full_mode_values(user, "deepspeed", cuda=True) == DEEPSPEED_KNOBS  # either section fixes both


OFFLOAD_AUTO = {"zero_optimization": {"offload_optimizer": {"device": "auto", "pin_memory": True},
                                     "offload_param": {"device": "auto"}}}


def test_offload_auto_is_searched_beside_each_stage_that_offers_it_on_cuda_only():
    ours = dimensions.variant_values(OFFLOAD_AUTO, "autotuner", cuda=True)
    assert ours == {2: ((("offload_optimizer", "none"),), (("offload_optimizer", "cpu"),)),
                    3: ((("offload_optimizer", "none"),), (("offload_optimizer", "cpu"),))}  # FSDP2: one policy
    theirs = dimensions.variant_values(OFFLOAD_AUTO, "deepspeed", cuda=True)
    assert set(theirs) == {1, 2, 3} and theirs[1] == ours[2]
    assert theirs[3][0] == (("offload_optimizer", "none"), ("offload_param", "none"))  # least memory saved first
    assert len(theirs[3]) == 4
    assert dimensions.variant_values(OFFLOAD_AUTO, "autotuner", cuda=False) == {}
    assert dimensions.variant_values(OFFLOAD_AUTO, "deepspeed", cuda=False) == {}
    # "auto" is the user's ask, so full mode does not also sweep it as a knob.
    assert full_mode_values(OFFLOAD_AUTO, "deepspeed", cuda=True) == DEEPSPEED_KNOBS


def test_offload_auto_is_settled_to_none_for_the_profile_and_stays_in_deepspeeds_configs():
    base = json.loads(json.dumps(OFFLOAD_AUTO))
    dimensions.settle_variants(base)
    assert base["zero_optimization"]["offload_optimizer"] == {"device": "none", "pin_memory": True}
    assert base["zero_optimization"]["offload_param"] == {"device": "none"}
    # DeepSpeed reads offload from its own config: not a path the script's flags carry.
    paths = dimensions.applied_by_the_script("deepspeed")
    assert ("zero_optimization", "offload_optimizer", "device") not in paths
    assert ("activation_checkpointing", "policy") in paths and ("compile", "enabled") in paths
    config = Experiment(2, 4).with_knobs({"offload_optimizer": "cpu"}).apply(base, 2)
    assert load_config(config).zero_optimization.offload_optimizer.device == "cpu"


def test_the_config_names_its_tuned_offload_sections():
    config = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2, **OFFLOAD_AUTO["zero_optimization"]}})
    assert config.zero_optimization.tuned_offloads == ("offload_optimizer", "offload_param")
    assert load_config({"train_batch_size": 2}).zero_optimization.tuned_offloads == ()


# ----- the contract every dimension keeps: the built-in ones, the installed plugins' and the toy's -----
@pytest.fixture
def toy_registered(monkeypatch):
    """tests/plugins/toy_dimension.py's dimension and its config section, registered for one test."""
    monkeypatch.setitem(sections.SECTIONS, TOY.section.key, TOY.section)
    monkeypatch.setitem(dimensions.REGISTRY, TOY.name, TOY)


def pytest_generate_tests(metafunc):
    """The dimensions are read when the tests are collected, after the installed plugins registered theirs."""
    if metafunc.cls is TestDimensionContract:
        from autotuner.core.plugins import load_plugins

        load_plugins()
        registered = {**dimensions.REGISTRY, TOY.name: TOY}
        # A knob is tuned in full mode where the user left it out, never from "auto": no tuned key.
        offered = [n for n, d in registered.items() if d.role != "knob" or not metafunc.function.__name__.startswith(
            "test_auto_at_its_path")]
        metafunc.parametrize("name", sorted(offered))


@pytest.mark.usefixtures("toy_registered")
class TestDimensionContract:
    def test_its_path_is_a_config_key_the_config_keeps(self, name):
        """A user may fix or list any tuned dimension in ds.json; none is set aside as unused."""
        dim = dimensions.REGISTRY[name]
        value = next(v for engine in dim.values.values() for values in engine.values() for v in values)
        raw: dict = {"train_batch_size": 8}
        dimensions.write(raw, dim.path, value)
        kept, set_aside = check_keys(raw, DeepSpeedConfig, "ds.json", sections={k: s.model for k, s in
                                                                                 sections.SECTIONS.items()})
        assert set_aside == []
        assert dimensions.lookup(load_config(kept).to_dict(), dim.path) == (True, value)

    def test_auto_at_its_path_is_refused_outside_a_tune_by_the_launcher_and_the_ranks(self, name):
        """A dimension the user asks to tune with "auto" declares its tuned key at the config layer,
        which the launcher (before a training launch) and every rank read."""
        dim = dimensions.REGISTRY[name]
        raw: dict = {"train_batch_size": 8}
        dimensions.write(raw, dim.path, "auto")
        config = load_config(raw)
        assert [tuned.path for tuned, _ in sections.unsettled_keys(config)] == [dim.path]
        for in_rank, wording in ((False, "is only for --autotuning tune|run"), (True, "is settled by --autotuning")):
            with pytest.raises(ConfigError) as refused:
                sections.refuse_unsettled(config, "ds.json", in_rank)
            assert str(refused.value).startswith(f'ds.json: {dimensions.dotted(dim)}: got "auto"; ')
            assert wording in str(refused.value) and refused.value.exit_code == 2

    def test_its_refusals_pass_a_config_that_does_not_use_it(self, name):
        dim = dimensions.REGISTRY[name]
        config = load_config({"train_batch_size": 8})
        for refusal in dim.tune_refusals:
            refusal(dim, config, "ds.json")
        for refusal in dim.deepspeed_refusals:
            refusal(dim, config, "ds.json", "the script imports deepspeed", {})


def test_a_section_no_dimension_registered_is_still_an_unknown_key():
    with pytest.raises(ConfigError) as refused:
        load_config({"train_batch_size": 8, "toy_knob": {"level": "high"}}, name="ds.json")
    assert str(refused.value).startswith("ds.json: unknown key 'toy_knob'; ")
    assert refused.value.exit_code == 2


@pytest.mark.usefixtures("toy_registered")
@pytest.mark.parametrize("section, message", [
    ({"level": "medium"}, 'ds.json: toy_knob.level: got "medium"; '),
    ({"level": ["low", "auto"]}, "ds.json: toy_knob.level: got "),
    ({"levle": "low"}, "ds.json: unknown key 'toy_knob.levle'; did you mean 'level'?"),
    ("high", 'ds.json: toy_knob: got "high"; '),
], ids=["value", "list", "typo", "not-a-section"])
def test_a_registered_section_is_validated_by_its_own_model_in_one_line(section, message):
    with pytest.raises(ConfigError) as refused:
        load_config({"train_batch_size": 8, "toy_knob": section}, name="ds.json")
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert refused.value.exit_code == 2


@pytest.mark.usefixtures("toy_registered")
def test_a_registered_section_is_read_back_and_written_out():
    config = load_config({"train_batch_size": 8, "toy_knob": {"level": "high"}})
    assert config.section("toy_knob").level == "high"
    assert config.to_dict()["toy_knob"] == {"level": "high"}
    assert config.with_device_precision(False).section("toy_knob").level == "high"  # copies keep it
    assert load_config({"train_batch_size": 8}).section("toy_knob") is None


def test_a_section_the_config_has_already_is_refused(monkeypatch):
    monkeypatch.setattr(sections, "SECTIONS", {})
    for taken in ("compile", "pipeline", "amp"):  # our own, one set aside, one DeepSpeed removed
        with pytest.raises(ValueError, match=f"config section '{taken}' is taken already"):
            sections.register_section(sections.ConfigSection(taken, TOY.section.model))
    sections.register_section(TOY.section)
    with pytest.raises(ValueError, match="is taken already"):
        sections.register_section(sections.ConfigSection("toy_knob", TOY.section.model))
    outside = dataclasses.replace(TOY, name="elsewhere", tag="els", path=("compile", "level"))
    with pytest.raises(ValueError, match="outside its section 'toy_knob'"):
        dimensions.register_dimension(outside)


def test_apply_writes_each_dimension_at_its_path_and_keeps_the_rest_of_its_section():
    base = {"zero_optimization": {"offload_optimizer": {"pin_memory": True}, "overlap_comm": False}}
    experiment = Experiment(3, 4).with_knobs({"offload_optimizer": "cpu", "overlap_comm": True})
    config = experiment.apply(base, 2)
    assert config["zero_optimization"] == {"offload_optimizer": {"pin_memory": True, "device": "cpu"},
                                           "overlap_comm": True, "stage": 3}
    assert base["zero_optimization"]["offload_optimizer"] == {"pin_memory": True}  # the base is not touched
    assert experiment.name == "z3_oocpu_ocT_gas1_mbs4"
    assert experiment.features()["offload_optimizer"] == 1.0


def test_memory_terms_fold_offload_and_zero_knobs_into_the_stage_settings():
    settings = StageSettings(3, zero_knobs=(("reduce_bucket_size", 5),))
    for name, value in (("offload_param", "cpu"), ("overlap_comm", True), ("offload_optimizer", "none")):
        settings = dimensions.memory_term(settings, name, value)
    assert (settings.offload_param, settings.offload_optimizer) == (True, False)
    assert settings.zero_knobs == (("overlap_comm", True), ("reduce_bucket_size", 5))


# ----- a toy dimension, declared here and nowhere else -----
POLICY_BLOCKS = {"none": 0, "every_2nd": 2}


def test_a_dimension_declared_only_in_the_registry_is_searched_named_encoded_applied_and_costed(
        tmp_path, monkeypatch):
    costed: list[tuple[int, str]] = []

    def memory_term(settings: StageSettings, value: str) -> StageSettings:
        costed.append((settings.zero_stage, value))
        return settings

    toy = Dimension("toy_checkpointing", ("toy_activation_checkpointing", "policy"), "tck",
                    {"autotuner": {0: ("none", "every_2nd")}}, memory_term, encode=lambda v: POLICY_BLOCKS[v])
    monkeypatch.setitem(dimensions.REGISTRY, toy.name, toy)

    seen_configs: dict[str, dict] = {}

    def answer(trial: Trial) -> TrialResult:
        seen_configs[trial.directory.name] = experiment_config(trial.experiment, trial.settings)  # what a runner writes
        policy = dict(trial.experiment.knobs).get("toy_checkpointing", "none")
        result = ok(trial, 10.0 * trial.experiment.micro_batch_size + (5.0 if policy == "every_2nd" else 0.0),
                    200 * 2**20)
        if trial.profile:
            return dataclasses.replace(result, model_info=model_info(trial.experiment.micro_batch_size))
        return result

    config = load_config({"train_micro_batch_size_per_gpu": [2, 4], "zero_optimization": {"stage": 0},
                          "autotuning": {"enabled": True, "fast": False, "memory_per_rank_bytes": 4 * 2**30,
                                         "tuner_type": "gridsearch"}})
    settings = experiment_settings(config)
    runner = FakeRunner(answer)
    outcome = orchestrator(tmp_path, config, runner, settings).tune()

    toy_names = [name for name in runner.names if "_tck" in name]
    assert toy_names, runner.names
    assert outcome.best.experiment.knobs and dict(outcome.best.experiment.knobs)["toy_checkpointing"] == "every_2nd"
    assert "_tckevery_2nd_" in outcome.best.name
    for name in toy_names:
        policy = "every_2nd" if "tckevery_2nd" in name else "none"
        assert seen_configs[name]["toy_activation_checkpointing"] == {"policy": policy}
    assert {value for _, value in costed} == {"none", "every_2nd"}  # the memory book asked its term
    assert Experiment(0, 2).with_knobs({"toy_checkpointing": "every_2nd"}).features()["toy_checkpointing"] == 2
    optimal = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert optimal["toy_activation_checkpointing"] == {"policy": "every_2nd"}
    journaled = [json.loads(p.read_text())["result"]["experiment"] for p in (tmp_path / "exps").glob("*tck*/exp.json")]
    assert journaled and all("toy_checkpointing" in dict(map(tuple, e["knobs"])) for e in journaled)
    assert TrialState.OK is outcome.best.state
