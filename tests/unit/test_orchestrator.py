"""The orchestrator's rules with a fake runner and no processes: profile, resume (fingerprinted),
the first-failure rule, memory calibration and the progress lines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autotuner.tuning.trials.evaluator import TuningFailed
from autotuner.tuning.trials.journal import fingerprint_of, load_journal, unmapped_args, write_entry
from autotuner.tuning.space.records import Reason, TrialResult, TrialState
from autotuner.tuning.space.experiment import Experiment
from fakes import BookOverLedger, FakeRunner, ParallelFakeRunner, by_micro, fingerprint, model_info, never_called, ok, profiled, tuner

MiB = 2**20


def test_the_profile_and_the_search_go_through_the_runner_and_are_journaled(tmp_path):
    runner = FakeRunner(by_micro({2: 10.0, 4: 20.0}))
    outcome = tuner(tmp_path, runner).tune()
    # The profile launch is the smallest size's experiment (the second profile size, about half
    # the largest that fits, is no larger here), and counts as its measurement.
    assert runner.names == ["z0_gas1_mbs2", "z0_gas1_mbs4"]
    assert [t.profile for t in runner.trials] == [True, False]
    assert outcome.best.name == "z0_gas1_mbs4" and outcome.best.value == 20.0
    for name in runner.names:
        entry = json.loads((tmp_path / "exps" / name / "exp.json").read_text())
        assert entry["version"] == 3 and entry["fingerprint"]["script_args"] == ["--width", "256"]


@pytest.mark.parametrize("tuner_type", ["gridsearch", "predictive"])
def test_what_the_searchs_tuners_were_told_is_in_the_runs_ledger(tmp_path, tuner_type):
    runner = FakeRunner(by_micro({2: 10.0, 4: 20.0, 8: 40.0, 16: 30.0}))
    autotuner = tuner(tmp_path, runner, autotuning={"model_info": {"num_params": 1000}, "tuner_type": tuner_type},
                      train_micro_batch_size_per_gpu=[2, 4, 8, 16])
    autotuner.tune()
    told = {name for trials in autotuner.ledger.tuner_trials()
            for name in [*(r.name for r in trials.told.values()), *(r.name for r in trials.observed.values())]}
    assert told == set(runner.names)  # the profile's launches included
    assert all(not trials.running for trials in autotuner.ledger.tuner_trials())


def test_a_runner_with_slots_gets_the_search_in_parallel_and_results_out_of_order_are_journaled(tmp_path):
    values = {2: 10.0, 4: 20.0, 8: 40.0, 16: 30.0}
    runner = ParallelFakeRunner(by_micro(values), capacity=2)
    outcome = tuner(tmp_path, runner, autotuning={"model_info": {"num_params": 1000}},
                    train_micro_batch_size_per_gpu=[2, 4, 8, 16]).tune()
    assert runner.most_at_once == 2
    assert runner.finished_order != runner.names  # results came back out of the order submitted
    assert sorted(runner.names) == sorted(f"z0_gas1_mbs{m}" for m in values)
    assert outcome.best.name == "z0_gas1_mbs8" and outcome.best.value == 40.0
    for name in runner.names:  # every result journaled under its own experiment, whatever the order
        entry = json.loads((tmp_path / "exps" / name / "exp.json").read_text())
        assert entry["result"]["experiment"]["micro_batch_size"] == int(name.rsplit("mbs", 1)[1])
    # A resumed run reuses them all and launches nothing.
    resumed = tuner(tmp_path, ParallelFakeRunner(never_called, capacity=2), autotuning={
        "model_info": {"num_params": 1000}}, train_micro_batch_size_per_gpu=[2, 4, 8, 16]).tune()
    assert resumed.best.name == "z0_gas1_mbs8"


def test_the_predictive_tuner_fills_a_runners_slots_with_its_most_optimistic_candidates(tmp_path):
    values = {2: 10.0, 4: 20.0, 8: 40.0, 16: 30.0}
    runner = ParallelFakeRunner(by_micro(values), capacity=2)
    autotuning = {"model_info": {"num_params": 1000}, "tuner_type": "predictive"}
    outcome = tuner(tmp_path, runner, autotuning=autotuning, train_micro_batch_size_per_gpu=[2, 4, 8, 16]).tune()
    assert runner.most_at_once == 2 and runner.finished_order != runner.names
    assert outcome.best.name == "z0_gas1_mbs8" and outcome.best.value == 40.0
    resumed = tuner(tmp_path, ParallelFakeRunner(never_called, capacity=2), autotuning=autotuning,
                    train_micro_batch_size_per_gpu=[2, 4, 8, 16]).tune()
    assert resumed.best.name == "z0_gas1_mbs8"


def test_a_resumed_run_of_the_same_workload_launches_nothing(tmp_path):
    tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0}))).tune()
    lines: list[str] = []
    outcome = tuner(tmp_path, FakeRunner(never_called), print_to=lines).tune()
    assert outcome.best.name == "z0_gas1_mbs4"
    assert sum("(from an earlier run)" in line for line in lines) == 2
    assert not any("different run" in line for line in lines)


@pytest.mark.parametrize("change, reason", [
    ({"script_args": ("--width", "1024")}, "script arguments changed"),
    ({"config_sha256": "c" * 64}, "config changed"),
    ({"script_sha256": "d" * 64}, "script changed"),
    ({"device": "cuda NVIDIA H100 x1"}, "device changed"),
])
def test_records_of_a_different_run_are_set_aside_and_the_run_tunes_afresh(tmp_path, change, reason):
    tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0}))).tune()
    lines: list[str] = []
    runner = FakeRunner(by_micro({2: 30.0, 4: 5.0}))
    outcome = tuner(tmp_path, runner, print_to=lines, print_fingerprint=fingerprint(**change)).tune()
    assert len(runner.trials) == 2  # the profile too: nothing reused
    assert outcome.best.name == "z0_gas1_mbs2" and outcome.best.value == 30.0
    notice = [line for line in lines if "different run" in line]
    assert len(notice) == 1 and notice[0].startswith(f"2 earlier records are from a different run ({reason}): "
                                                     "not reused; kept in ")
    kept = list((tmp_path / "exps" / "earlier").glob("*/z0_gas1_mbs4/exp.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["result"]["value"] == 20.0


def test_an_older_format_record_is_set_aside_not_reused(tmp_path):
    old = tmp_path / "exps" / "z0_gas1_mbs4"
    old.mkdir(parents=True)
    (old / "exp.json").write_text(json.dumps(TrialResult(Experiment(0, 4), TrialState.OK, value=99.0).to_json()))
    journal = load_journal(tmp_path / "exps", fingerprint())
    assert journal.reusable == {} and journal.set_aside == 1 and "unknown format" in journal.notice
    assert not old.exists()


def test_with_a_global_batch_the_first_profile_size_is_the_smallest_with_at_most_8_accumulation_steps(tmp_path):
    # Global batch 128 on 2 ranks: micro-batch 1 would run 64 forward/backward passes per step.
    runner = FakeRunner(profiled(lambda trial: ok(trial, 10.0, 200 * MiB)))
    lines = []
    tuner(tmp_path, runner, {"max_train_batch_size": 128, "max_train_micro_batch_size_per_gpu": 64},
          print_to=lines, train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto").tune()
    assert runner.trials[0].profile and runner.names[0] == "z0_gas8_mbs8"
    assert lines[0] == "profile: ZeRO 0, micro-batch 8 ..."


def test_a_first_profile_size_out_of_memory_everywhere_falls_back_to_the_smallest(tmp_path):
    def answer(trial):
        if trial.experiment.micro_batch_size >= 8:
            return TrialResult(trial.experiment, TrialState.OOM, error="out of memory on rank 0")
        return ok(trial, 10.0, 200 * MiB)
    runner = FakeRunner(profiled(answer))
    lines = []
    outcome = tuner(tmp_path, runner, {"max_train_batch_size": 128, "max_train_micro_batch_size_per_gpu": 64},
                    print_to=lines, train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
                    zero_optimization={"stage": [0, 3]}).tune()
    assert runner.names[:3] == ["z0_gas8_mbs8", "z3_gas8_mbs8", "z0_gas64_mbs1"]
    assert "profile: micro-batch 8 ran out of memory at every stage; trying micro-batch 1" in lines
    assert outcome.best is not None and outcome.best.experiment.micro_batch_size < 8
    assert all(r.state is TrialState.OOM for r in outcome.results if r.experiment.micro_batch_size >= 8)


def test_the_first_launch_failing_without_a_profile_stops_the_run(tmp_path):
    failed = lambda trial: TrialResult(trial.experiment, TrialState.FAILED, error="rank 0: ValueError: bad flag")
    runner = FakeRunner(failed)
    with pytest.raises(TuningFailed, match="the first experiment z0_gas1_mbs2 failed: rank 0: ValueError"):
        tuner(tmp_path, runner, {"model_info": {"num_params": 1000}}).tune()
    assert len(runner.trials) == 1


def test_a_first_oom_without_a_profile_is_not_fatal(tmp_path):
    def answer(trial):
        if trial.experiment.micro_batch_size == 2:
            return TrialResult(trial.experiment, TrialState.OOM, error="out of memory on rank 0")
        return ok(trial, 10.0, 100 * MiB)
    outcome = tuner(tmp_path, FakeRunner(answer), {"model_info": {"num_params": 1000}}).tune()
    assert outcome.best.name == "z0_gas1_mbs4"


def test_a_profile_that_fails_names_its_directory(tmp_path):
    failed = lambda trial: TrialResult(trial.experiment, TrialState.FAILED, error="rank 1: KeyError: 'x'")
    with pytest.raises(TuningFailed, match=r"profile launch \(failed\): rank 1: KeyError: 'x'; see .*z0_gas1_mbs2"):
        tuner(tmp_path, FakeRunner(failed)).tune()


def test_the_memory_model_is_refitted_on_measured_peaks_and_predicts_later_launches(tmp_path):
    """Peaks grow 8 MiB per sample where autograd saw 1 MiB: the two profile launches (sizes far
    apart) fit the line, and every later launch is predicted from it."""
    lines: list[str] = []
    measured = lambda micro: 500 * MiB + 8 * MiB * micro  # noqa: E731
    runner = FakeRunner(profiled(lambda trial: ok(trial, 10.0, measured(trial.experiment.micro_batch_size))))
    tuner(tmp_path, runner, print_to=lines, train_micro_batch_size_per_gpu=[1, 2, 4, 8]).tune()
    assert [t.profile for t in runner.trials[:2]] == [True, True]
    assert [t.experiment.micro_batch_size for t in runner.trials[:2]] == [1, 4]  # about half of 8
    later = runner.trials[2:]
    assert later and all(t.predicted_memory_bytes == measured(t.experiment.micro_batch_size) for t in later)
    assert any(line.startswith("memory model: DDP fitted on 2 measured peak(s)") and "(fitted)" in line
               for line in lines)


def test_no_micro_batch_as_large_as_one_that_ran_out_of_memory_fits_at_that_stage(tmp_path):
    """One line is fitted to DDP's peaks at ZeRO 0 and 1; ZeRO 1's two peaks under the budget pull
    it below ZeRO 0's OOM at 4, so the line alone would launch ZeRO 0 at 8. The OOM decides, for 4
    and above at ZeRO 0; smaller sizes and other stages keep the line's verdict."""
    autotuner = tuner(tmp_path, FakeRunner(never_called), {"model_info": {"num_params": 1000},
                                                           "memory_per_rank_bytes": 750 * MiB},
                      train_micro_batch_size_per_gpu=[2, 4, 8, 16], zero_optimization={"stage": "all"})
    profiled = autotuner.profile_phase(0).run()  # model_info given: no launch
    book = BookOverLedger(profiled.memory)
    space, memory = profiled.job.space, book.memory
    book.learn(TrialResult(space.experiment(0, 4), TrialState.OOM, error="peak 795 MiB over the budget",
                           measured_memory_bytes=795 * MiB))
    for micro in (4, 8):
        book.learn(TrialResult(space.experiment(1, micro), TrialState.OK, value=1.0, measured_memory_bytes=600 * MiB))
    line = memory.predicted_memory(space.experiment(0, 8))
    assert line < 0.9 * 750 * MiB  # the fitted line says it fits...
    assert not memory.fits(space.experiment(0, 8)) and not memory.fits(space.experiment(0, 4))  # ...the OOM says no
    assert memory.fits(space.experiment(0, 2)) and memory.fits(space.experiment(1, 8))


