"""Scripts that import both engines and choose at run time (issue 46), tuned on 2 CPU ranks: the
profile launch's ranks say which engine they built, and the tuner settles from it what depends
on the engine, refusing only what is wrong for that engine, after the profile and before any
other launch. The DeepSpeed cases need DeepSpeed (CI installs it CPU-only) and skip without it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from autotuner.config import read_config_file
from conftest import WORKERS, experiments_table, launcher_env, tune, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="needs DeepSpeed: pip install 'autotuner[deepspeed]'")

BEHIND_A_VARIABLE = WORKERS / "two_engines_train.py"  # deepspeed at line 13, autotuner at line 15
TRY_FALLBACK = WORKERS / "deepspeed_or_ours_train.py"  # deepspeed at line 7, autotuner at line 9
# Two repeated blocks, so the profile measures what each checkpointing policy holds.
BLOCKS = ("--blocks", "2", "--width", "32", "--seq_len", "64")
SMALL = {"max_train_micro_batch_size_per_gpu": 4}
POLICY_AUTO = {"activation_checkpointing": {"policy": "auto"}}


def env(use_ds: bool, **extra: str) -> dict[str, str]:
    environ = {key: value for key, value in launcher_env().items() if key != "USE_DS"}
    return {**environ, "OMP_NUM_THREADS": "1", **({"USE_DS": "1"} if use_ds else {}), **extra}


def experiments(tmp_path: Path) -> pd.DataFrame:
    return experiments_table(tmp_path / "autotuning_results")


def searched_policies(stdout: str) -> set[str]:
    """The policies the memory model's line lists per stage: the variants searched."""
    line = next(line for line in stdout.splitlines() if "memory model, largest micro-batch per stage" in line)
    return {policy for policy in ("none", "selective", "full") if f"activation_checkpointing={policy}=" in line}


def test_behind_a_variable_left_unset_the_script_tunes_every_policy_on_ours(tmp_path, no_orphans):
    config = write_config(tmp_path / "ds.json", SMALL, **POLICY_AUTO)
    result = tune(tmp_path, config, *BLOCKS, script=BEHIND_A_VARIABLE, env=env(use_ds=False))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (f"engine: {BEHIND_A_VARIABLE} imports both deepspeed (line 13) and autotuner (line 15), and the "
            "profile launch's ranks built our engine; every experiment runs there") in result.stdout
    assert searched_policies(result.stdout) == {"none", "selective", "full"}
    assert set(experiments(tmp_path).engine.dropna()) == {"autotuner"}
    optimal = read_config_file(tmp_path / "autotuning_results" / "ds_config_optimal.json")
    assert optimal["activation_checkpointing"]["policy"] in ("none", "selective", "full")


@needs_deepspeed
def test_behind_a_variable_set_the_policy_is_refused_after_the_profile_naming_deepspeeds_engine(tmp_path,
                                                                                                 no_orphans):
    config = write_config(tmp_path / "ds.json", SMALL, **POLICY_AUTO)
    result = tune(tmp_path, config, *BLOCKS, script=BEHIND_A_VARIABLE, env=env(use_ds=True))
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("launcher: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert errors[0] == (
        f'launcher: error: {config}: activation_checkpointing.policy: "auto" is tuned by our engine only, but '
        f"{BEHIND_A_VARIABLE} imports both deepspeed (line 13) and autotuner (line 15), and the profile launch's "
        "ranks built DeepSpeed's engine; on DeepSpeed's engine the script checkpoints activations itself "
        "(deepspeed.checkpointing, or Hugging Face's --gradient_checkpointing): map it to the script's flag in "
        'autotuning.arg_mappings (e.g. "activation_checkpointing.policy": "--gradient_checkpointing"), or set it '
        'to "none" or leave it out')
    # Nothing was refused on the imports' guess, and nothing launched past the profile's first run.
    assert "the profile launch's ranks tell which engine it trains on" in result.stdout
    launched = [path.name for path in (tmp_path / "autotuning_exps").iterdir() if path.is_dir()]
    assert launched == ["z0_acnone_gas1_mbs1"], launched
    # Its config was one DeepSpeed reads: no policy of ours in it.
    written = json.loads((tmp_path / "autotuning_exps" / launched[0] / "ds_config.json").read_text())
    assert "activation_checkpointing" not in written


@needs_deepspeed
def test_behind_a_variable_set_with_the_policy_mapped_deepspeeds_policies_are_tuned(tmp_path, no_orphans):
    mappings = {"arg_mappings": {"train_micro_batch_size_per_gpu": "--micro_batch_size",
                                 "gradient_accumulation_steps": "--gradient_accumulation_steps",
                                 "activation_checkpointing.policy": "--gradient_checkpointing"}}
    config = write_config(tmp_path / "ds.json", {**SMALL, **mappings}, **POLICY_AUTO)
    result = tune(tmp_path, config, *BLOCKS, script=BEHIND_A_VARIABLE, env=env(use_ds=True))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "and the profile launch's ranks built DeepSpeed's engine; every experiment runs there" in result.stdout
    assert searched_policies(result.stdout) == {"none", "full"}  # what --gradient_checkpointing can express
    assert set(experiments(tmp_path).engine.dropna()) == {"deepspeed"}
    assert "--gradient_checkpointing" in (tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text()


def test_a_try_import_deepspeed_script_on_a_python_without_deepspeed_tunes_on_ours(tmp_path, no_orphans):
    # Every process of the run (the tuner, its launchers, the ranks) starts with DeepSpeed hidden:
    # `import deepspeed` raises ImportError and find_spec finds nothing, as where it is not installed.
    hidden = tmp_path / "no_deepspeed"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\n\nsys.modules['deepspeed'] = None\n")
    without = env(use_ds=False, PYTHONPATH=f"{hidden}:{launcher_env()['PYTHONPATH']}")
    probe = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec("
                            "'deepspeed'))"], env=without, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "None", probe.stderr
    config = write_config(tmp_path / "ds.json", SMALL, **POLICY_AUTO)
    result = tune(tmp_path, config, *BLOCKS, script=TRY_FALLBACK, env=without)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "DeepSpeed is not installed" not in result.stdout + result.stderr
    assert (f"engine: {TRY_FALLBACK} imports both deepspeed (line 7) and autotuner (line 9), and the profile "
            "launch's ranks built our engine") in result.stdout
    assert searched_policies(result.stdout) == {"none", "selective", "full"}
    assert set(experiments(tmp_path).engine.dropna()) == {"autotuner"}
