"""benchmarks/vs_deepspeed.py reads our tuner's outcome; a tune stopped at its time cap writes no
summary, so its launches are read from the experiment records it kept (on an H200, 2026-11-27,
the harness reported a capped tune as "0 launches")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.trials.journal import write_entry
from fakes import fingerprint

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _harness():
    sys.path.insert(0, str(BENCHMARKS))  # its sibling tuning_quality.py
    try:
        spec = importlib.util.spec_from_file_location("vs_deepspeed", BENCHMARKS / "vs_deepspeed.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_a_tune_stopped_at_its_cap_is_read_from_its_experiment_records(tmp_path):
    exps = tmp_path / "autotuning_exps"
    launches = [(Experiment(0, 1), TrialState.OK, 7.9), (Experiment(1, 60), TrialState.OK, 95.2),
                (Experiment(3, 59), TrialState.OK, 94.5), (Experiment(0, 64), TrialState.OOM, None)]
    for experiment, state, value in launches:
        write_entry(exps / experiment.name, TrialResult(experiment, state, value=value), fingerprint())
    harness = _harness()
    outcome = harness.our_outcome(tmp_path, "ours", ["launcher"], None, 130.2, "deepspeed")
    assert (outcome["experiments"], outcome["failed"]) == (4, 1)
    assert outcome["chosen"] == Experiment(1, 60) and outcome["reported_metric"] == 95.2
    assert "best so far stands for its pick" in outcome["problems"][0]
    assert "exit status None" in outcome["problems"]
    # Nothing kept at all: said, and no pick.
    empty = harness.our_outcome(tmp_path / "nothing", "ours", ["launcher"], None, 5.0, "deepspeed")
    assert empty["experiments"] == 0 and empty["chosen"] is None and empty["problems"][0].startswith("no ")


def _gpu_harness():
    # It puts the GPT-2 example's folder on sys.path and imports its train.py and data.py: both are
    # taken back, or a later test in this process sees `data` as an installed module.
    path, modules = list(sys.path), set(sys.modules)
    sys.path.insert(0, str(BENCHMARKS / "gpu"))
    try:
        spec = importlib.util.spec_from_file_location("vs_deepspeed_gpu", BENCHMARKS / "gpu" / "vs_deepspeed_gpu.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
        ours = (str(BENCHMARKS.parent / "benchmarks"), str(BENCHMARKS.parent / "examples"))
        for name in set(sys.modules) - modules:
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(ours):
                del sys.modules[name]
    return module


def test_the_experiment_deepspeeds_run_was_in_at_its_cap_is_named_so_a_resumed_call_runs_it_again(tmp_path):
    """DeepSpeed's autotuner reads an experiment folder with a stderr.log as finished: the one its
    cap cut must go before a resumed call (--resume), and only that one."""
    harness = _gpu_harness()
    results = tmp_path / "autotuning_results"
    log = ("[INFO] [scheduler.py:381:run_experiment] Launching exp_id = 0, exp_name = profile_model_info, with x\n"
           "[INFO] [scheduler.py:381:run_experiment] Launching exp_id = 1, exp_name = z0_gas1_tmbspg1, with x\n")
    (tmp_path / "deepspeed_tune.stdout.log").write_text(log)
    for name, result in (("profile_model_info", "model_info.json"), ("z0_gas1_tmbspg1", None)):
        (results / name).mkdir(parents=True)
        (results / name / "stderr.log").write_text("")
        if result:
            (results / name / result).write_text("{}")
    assert harness.experiment_running_at_cap(tmp_path) == "z0_gas1_tmbspg1"
    (results / "z0_gas1_tmbspg1" / "metrics.json").write_text("{}")  # it had finished: nothing is cut
    assert harness.experiment_running_at_cap(tmp_path) is None


def test_both_tuners_get_the_same_stage_list_and_ours_reads_it():
    """`--stages 1` narrows both tuners alike (DeepSpeed's autotuner reads a list, not "all"), and
    our config validates the list DeepSpeed's reads."""
    from types import SimpleNamespace

    from autotuner.config import load_config

    harness = _gpu_harness()
    args = SimpleNamespace(stages=(1,), precision="bf16", max_micro=64)
    configs = {tuner: harness.user_config(tuner, args, Path("/work")) for tuner in ("deepspeed", "predictive")}
    assert configs["deepspeed"]["zero_optimization"] == configs["predictive"]["zero_optimization"] == {"stage": [1]}
    assert load_config(configs["predictive"]).zero_optimization.stages == (1,)