def test_progress_lines_name_the_result_and_the_best_so_far(tmp_path):
    lines: list[str] = []
    tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0})), print_to=lines).tune()
    progress = [line for line in lines if line.startswith("[")]
    assert progress[0].startswith("[1] z0_gas1_mbs2: ok: 10 samples/s | best z0_gas1_mbs2 10 | elapsed ")
    assert progress[1].startswith("[2] z0_gas1_mbs4: ok: 20 samples/s | best z0_gas1_mbs4 20 | elapsed ")


def test_failed_launches_are_journaled_and_not_relaunched_on_resume(tmp_path):
    def answer(trial):
        if trial.experiment.micro_batch_size == 4:
            return TrialResult(trial.experiment, TrialState.FAILED, error="rank 0: exit status 137 (killed by SIGKILL)")
        return ok(trial, 20.0, 100 * MiB)
    tuner(tmp_path, FakeRunner(profiled(answer))).tune()
    outcome = tuner(tmp_path, FakeRunner(never_called)).tune()
    assert {r.name: r.state for r in outcome.results} == {"z0_gas1_mbs2": TrialState.OK,
                                                           "z0_gas1_mbs4": TrialState.FAILED}


# ----- the fingerprint itself -----

def _fingerprint(script: Path, args: tuple[str, ...], config: dict, **changes):
    values = dict(script=str(script), script_args=args, mapped_flags=("--micro_batch_size",), base_config=config,
                  nproc_per_node=2, num_nodes=1, launcher_args=(), torch_version="2.13.0", device="cpu")
    return fingerprint_of(**{**values, **changes})


