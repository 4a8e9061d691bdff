"""Which engine a script trains on (issue 46): read from its imports when they name one engine,
settled by the profile launch's ranks when they name both, and said with its reason in every
message that depends on it. No processes: the launches are a fake runner's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autotuner.app import engines
from autotuner.app.cli import build_parser
from autotuner.app.engines import EngineChoice, check_our_engine_sections, engine_choice, script_engine
from autotuner.app.request import TuneRequest
from autotuner.app.settle import settle, settle_built_engine
from autotuner.config import load_config
from autotuner.core.errors import ConfigError, UsageError
from autotuner.core.script_imports import import_sites
from autotuner.tuning.orchestrator import Autotuner
from autotuner.tuning.trials.trial import launched_config
from autotuner.tuning.space.experiment import Experiment
from fakes import FakeRunner, experiment_settings, model_info, ok, orchestrator

MiB = 2**20
BEHIND_A_VARIABLE = ("import os\n\nif os.environ.get('USE_DS'):\n    import deepspeed\nelse:\n"
                     "    import autotuner as deepspeed\n")
TRY_FALLBACK = "try:\n    import deepspeed\nexcept ImportError:\n    import autotuner as deepspeed\n"


def script(tmp_path: Path, text: str, name: str = "train.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ----- the import reader: certain or not, and where -----
@pytest.mark.parametrize("text, engine, settled, reason", [
    ("import torch\nimport deepspeed\n", "deepspeed", True, "imports deepspeed (line 2)"),
    ("def main():\n    from deepspeed.ops.adam import FusedAdam\n", "deepspeed", True, "imports deepspeed (line 2)"),
    ("from transformers import Trainer\n", "deepspeed", True,
     "imports transformers.Trainer (line 1), which trains on DeepSpeed's engine with --deepspeed"),
    ("import autotuner\n", "autotuner", True, "imports autotuner (line 1) and not deepspeed"),
    ("from transformers import Trainer\nimport autotuner\n", "autotuner", True, "imports autotuner (line 2)"),
    ("import torch\n", "autotuner", True, "imports neither deepspeed nor autotuner"),
    (BEHIND_A_VARIABLE, "autotuner", False, "imports both deepspeed (line 4) and autotuner (line 6)"),
    (TRY_FALLBACK, "autotuner", False, "imports both deepspeed (line 2) and autotuner (line 4)"),
    ("import deepspeed\nfrom autotuner.config import fill_auto\n", "autotuner", False,
     "imports both deepspeed (line 1) and autotuner (line 2)"),
], ids=["deepspeed", "nested", "trainer", "ours", "trainer-and-ours", "neither", "variable", "try", "both"])
def test_the_imports_settle_the_engine_only_when_they_name_one(tmp_path, text, engine, settled, reason):
    choice = engine_choice(script(tmp_path, text))
    assert (choice.engine, choice.settled, choice.decided_by) == (engine, settled, "imports")
    assert reason in choice.reason and choice.reason.startswith(str(tmp_path / "train.py"))


def test_an_import_in_the_scripts_own_module_is_named_with_its_file_and_line(tmp_path):
    script(tmp_path, "import json\n\nimport deepspeed\n", name="helpers.py")
    choice = engine_choice(script(tmp_path, "import autotuner\nimport helpers\n"))
    assert not choice.settled
    assert choice.reason.endswith("imports both deepspeed (helpers.py, line 3) and autotuner (line 1)")


def test_every_import_is_read_installed_or_not(tmp_path):
    sites = import_sites(script(tmp_path, "import not_installed_anywhere\ntry:\n    import deepspeed\nexcept "
                                          "ImportError:\n    pass\n"))
    assert [(site.name, site.line) for site in sites] == [("not_installed_anywhere", 1), ("deepspeed", 3)]


def test_the_flag_settles_it_and_nothing_is_read(tmp_path):
    missing = str(tmp_path / "not_written.py")
    for engine in ("deepspeed", "autotuner"):
        assert engine_choice(missing, engine) == EngineChoice(engine, True, "--engine", f"--engine {engine} was given")
    with pytest.raises(UsageError, match="--engine: got 'ours'; choose one of auto, deepspeed, autotuner"):
        engine_choice(missing, "ours")


def test_the_reason_says_which_engine_and_the_flag_that_changes_a_guess(tmp_path):
    assert engine_choice(script(tmp_path, "import deepspeed\n")).why == (
        f"{tmp_path / 'train.py'} imports deepspeed (line 1), so it is taken to train on DeepSpeed's engine "
        "(pass --engine autotuner if it trains on ours)")
    assert engine_choice(script(tmp_path, "import autotuner\n")).why.endswith(
        "so it is taken to train on our engine (pass --engine deepspeed if it trains on DeepSpeed's)")
    assert engine_choice(str(tmp_path / "train.py"), "deepspeed").why == "--engine deepspeed was given"


def test_the_ranks_settle_an_unsettled_choice_and_say_so(tmp_path):
    both = engine_choice(script(tmp_path, BEHIND_A_VARIABLE))
    built = both.built("deepspeed")
    assert (built.engine, built.settled, built.decided_by) == ("deepspeed", True, "ranks")
    assert built.why == (f"{tmp_path / 'train.py'} imports both deepspeed (line 4) and autotuner (line 6), and the "
                         "profile launch's ranks built DeepSpeed's engine")
    ours = engine_choice(script(tmp_path, "import autotuner\n"))
    assert ours.built("autotuner") is ours
    assert ours.built("deepspeed").why.startswith("the profile launch's ranks built DeepSpeed's engine, though ")


def test_without_deepspeed_only_a_script_that_needs_it_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(engines, "deepspeed_installed", lambda: False)
    with pytest.raises(UsageError) as caught:
        script_engine(script(tmp_path, "import deepspeed\n"))
    message = str(caught.value)
    assert caught.value.exit_code == 2 and "\n" not in message
    assert "train.py imports deepspeed (line 1), so it is taken to train on DeepSpeed's engine (pass --engine " \
           "autotuner if it trains on ours), but DeepSpeed is not installed" in message
    assert "import autotuner as deepspeed" in message
    # A fallback to ours may be what runs: the ranks will say.
    assert not script_engine(script(tmp_path, TRY_FALLBACK)).settled
    assert script_engine(script(tmp_path, "import deepspeed\n"), "autotuner").engine == "autotuner"


# ----- the checks: not on a guess; after the ranks, naming the engine they built -----
def test_our_engines_keys_are_refused_only_for_a_settled_deepspeed_engine(tmp_path):
    config = load_config({"activation_checkpointing": {"policy": "auto"}})
    both = engine_choice(script(tmp_path, BEHIND_A_VARIABLE))
    check_our_engine_sections(config, both, "ds.json")
    check_our_engine_sections(config, both.built("autotuner"), "ds.json")
    with pytest.raises(ConfigError) as caught:
        check_our_engine_sections(config, both.built("deepspeed"), "ds.json")
    message = str(caught.value)
    assert caught.value.exit_code == 2 and "\n" not in message
    assert message.startswith(f'ds.json: activation_checkpointing.policy: "auto" is tuned by our engine only, but '
                              f"{tmp_path / 'train.py'} imports both deepspeed (line 4) and autotuner (line 6), and "
                              "the profile launch's ranks built DeepSpeed's engine; on DeepSpeed's engine")
    config = load_config({"compile": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"compile.enabled: our engine's key, but .*train.py imports deepspeed "
                                          r"\(line 1\), so it is taken to train on DeepSpeed's engine"):
        check_our_engine_sections(config, engine_choice(script(tmp_path, "import deepspeed\n")), "ds.json")


def settle_in(tmp_path: Path, monkeypatch, text: str, *flags: str, autotuning: dict | None = None):
    """settle() for train.py (`text`) tuned with activation_checkpointing.policy "auto"."""
    monkeypatch.chdir(tmp_path)
    script(tmp_path, text)
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "activation_checkpointing": {"policy": "auto"},
        "autotuning": {"enabled": True, **(autotuning or {})}}))
    args = build_parser().parse_args(["--autotuning", "tune", *flags, "--nproc_per_node", "2", "train.py",
                                      "--deepspeed", "ds.json"])
    args.nproc_per_node = 2  # as cli.main settles it
    return settle(TuneRequest.of(args))


def test_a_two_engine_script_is_settled_without_a_refusal_and_the_built_engine_is_checked(tmp_path, monkeypatch,
                                                                                          capsys):
    job = settle_in(tmp_path, monkeypatch, BEHIND_A_VARIABLE)
    assert not job.engine.settled and not job.settings.engine_settled
    assert ("engine: train.py imports both deepspeed (line 4) and autotuner (line 6); the profile launch's ranks "
            "tell which engine it trains on") in capsys.readouterr().out
    assert settle_built_engine(job, "autotuner") == (
        "engine: train.py imports both deepspeed (line 4) and autotuner (line 6), and the profile launch's ranks "
        "built our engine; every experiment runs there")
    with pytest.raises(ConfigError) as caught:
        settle_built_engine(job, "deepspeed")
    assert caught.value.exit_code == 2 and "\n" not in str(caught.value)
    assert 'activation_checkpointing.policy: "auto" is tuned by our engine only, but train.py imports both ' \
           "deepspeed (line 4) and autotuner (line 6), and the profile launch's ranks built DeepSpeed's engine" \
           in str(caught.value)
    # Mapped to the script's flag, the policy is DeepSpeed's engine's to tune too.
    job = settle_in(tmp_path, monkeypatch, BEHIND_A_VARIABLE, autotuning={
        "arg_mappings": {"activation_checkpointing.policy": "--gradient_checkpointing"}})
    assert "built DeepSpeed's engine" in settle_built_engine(job, "deepspeed")


def test_a_settled_engine_is_checked_before_any_launch_and_the_flag_overrides_the_imports(tmp_path, monkeypatch):
    # Whether DeepSpeed is installed here or not: its absence is refused first, and is tested on its own.
    monkeypatch.setattr(engines, "deepspeed_installed", lambda: True)
    with pytest.raises(ConfigError, match=r"tuned by our engine only, but train.py imports deepspeed \(line 1\), so "
                                          r"it is taken to train on DeepSpeed's engine \(pass --engine autotuner"):
        settle_in(tmp_path, monkeypatch, "import deepspeed\n")
    job = settle_in(tmp_path, monkeypatch, "import deepspeed\n", "--engine", "autotuner")
    assert job.engine.settled and job.settings.engine == "autotuner"
    with pytest.raises(ConfigError, match="tuned by our engine only, but --engine deepspeed was given; "):
        settle_in(tmp_path, monkeypatch, BEHIND_A_VARIABLE, "--engine", "deepspeed")


def test_a_two_engine_script_cannot_skip_the_profile_that_settles_it(tmp_path, monkeypatch):
    with pytest.raises(UsageError) as caught:
        settle_in(tmp_path, monkeypatch, TRY_FALLBACK, autotuning={"model_info": {"num_params": 1000}})
    assert caught.value.exit_code == 2
    assert str(caught.value).startswith("train.py imports both deepspeed (line 2) and autotuner (line 4), so only "
                                        "the profile launch's ranks can tell which engine it trains on")
    assert "pass --engine deepspeed or --engine autotuner" in str(caught.value)
    job = settle_in(tmp_path, monkeypatch, TRY_FALLBACK, "--engine", "autotuner",
                    autotuning={"model_info": {"num_params": 1000}})
    assert job.settings.engine_settled


# ----- before it is settled: a config either engine reads -----
def test_before_the_engine_is_settled_a_launch_gets_the_users_keys_without_neutral_engine_only_ones():
    user = {"train_micro_batch_size_per_gpu": "auto", "steps_per_print": 7, "activation_checkpointing": {"policy":
            "auto", "partition_activations": False}, "compile": {"enabled": "auto"}}
    config = load_config(user)
    settings = experiment_settings(config, user_config=user, engine_settled=False)
    written = launched_config(Experiment(0, 2, 1, (("activation_checkpointing", "none"),)), settings)
    assert written["steps_per_print"] == 7  # DeepSpeed's own key: both engines read the user's file
    assert written["activation_checkpointing"] == {"partition_activations": False}  # DeepSpeed would ignore "none"
    assert "compile" not in written  # DeepSpeed refuses our compile keys
    assert written["train_batch_size"] == 4
    # A value that is not neutral stays: the engine the ranks build acts on it, or the tuner refuses it then.
    full = launched_config(Experiment(0, 2, 1, (("activation_checkpointing", "full"),)), settings)
    assert full["activation_checkpointing"]["policy"] == "full"


# ----- the orchestrator: settled at the first profile launch that ran, before any other -----
def two_engine_tuner(tmp_path: Path, built: str, settle_engine, lines: list) -> tuple[Autotuner, FakeRunner]:
    config = load_config({"train_micro_batch_size_per_gpu": [2, 4], "zero_optimization": {"stage": 0},
                          "activation_checkpointing": {"policy": "auto"},
                          "autotuning": {"enabled": True, "memory_per_rank_bytes": 4 * 2**30,
                                         "tuner_type": "gridsearch", "history": False}})

    def answer(trial):
        result = ok(trial, 10.0 * trial.experiment.micro_batch_size, 200 * MiB)
        if trial.profile:
            info = model_info(trial.experiment.micro_batch_size, engine=built, activation_bytes=MiB,
                              activation_bytes_by_policy=(("full", MiB // 4), ("selective", MiB // 2)))
            result = dataclasses.replace(result, model_info=info)
        return result

    runner = FakeRunner(answer)
    settings = experiment_settings(config, engine_settled=False, memory_budget_bytes=4 * 2**30)
    tuner = orchestrator(tmp_path, config, runner, settings, report=lines.append, settle_engine=settle_engine)
    return tuner, runner


def test_a_refusal_for_the_built_engine_comes_after_the_first_profile_launch_and_nothing_else(tmp_path):
    asked = []

    def refuse(built: str) -> str:
        asked.append(built)
        raise ConfigError("ds.json: refused for the engine the ranks built")

    tuner, runner = two_engine_tuner(tmp_path, "deepspeed", refuse, [])
    with pytest.raises(ConfigError, match="refused for the engine the ranks built"):
        tuner.tune()
    assert asked == ["deepspeed"] and len(runner.trials) == 1 and runner.trials[0].profile
    assert not runner.trials[0].settings.engine_settled


@pytest.mark.parametrize("built, policies", [("autotuner", {"none", "selective", "full"}),
                                             ("deepspeed", {"none", "full"})])
def test_the_built_engine_settles_the_launches_and_the_dimensions_searched(tmp_path, built, policies):
    lines: list[str] = []
    tuner, runner = two_engine_tuner(tmp_path, built, lambda engine: f"engine: the ranks built {engine}'s", lines)
    tuner.tune()
    assert lines.count(f"engine: the ranks built {built}'s") == 1
    assert [t.settings.engine_settled for t in runner.trials][:2] == [False, True]
    assert {t.settings.engine for t in runner.trials[1:]} == {built}
    searched = {value for variants in tuner.profiled.job.space.variants.values() for variant in variants
                for name, value in variant if name == "activation_checkpointing"}
    assert searched == policies
