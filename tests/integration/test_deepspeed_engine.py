"""Scripts that train on DeepSpeed's own engine, tuned unchanged (issue 16).

Needs DeepSpeed (`autotuner[deepspeed]`; CI installs it CPU-only): skipped cleanly without it.
The real-process tests tune on 2 CPU ranks; the DeepSpeed import makes each cold launch a few
seconds, warm ones well under a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import process_checks as faults
from autotuner.app import engines
from autotuner.app.engines import script_engine
from autotuner.core.errors import UsageError
from autotuner.tuning.memory.deepspeed_states import deepspeed_state_bytes
from conftest import ROOT, WORKERS, assert_no_children_left, experiments_table, launcher_env, tune_command

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="needs DeepSpeed: pip install 'autotuner[deepspeed]'")

DS_EXAMPLE = ROOT / "examples" / "deepspeed" / "train.py"
MiB = 2**20


# ----- which engine, before anything starts -----
def test_the_engine_follows_the_scripts_imports_or_the_flag():
    assert script_engine(str(DS_EXAMPLE)).engine == "deepspeed"
    assert script_engine(str(ROOT / "examples" / "minimal" / "train.py")).engine == "autotuner"
    # The toy imports deepspeed by name at run time only: the flag says so.
    assert script_engine(str(WORKERS / "toy_train.py")).engine == "autotuner"
    assert script_engine(str(WORKERS / "toy_train.py"), "deepspeed").engine == "deepspeed"
    # A script importing both behind its own flag: the profile launch's ranks settle it, unless
    # `--engine` does.
    dual = ROOT / "benchmarks" / "workloads" / "dual_engine.py"
    assert not script_engine(str(dual)).settled
    assert script_engine(str(dual), "autotuner") == engines.EngineChoice("autotuner", True, "--engine",
                                                                        "--engine autotuner was given")


def test_a_deepspeed_script_without_deepspeed_installed_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(engines, "deepspeed_installed", lambda: False)
    with pytest.raises(UsageError) as caught:
        script_engine(str(DS_EXAMPLE))
    message = str(caught.value)
    assert caught.value.exit_code == 2 and "\n" not in message
    assert "train.py imports deepspeed (line " in message and "autotuner[deepspeed]" in message
    assert "pass --engine autotuner if it trains on ours" in message


# ----- DeepSpeed's ZeRO memory, as its formulas cost it -----
def states(stage, compute=4, world=4, knobs=None, num_params=10_000_000, **offload):
    return sum(deepspeed_state_bytes(num_params, 8.0, stage, compute, world, knobs or {}, **offload))


def test_each_zero_stage_holds_less_than_the_one_below():
    # A model larger than DeepSpeed's default buckets (5e8 elements); below that, one bucket holds
    # every gradient and stage 3 saves nothing over stage 2, in DeepSpeed as here.
    big = 4_000_000_000
    assert states(0, num_params=big) > states(1, num_params=big) > states(2, num_params=big) > \
        states(3, num_params=big)
    assert states(3) == states(2)


def test_mixed_precision_adds_fp32_master_weights_and_gradients_at_stage_0():
    p = 10_000_000
    # bf16 parameters, gradients and all-reduce buffer plus fp32 master and accumulators (3 x 2 + 2 x 4
    # bytes), against fp32 parameters, gradients and buffer (3 x 4): Adam's states are alike.
    assert states(0, compute=2) - states(0, compute=4) == (3 * 2 + 2 * 4 - 3 * 4) * p


def test_bigger_buckets_and_overlap_cost_memory_and_offload_frees_it():
    small, big = {"reduce_bucket_size": 1_000_000}, {"reduce_bucket_size": 5_000_000}
    assert states(2, knobs=big) > states(2, knobs=small)
    assert states(2, knobs={**small, "overlap_comm": True}) - states(2, knobs=small) == 4 * 1_000_000
    assert states(2, offload_optimizer=True) < states(2)
    assert states(3, offload_optimizer=True, offload_param=True) < states(3, offload_optimizer=True)


def test_full_mode_sweeps_deepspeeds_knobs_and_offload_only_on_cuda():
    from autotuner.config import load_config
    from autotuner.tuning.space.dimensions import full_mode_values

    config = load_config({"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "Adam", "params": {}},
                          "zero_optimization": {"stage": "all", "overlap_comm": False}})
    user = config.to_dict()
    on_cpu, on_cuda = full_mode_values(user, "deepspeed", cuda=False), full_mode_values(user, "deepspeed", cuda=True)
    assert set(on_cpu[3]) == {"reduce_bucket_size", "stage3_prefetch_bucket_size",
                              "stage3_param_persistence_threshold", "stage3_max_live_parameters"}
    assert "overlap_comm" not in on_cpu[2]  # the user's scalar fixes it
    assert "offload_optimizer" not in on_cpu[2] and on_cuda[2]["offload_optimizer"] == ["none", "cpu"]
    assert on_cuda[3]["offload_param"] == ["none", "cpu"] and "offload_param" not in on_cuda[2]
    assert full_mode_values(user)[0] != on_cpu[0]  # our engine keeps its own knobs


# ----- an unchanged DeepSpeed script, tuned and trained on 2 CPU ranks -----
@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("deepspeed_e2e")
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        # Plain data parallel and DeepSpeed's ZeRO optimizer (stages 1-2 share it): 2 engines, not 4.
        "zero_optimization": {"stage": [0, 2]},
        "autotuning": {"enabled": True, "fast": True, "max_train_batch_size": 64,
                       "max_train_micro_batch_size_per_gpu": 32, "exp_timeout_s": 120, "remeasure_rounds": 1},
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    before = shm_buffers()
    command = [sys.executable, "-m", "autotuner", "--autotuning", "run", "--nproc_per_node", "2", str(DS_EXAMPLE),
               "--width", "256", "--depth", "2", "--steps", "12", "--losses_out", str(tmp_path / "losses.json"),
               "--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json")]
    result = subprocess.run(command, cwd=tmp_path, env={**launcher_env(), "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=600)
    assert_no_children_left()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    left = shm_buffers() - before
    yield tmp_path, result, left
    remove_shm_buffers(shm_buffers() - before)


def shm_buffers() -> set[Path]:
    """DeepSpeed's CPU allreduce buffers of this user (66 MiB each, never unlinked by DeepSpeed)."""
    return set(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))