def test_the_fingerprint_ignores_mapped_flags_the_config_path_and_the_autotuning_section(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    a = _fingerprint(script, ("--micro_batch_size", "4", "--width", "256", "--deepspeed", "a.json"),
                     {"steps_per_print": 1, "autotuning": {"fast": True}})
    b = _fingerprint(script, ("--width", "256", "--micro_batch_size=8", "--deepspeed=b.json"),
                     {"steps_per_print": 1, "autotuning": {"fast": False}})
    assert a == b and a.script_args == ("--width", "256")


def test_the_fingerprint_keeps_the_argument_after_a_bare_mapped_bool_flag(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    flags = dict(mapped_flags=("--gradient_checkpointing",), bool_flags=frozenset({"--gradient_checkpointing"}))
    a = _fingerprint(script, ("--gradient_checkpointing", "a.txt"), {}, **flags)
    b = _fingerprint(script, ("--gradient_checkpointing", "b.txt"), {}, **flags)
    assert a.script_args == ("a.txt",) and a.differences(b) == ["script arguments changed"]
    assert _fingerprint(script, ("--gradient_checkpointing", "true", "a.txt"), {}, **flags) == a


def test_the_fingerprint_sees_each_change_the_issue_names(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    base = _fingerprint(script, ("--width", "256"), {"steps_per_print": 1})
    assert base.differences(_fingerprint(script, ("--width", "1024"), {"steps_per_print": 1})) == \
        ["script arguments changed"]
    assert base.differences(_fingerprint(script, ("--width", "256"), {"steps_per_print": 2})) == ["config changed"]
    assert base.differences(_fingerprint(script, ("--width", "256"), {"steps_per_print": 1}, nproc_per_node=4)) == \
        ["ranks per node changed"]
    assert base.differences(_fingerprint(script, ("--width", "256"), {"steps_per_print": 1},
                                         torch_version="2.14.0")) == ["torch version changed"]
    script.write_text("print('changed')\n")
    assert base.differences(_fingerprint(script, ("--width", "256"), {"steps_per_print": 1})) == ["script changed"]


def test_unmapped_args_removes_both_forms_and_keeps_the_rest():
    assert unmapped_args(("--a", "1", "--b=2", "--c", "--d", "x"), ("--a", "--b", "--c")) == ("--d", "x")


def test_only_finished_results_of_the_same_run_are_reusable(tmp_path):
    directory = tmp_path / "exps" / "z0_gas1_mbs2"
    directory.mkdir(parents=True)
    write_entry(directory, TrialResult(Experiment(0, 2), TrialState.PRUNED, error="x"), fingerprint())
    assert load_journal(tmp_path / "exps", fingerprint()).reusable == {}


def test_a_resumed_run_scores_journaled_results_under_its_own_metric_and_budget(tmp_path):
    # The metric and the budget live in the autotuning section, outside the fingerprint: a value
    # journaled as throughput must not be compared as a latency, nor a peak over a new budget pass.
    tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0}))).tune()
    latency = tuner(tmp_path, FakeRunner(never_called), autotuning={"metric": "latency"}).tune()
    assert latency.best.name == "z0_gas1_mbs4" and latency.best.value == pytest.approx(1 / 20.0)
    assert {r.name: r.value for r in latency.results} == pytest.approx({"z0_gas1_mbs2": 0.1, "z0_gas1_mbs4": 0.05})
    tight = tuner(tmp_path, FakeRunner(never_called), autotuning={"memory_per_rank_bytes": 100 * MiB})
    with pytest.raises(TuningFailed):
        tight.tune()


