"""A tuner, a backend and a dimension added from outside the package, as a third party would ship them: a module
and its entry point (group autotuner.plugins) in a dist-info on PYTHONPATH, no edit to autotuner.
Each is run from the launcher's entry point with real launches of the toy script."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from conftest import TOY, experiments_table, launcher_env, run_launcher, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PLUGIN = '''
"""A third party's tuner and backend for autotuner."""
import os
from contextlib import contextmanager
from pathlib import Path

from autotuner.execution.backends import BackendSpec, Flag, register_backend
from autotuner.tuning.space.dimensions import Dimension, register_dimension
from autotuner.tuning.tuners import Tuner, TunerSpec, register_tuner


class LargestFirst(Tuner):
    """Asks the largest micro-batch first; writes each ask to $TOY_TUNER_LOG."""

    def _choose(self, untried):
        choice = max(untried, key=lambda e: (e.micro_batch_size, -e.zero_stage))
        with open(os.environ["TOY_TUNER_LOG"], "a") as log:
            log.write(choice.name + "\\n")
        return choice


@contextmanager
def open_marking_runner(request):
    from autotuner.execution.cold import ColdRunner

    class Marking(ColdRunner):
        name = "marking"

        def run(self, trial):
            result = super().run(trial)
            (trial.directory / "backend.txt").write_text(request.options.value("toy_label"))
            return result

    runner = Marking()
    try:
        yield runner
    finally:
        runner.close()


def register():
    register_tuner(TunerSpec("largest_first", lambda a: LargestFirst(a.space, a.objective, seed=a.seed),
                             "the largest micro-batch first"))
    register_backend(BackendSpec("marking", "cold launches that mark each experiment's directory",
                                 open_marking_runner, flags=(Flag("--toy_label", {"default": None}),)))
    # A knob our engine already honours (it divides the gradients before the all-reduce and
    # multiplies after: the same mean), tuned in full mode at ZeRO 0.
    register_dimension(Dimension("predivide", ("gradient_predivide_factor",), "pdf",
                                 {"autotuner": {0: (1.0, 2.0)}}, lambda settings, value: settings))
'''


@pytest.fixture
def plugin_env(tmp_path) -> dict[str, str]:
    """PYTHONPATH with the plugin's module and its dist-info (entry point group autotuner.plugins)."""
    site = tmp_path / "site"
    (site / "toy_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "toy_plugin.py").write_text(textwrap.dedent(PLUGIN))
    (site / "toy_plugin-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (site / "toy_plugin-0.1.dist-info" / "entry_points.txt").write_text(
        "[autotuner.plugins]\ntoy = toy_plugin:register\n")
    env = launcher_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env["TOY_TUNER_LOG"] = str(tmp_path / "asked.txt")
    return env


def _tune(tmp_path: Path, env: dict, autotuning: dict, *flags: str):
    config = write_config(tmp_path / "ds.json", {"max_train_micro_batch_size_per_gpu": 8, "fast": True,
                                                 "tuner_early_stopping": 10, **autotuning})
    return run_launcher("--autotuning", "tune", "--nproc_per_node", "1", *flags, TOY, "--deepspeed", config,
                        cwd=tmp_path, env=env, timeout=240)


def test_a_plugins_tuner_is_chosen_from_the_config_and_drives_the_search(tmp_path, plugin_env, no_orphans):
    result = _tune(tmp_path, plugin_env, {"tuner_type": "largest_first"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    asked = (tmp_path / "asked.txt").read_text().split()
    table = experiments_table(tmp_path / "autotuning_results")
    searched = table[(table.phase == "search") & (table.state != "pruned")]
    micro = {name: int(name.rsplit("mbs", 1)[1]) for name in [*asked, *searched.name]}
    # The plugin was asked, and asked in its own order: the largest micro-batch first.
    assert asked and asked == sorted(asked, key=lambda n: -micro[n])
    # Every search launch but the confirmation of the largest fitting size (the search's own step,
    # before any tuner) is one the plugin asked for.
    largest = max(micro[n] for n in searched.name)
    from_tuner = [n for n in searched.name if micro[n] != largest]
    assert from_tuner and set(from_tuner) <= set(asked)

def test_an_unknown_tuner_type_names_the_plugins_among_the_allowed_values(tmp_path, plugin_env, no_orphans):
    result = _tune(tmp_path, plugin_env, {"tuner_type": "bohb"})
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert "autotuning.tuner_type" in line and '"bohb"' in line and '"largest_first"' in line
    assert not (tmp_path / "autotuning_exps").exists()


def test_a_plugins_backend_runs_the_experiments_with_its_own_flag(tmp_path, plugin_env, no_orphans):
    result = _tune(tmp_path, plugin_env, {}, "--backend", "marking", "--toy_label", "from-the-plugin")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = experiments_table(tmp_path / "autotuning_results")
    launched = table[table.state == "ok"].name
    assert len(launched) >= 2
    for name in launched:
        assert (tmp_path / "autotuning_exps" / name / "backend.txt").read_text() == "from-the-plugin"


def test_a_backends_flag_without_its_backend_is_refused_in_one_line(tmp_path, plugin_env, no_orphans):
    result = _tune(tmp_path, plugin_env, {}, "--toy_label", "x")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "launcher: error: --toy_label: only with --backend marking"
    assert not (tmp_path / "autotuning_exps").exists()


def test_a_plugin_that_fails_to_import_is_named_in_one_line(tmp_path, plugin_env, no_orphans):
    (tmp_path / "site" / "toy_plugin.py").write_text("raise ImportError('needs a library that is not here')\n")
    result = _tune(tmp_path, plugin_env, {})
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert "plugin 'toy'" in line and "toy_plugin:register" in line and "needs a library that is not here" in line


def test_a_plugins_dimension_is_searched_named_written_and_picked_from(tmp_path, plugin_env, no_orphans):
    result = _tune(tmp_path, plugin_env, {"fast": False, "max_train_micro_batch_size_per_gpu": 4})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = experiments_table(tmp_path / "autotuning_results")
    tuned = table[table.name.str.contains("_pdf") & (table.state == "ok")]
    values = {float(name.rsplit("_pdf", 1)[1].split("_")[0]) for name in tuned.name}
    assert values == {1.0, 2.0}, table.name.tolist()  # both of the plugin's values were launched
    for name in tuned.name:
        written = json.loads((tmp_path / "autotuning_exps" / name / "ds_config.json").read_text())
        assert written["gradient_predivide_factor"] == float(name.rsplit("_pdf", 1)[1].split("_")[0])
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    best = table[table.chosen].iloc[0]["name"]
    # The pick's own value; a pick from the search before the knob was tuned keeps the default, 1.0.
    picked = float(best.rsplit("_pdf", 1)[1].split("_")[0]) if "_pdf" in best else 1.0
    assert optimal.get("gradient_predivide_factor", 1.0) == picked