def remove_shm_buffers(paths: set[Path]) -> None:
    for path in paths:  # what DeepSpeed's own training runs in these tests left
        path.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_the_tuners_launches_leave_no_shared_memory_behind(tuned):
    """Every launch on DeepSpeed's CPU engine would leave 66 MiB per rank in /dev/shm (RAM) under a
    new name; the tuner's launches unlink theirs. Only the final training (a plain DeepSpeed run,
    one port) leaves DeepSpeed's usual pair."""
    tmp_path, _, left = tuned
    launches = len(list((tmp_path / "autotuning_exps").iterdir()))
    assert launches >= 4
    ports = {path.name.rsplit("_", 2)[-2] for path in left}
    assert len(left) <= 2 and len(ports) <= 1, sorted(p.name for p in left)


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_deepspeeds_engine_ran_every_experiment_not_ours(tuned):
    tmp_path, result, _ = tuned
    table = experiments_table(tmp_path / "autotuning_results")
    ok = table[table.state == "ok"]
    assert len(ok) >= 4 and set(ok.engine) == {"deepspeed"}
    assert "engine: the script trains on DeepSpeed's own engine" in result.stdout
    assert "Engine: DeepSpeed's own (DeepSpeedEngine) ran" in result.stdout
    for directory in (tmp_path / "autotuning_exps").iterdir():
        # DeepSpeed's own autotuning keys never reach an experiment: no metrics file of its own to go stale.
        assert "autotuning" not in json.loads((directory / "ds_config.json").read_text())
    info = json.loads(next((tmp_path / "autotuning_exps").glob("*/model_info.json")).read_text())
    width = 256
    assert info["engine"] == "deepspeed" and info["backend"] == "gloo" and info["world_size"] == 2
    assert info["num_params"] == 32 * width + width + 2 * (width * width + width) + width + 1
    assert info["activation_bytes"] > 0 and info["optimizer_state_bytes_per_param"] > 0


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_the_records_hold_end_to_end_times_and_every_ranks_resident_peak(tuned):
    tmp_path, _, _ = tuned
    for metrics_file in (tmp_path / "autotuning_exps").glob("*/metrics.json"):
        m = json.loads(metrics_file.read_text())
        assert m["engine"] == "deepspeed" and m["device_type"] == "cpu" and m["world_size"] == 2
        gas = m["gradient_accumulation_steps"]
        # The window is steps 3-5 (the defaults), longer when they take under min_window_s (1 s).
        assert m["forward"]["count"] == m["backward"]["count"] == gas * m["step"]["count"]
        assert m["step"]["count"] >= 3 and m["step"]["count"] == m["end_profile_step"] - m["start_profile_step"] + 1
        # End to end: the whole step, data loading included, is at least its timed parts.
        parts = gas * (m["forward"]["mean_s"] + m["backward"]["mean_s"]) + m["step"]["mean_s"]
        assert m["latency"] >= 0.95 * parts
        assert m["throughput"] == pytest.approx(m["train_batch_size"] / m["latency"])
        assert len(m["peak_memory_bytes_per_rank"]) == 2 and min(m["peak_memory_bytes_per_rank"]) > 100 * MiB
        assert m["peak_memory_bytes"] == max(m["peak_memory_bytes_per_rank"]) and m["peak_reserved_bytes"] is None
    table = experiments_table(tmp_path / "autotuning_results")
    searched = table[(table.phase == "search") & table.predicted_memory_mib.notna()]
    assert len(searched) and (searched.memory_error_pct.abs() < 50).all()


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_the_optimal_config_trains_on_deepspeed_with_both_launchers(tuned):
    tmp_path, result, _ = tuned
    assert "done on deepspeed.runtime.engine.DeepSpeedEngine: 12 steps" in result.stdout  # --autotuning run
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses) == 12 and losses[-1] < losses[0]
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert isinstance(optimal["train_micro_batch_size_per_gpu"], int) and "autotuning" not in optimal
    command = shlex.split((tmp_path / "autotuning_results" / "cmd_optimal_deepspeed.txt").read_text())
    # The thread count the experiments had, and DeepSpeed's launcher beside the measured Python.
    deepspeed_bin = Path(sys.executable).parent / "deepspeed"
    if not deepspeed_bin.exists():
        pytest.skip("DeepSpeed's launcher script is not beside this Python")
    assert command[:6] == ["env", "OMP_NUM_THREADS=1", "LOCAL_SIZE=2",  # the tune ran with OMP_NUM_THREADS=1
                           str(deepspeed_bin), "--num_gpus", "2"], command
    # The suite's PATH as it is (the command names the launcher by its path): with the venv's bin put
    # first, DeepSpeed's ranks JIT-built its CPU shm op with the venv's ninja (1.13) where every other
    # launch finds the system's (1.11); each takes the other's build log for stale and rebuilds the op
    # (~45 s on 2 cores), here and again in the next launch on DeepSpeed's engine.
    env = {**launcher_env(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert_no_children_left()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "done on deepspeed.runtime.engine.DeepSpeedEngine: 12 steps" in done.stdout


# ----- faults on DeepSpeed's path: the toy trains on DeepSpeed with --use_deepspeed -----
DS_FLAGS = ("--engine", "deepspeed")
DS_TOY = ("--use_deepspeed",)


def ds_tune(tmp_path: Path, config: Path, *script_args: str) -> subprocess.CompletedProcess:
    command = tune_command(config, *DS_TOY, *script_args)
    command[3:3] = DS_FLAGS  # after `-m autotuner --autotuning tune`
    return subprocess.run(command, cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=280)


# micro-batch 2 runs (~410 MiB per rank); 3: rank 1 raises; 4: rank 1 is SIGKILLed; 6: 4 x 64 MiB more, over 560 MiB.
DS_BUDGET = 560 * MiB


@pytest.fixture(scope="module")
def faulty_tune(tmp_path_factory):
    """One tune of the toy on DeepSpeed's engine: micro-batch 2 runs, 3 raises on rank 1, 4 SIGKILLs
    rank 1, 6 goes over the memory budget. The toy asks importlib.util.find_spec("deepspeed") before it
    imports it (--check_deepspeed_first), as transformers and accelerate do."""
    tmp_path = tmp_path_factory.mktemp("faulty_tune")
    config = faults.write_config(tmp_path / "ds.json", {"memory_per_rank_bytes": DS_BUDGET,
                                                        "tuner_early_stopping": 50},
                                 train_micro_batch_size_per_gpu=[2, 3, 4, 6])
    result = ds_tune(tmp_path, config, "--fail_rank", "1", "--kill_rank", "1", "--fail_at_step", "2",
                     "--fault_at_micro", "3:fail", "--fault_at_micro", "4:kill", "--mem_per_sample_mb", "64",
                     "--pid_dir", tmp_path / "pids", "--check_deepspeed_first")
    assert_no_children_left()
    return tmp_path, result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_crash_kill_and_oom_are_recorded_on_deepspeeds_engine_and_tuning_goes_on(faulty_tune, no_orphans):
    tmp_path, result = faulty_tune
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = faults.table(tmp_path)
    assert list(rows.state) == ["ok", "failed", "failed", "oom"]
    assert rows.engine.iloc[0] == "deepspeed"
    assert "RuntimeError: injected failure on rank 1" in faults.record(tmp_path, "z0_gas1_mbs3")["error"]
    assert faults.record(tmp_path, "z0_gas1_mbs4")["error"].startswith("rank 1: ")
    assert "budget" in faults.record(tmp_path, "z0_gas1_mbs6")["error"]
    assert "z0_gas1_mbs2 is the optimal setup" in result.stdout
    faults.assert_pids_dead(tmp_path / "pids", expected=2 * (4 + faults.launched_again(tmp_path / faults.EXPS)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hung_experiment_on_deepspeeds_engine_times_out_and_tuning_goes_on(tmp_path, no_orphans):
    # 8 s: a warm launch of the toy on DeepSpeed's engine (micro-batch 2, here) takes about 1 s.
    config = faults.write_config(tmp_path / "ds.json", {"exp_timeout_s": 8}, train_micro_batch_size_per_gpu=[4, 2])
    result = ds_tune(tmp_path, config, "--hang_at_step", "2", "--fault_min_micro", "4", "--pid_dir", tmp_path / "pids")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert faults.record(tmp_path, "z0_gas1_mbs4")["state"] == "timeout"
    assert faults.record(tmp_path, "z0_gas1_mbs2")["state"] == "ok"
    faults.assert_pids_dead(tmp_path / "pids", expected=4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigint_on_deepspeeds_engine_ends_every_rank_and_resume_reuses_the_finished_record(tmp_path, no_orphans):
    config = faults.write_config(tmp_path / "ds.json")
    pids, hung = tmp_path / "pids", tmp_path / "hung"
    args = (*DS_TOY, *faults.HANG_ONCE, "--hang_once_file", hung, "--pid_dir", pids)
    command = tune_command(config, *args)
    command[3:3] = DS_FLAGS
    tuner = subprocess.Popen(command, cwd=tmp_path, env=launcher_env(), stdout=open(tmp_path / "tuner.out", "w"),
                             stderr=open(tmp_path / "tuner.err", "w"), stdin=subprocess.DEVNULL)
    try:
        faults.wait_for(lambda: hung.exists() and len(faults.pids_in(pids)) >= 4, 120, "experiment 2's ranks", tuner)
        launchers = faults.launchers_of(pids)
        os.kill(tuner.pid, signal.SIGINT)
        returncode = tuner.wait(timeout=60)
    finally:
        faults.stop(tuner)
    out, err = faults.output(tmp_path)
    assert returncode == 128 + signal.SIGINT, out[-2000:] + err[-2000:]
    assert "Resume with the same command" in err and "Traceback" not in err
    faults.assert_pids_dead(pids, expected=4)
    faults.assert_processes_ended(launchers)
    assert_no_children_left()
    result = subprocess.run(command, cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "z0_gas1_mbs2: ok (from an earlier run)" in result.stdout
    assert list(faults.table(tmp_path).state) == ["ok", "ok"]
    assert len(faults.pids_in(pids)) == 6


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_script_that_checks_for_deepspeed_before_importing_it_is_measured(faulty_tune, no_orphans):
    """transformers and accelerate ask importlib.util.find_spec("deepspeed") long before they import
    it; the measurement hook must still wrap the engine when the import comes. The faults test's
    tune: its toy checks first."""
    tmp_path, result = faulty_tune
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert faults.record(tmp_path, "z0_gas1_mbs2")["state"] == "ok"
    assert faults.table(tmp_path).engine.iloc[0] == "deepspeed"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_script_checkpointing_through_deepspeed_checkpointing_is_tuned_through_its_flag(tmp_path, no_orphans):
    """Megatron-DeepSpeed's way: the script recomputes its blocks with deepspeed.checkpointing behind
    a flag of its own, mapped to activation_checkpointing.policy. Each experiment passes the policy
    there; DeepSpeed's own keys of the section reach the config the script configures from, ours
    do not; and the pick trains to the same losses as the script without checkpointing."""
    config = {"train_micro_batch_size_per_gpu": [4, 8], "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 0},
              "activation_checkpointing": {"policy": "full", "synchronize_checkpoint_boundary": False},
              "autotuning": {"enabled": True, "arg_mappings": {"activation_checkpointing.policy":
                                                               "--checkpoint_activations"},
                             "tuner_type": "gridsearch", "start_profile_step": 2, "end_profile_step": 3,
                             "remeasure_rounds": 0, "history": False, "exp_timeout_s": 120}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    model = ("--width", "64", "--depth", "3", "--steps", "6")
    env = {**launcher_env(), "OMP_NUM_THREADS": "1"}
    tuned = subprocess.run([sys.executable, "-m", "autotuner", "--autotuning", "run", "--nproc_per_node", "2",
                            str(DS_EXAMPLE), *model, "--losses_out", str(tmp_path / "tuned.json"), "--deepspeed",
                            "--deepspeed_config", str(tmp_path / "ds.json")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert tuned.returncode == 0, tuned.stdout[-3000:] + tuned.stderr[-3000:]
    table = experiments_table(tmp_path / "autotuning_results")
    ran = table[table.state == "ok"]
    assert len(ran) == 2 and (ran.engine == "deepspeed").all()  # a policy set, not tuned: no tag in the names
    for name in ran.name:
        command = shlex.split((tmp_path / "autotuning_exps" / name / "cmd.txt").read_text())
        assert command[command.index("--checkpoint_activations") + 1] == "true"
        written = json.loads((tmp_path / "autotuning_exps" / name / "ds_config.json").read_text())
        assert written["activation_checkpointing"] == {"synchronize_checkpoint_boundary": False}
    best = table[table.chosen].iloc[0]
    plain_config = {key: value for key, value in config.items() if key not in ("autotuning", "activation_checkpointing")}
    plain_config["train_micro_batch_size_per_gpu"] = int(best.micro_batch_size)
    (tmp_path / "plain.json").write_text(json.dumps(plain_config))
    plain = subprocess.run([sys.executable, "-m", "autotuner", "--nproc_per_node", "2", str(DS_EXAMPLE), *model,
                            "--checkpoint_activations", "false", "--losses_out", str(tmp_path / "plain.json.losses"),
                            "--deepspeed", "--deepspeed_config", str(tmp_path / "plain.json")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    checkpointed = json.loads((tmp_path / "tuned.json").read_text())
    assert len(checkpointed) == 6
    assert checkpointed == pytest.approx(json.loads((tmp_path / "plain.json.losses").read_text()), rel=1e-5)