# ----- what a resumed run must not reuse (a review of 2026-11-27) -----

def test_the_fingerprint_sees_keys_only_deepspeeds_engine_reads_the_window_and_the_ranks_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    base = _fingerprint(script, (), {"steps_per_print": 1}, user_config={"zero_optimization": {"stage": 2}},
                        measured_as="steps 3-5", environ={"OMP_NUM_THREADS": "1", "HOME": "/a"})
    # Dropped from the settled config, but sent to DeepSpeed's engine as written.
    assert base.differences(_fingerprint(
        script, (), {"steps_per_print": 1}, user_config={"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}},
        measured_as="steps 3-5", environ={"OMP_NUM_THREADS": "1", "HOME": "/a"})) == ["config changed"]
    assert base.differences(_fingerprint(
        script, (), {"steps_per_print": 1}, user_config={"zero_optimization": {"stage": 2}},
        measured_as="steps 10-50", environ={"OMP_NUM_THREADS": "1", "HOME": "/a"})) == \
        ["profile window or readings changed"]
    assert base.differences(_fingerprint(
        script, (), {"steps_per_print": 1}, user_config={"zero_optimization": {"stage": 2}},
        measured_as="steps 3-5", environ={"OMP_NUM_THREADS": "4", "HOME": "/a"})) == \
        ["environment variables of the ranks changed"]
    # A variable no rank's measurement depends on does not set the records aside.
    assert base == _fingerprint(script, (), {"steps_per_print": 1}, user_config={"zero_optimization": {"stage": 2}},
                                measured_as="steps 3-5", environ={"OMP_NUM_THREADS": "1", "HOME": "/b"})
    from autotuner.tuning.trials.journal import Fingerprint

    assert Fingerprint.from_json(json.loads(json.dumps(base.to_json()))) == base  # as the journal keeps it


def test_what_a_launch_measures_beside_its_config_is_in_the_fingerprint():
    from autotuner.app.settle import measured_as
    from autotuner.config import load_config
    from autotuner.tuning.space.records import Objective
    from fakes import experiment_settings

    settings = experiment_settings(load_config({"train_micro_batch_size_per_gpu": 2}))
    described = measured_as(settings)
    for changed in ({"start_profile_step": 10}, {"end_profile_step": 50}, {"min_window_s": 2.0},
                    {"max_steps_per_window": 8}, {"timeout_s": 3600.0}, {"objective": Objective("goodput")},
                    {"arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}}):
        assert measured_as(replace(settings, **changed)) != described, changed
    assert measured_as(replace(settings, objective=Objective("latency"))) == described  # rescored, not relaunched


def test_a_result_that_lacked_the_earlier_metric_is_judged_again_not_failed_forever(tmp_path):
    # metric flops where the run reported no FLOPs: every result failed "metrics.json has no ...";
    # back on throughput, the profile's measurement is scored and only the rest is launched.
    measured = by_micro({2: 10.0, 4: 20.0})  # the profile launch's result holds the model, as judge() gives it

    def no_flops(trial):
        return replace(measured(trial), state=TrialState.FAILED, value=None,
                       error="metrics.json has no 'FLOPS_per_gpu'", reason=Reason.MISSING_METRIC)

    with pytest.raises(TuningFailed):
        tuner(tmp_path, FakeRunner(no_flops), autotuning={"metric": "flops"}).tune()
    runner = FakeRunner(measured)
    outcome = tuner(tmp_path, runner).tune()
    assert runner.names == ["z0_gas1_mbs4"]  # the profile's measurement is scored, not launched again
    assert {r.name: r.value for r in outcome.results} == {"z0_gas1_mbs2": 10.0, "z0_gas1_mbs4": 20.0}


def test_an_earlier_record_is_reused_only_for_the_experiment_it_measured(tmp_path):
    from autotuner.tuning.trials.ledger import TrialLedger

    class Store:
        def earlier(self):
            return {"z0_gas1_mbs2": TrialResult(Experiment(0, 4), TrialState.OK, value=1.0)}

    ledger = TrialLedger((Store(),))
    ledger.resume()
    assert ledger.known(Experiment(0, 2)) is None


def test_knob_values_that_round_alike_get_names_of_their_own():
    a = Experiment(0, 2).with_knobs({"reduce_bucket_size": 100_000_000})
    b = Experiment(0, 2).with_knobs({"reduce_bucket_size": 104_857_600})
    assert a.name != b.name
    assert a.name == "z0_rbs1.0e08_gas1_mbs2"  # round values keep their short names


def test_the_fingerprint_sees_the_scripts_own_modules_beside_it(tmp_path):
    from autotuner.core.script_imports import own_modules

    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom model import Net\n")
    (tmp_path / "model.py").write_text("import layers\nclass Net: width = 256\n")
    (tmp_path / "layers.py").write_text("DEPTH = 2\n")
    (tmp_path / "unrelated.py").write_text("X = 1\n")
    assert [p.name for p in own_modules(str(script))] == ["model.py", "layers.py"]
    before = _fingerprint(script, (), {}, own_modules=tuple(own_modules(str(script))))
    (tmp_path / "unrelated.py").write_text("X = 2\n")
    assert _fingerprint(script, (), {}, own_modules=tuple(own_modules(str(script)))) == before
    (tmp_path / "layers.py").write_text("DEPTH = 4\n")
    assert before.differences(_fingerprint(script, (), {}, own_modules=tuple(own_modules(str(script))))) == \
        ["script changed"]
