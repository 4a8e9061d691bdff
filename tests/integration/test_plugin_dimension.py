"""A dimension with a config key of its own, declared in one module outside the package
(tests/plugins/toy_dimension.py) and installed as a plugin (an entry point in a dist-info on
PYTHONPATH): a real tune on 2 CPU ranks searches it, names it, writes it into each experiment's
config, which every rank accepts and reads back, and into the optimal config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from conftest import ROOT, WORKERS, experiments_table, launcher_env, tune, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture
def toy_dimension_env(tmp_path) -> dict[str, str]:
    """The launcher's environment with toy_dimension installed: its module and its entry point."""
    dist_info = tmp_path / "site" / "toy_dimension-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-dimension\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[autotuner.plugins]\ntoy_dimension = toy_dimension:register\n")
    env = launcher_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(ROOT / "tests" / "plugins"), env["PYTHONPATH"]])
    return env


def test_a_plugins_dimension_with_its_own_key_is_tuned_by_real_ranks(tmp_path, toy_dimension_env, no_orphans):
    config = write_config(tmp_path / "ds.json", {"max_train_micro_batch_size_per_gpu": 2}, toy_knob={"level": "auto"})
    result = tune(tmp_path, config, "--steps", "6", script=WORKERS / "toy_knob_train.py", env=toy_dimension_env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = experiments_table(tmp_path / "autotuning_results")
    launched = table[table.state == "ok"]
    # A finishing dimension: the configurations run at its neutral level first ("low", the base,
    # untagged), then the best of them at its other level, named by its tag.
    levels = {name: "high" if "_tkhigh_" in name else "low" for name in launched.name}
    assert set(levels.values()) == {"low", "high"}, table.name.tolist()
    for name, level in levels.items():
        knobs = launched[launched.name == name].knobs.iloc[0]
        assert (knobs == f"toy_knob={level}") if level == "high" else pd.isna(knobs)  # experiments.csv's column
        written = json.loads((tmp_path / "autotuning_exps" / name / "ds_config.json").read_text())
        assert written["toy_knob"] == {"level": level}
        # Each rank's engine was built with the experiment's level, read back from its config.
        assert [(tmp_path / "autotuning_exps" / name / f"toy_knob_seen.{rank}").read_text() for rank in (0, 1)] == \
            [level, level]
    best = table[table.chosen].iloc[0]
    assert "_tkhigh" in best["name"], table[["name", "metric_value", "chosen"]].to_string()  # "low" sleeps 60 ms a step
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["toy_knob"] == {"level": "high"}


def test_a_plugins_tuned_key_is_refused_for_a_plain_run(tmp_path, toy_dimension_env, no_orphans):
    config = write_config(tmp_path / "ds.json", toy_knob={"level": ["low", "high"]}, train_micro_batch_size_per_gpu=2)
    from conftest import run_launcher

    result = run_launcher("--nproc_per_node", "2", WORKERS / "toy_knob_train.py", "--deepspeed", config,
                          cwd=tmp_path, env=toy_dimension_env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith(
        f'{config}: toy_knob.level: got ["low", "high"]; "auto" or a list is only for --autotuning tune|run; give '
        '"low" or "high" to train')
