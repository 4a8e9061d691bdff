"""The engine and the tuner on CUDA (nccl, one GPU). Skipped where there is no CUDA device, as in CI.

Run on a lent GPU by benchmarks/gpu/run_all.sh; the README's GPU section has the results."""

import json

import pytest
import torch

from conftest import CONFIGS, MINIMAL, ROOT, WORKERS, experiments_table, run_engine_check, run_launcher
from autotuner.config import read_config_file

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT_WORKLOADS = ROOT / "benchmarks" / "workloads"

# bf16 keeps 8 bits of mantissa: over 5 steps of this small net the loss stays within 5% of fp32.
BF16_RTOL = 5e-2


def run_check(check: str, tmp_path) -> dict:
    return run_engine_check(check, tmp_path, 1)


def test_every_stage_gives_stage0_losses_on_cuda(tmp_path):
    losses = run_check("parity", tmp_path)["losses"]
    assert len(losses["0"]) == 5
    for stage in ("1", "2", "3"):
        assert losses[stage] == pytest.approx(losses["0"], abs=1e-5), f"stage {stage}"


def test_bf16_trains_under_every_stage_within_tolerance_of_fp32(tmp_path):
    fp32 = run_check("parity", tmp_path)["losses"]["0"]
    losses = run_check("bf16", tmp_path)["losses"]
    for stage, values in losses.items():
        assert values == pytest.approx(fp32, rel=BF16_RTOL), f"stage {stage}: bf16 {values} against fp32 {fp32}"
        print(f"stage {stage}: bf16 max relative difference from fp32 "
              f"{max(abs(a - b) / abs(b) for a, b in zip(values, fp32)):.4f}")


def test_checkpoint_round_trip_on_cuda(tmp_path):
    result = run_check("checkpoint", tmp_path)
    for stage in ("0", "1", "2", "3"):
        outcome = result[stage]
        assert outcome["resumed"] == pytest.approx(outcome["continued"], abs=1e-6), f"stage {stage}"
        assert outcome["client_state"] == {"note": "three steps"} and outcome["global_steps"] == 5
        assert outcome["lr"] == pytest.approx(outcome["lr_continued"])


def test_cpu_offload_at_stage_2_and_3_gives_the_same_losses(tmp_path):
    result = run_check("offload", tmp_path)
    losses, devices = result["losses"], result["parameter_devices"]
    for stage in ("2", "3"):
        assert losses[f"{stage}_offload"] == pytest.approx(losses[stage], abs=1e-5), f"stage {stage}"
        assert devices[stage] == "cuda" and devices[f"{stage}_offload"] == "cpu"


def test_metrics_on_cuda_report_allocator_peak(tmp_path):
    metric_path = tmp_path / "metrics.json"
    config = read_config_file(CONFIGS / "zero3.json")
    config["autotuning"] = {"enabled": True, "start_profile_step": 3, "end_profile_step": 6,
                            "metric_path": str(metric_path)}
    config_file = tmp_path / "ds.json"
    config_file.write_text(json.dumps(config))
    result = run_launcher("--nproc_per_node", "1", MINIMAL, "--deepspeed", config_file, "--steps", "50")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(metric_path.read_text())
    assert metrics["device_type"] == "cuda" and metrics["world_size"] == 1
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0 < metrics["peak_memory_bytes"] <= metrics["peak_reserved_bytes"] < total
    assert metrics["FLOPS_per_gpu"] > 0
    print("GPU peak memory (bytes): allocated", metrics["peak_memory_bytes"], "reserved", metrics["peak_reserved_bytes"])


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="checks a machine with exactly one GPU")
def test_more_ranks_than_gpus_is_refused_before_launch(tmp_path):
    result = run_launcher("--nproc_per_node", "2", MINIMAL, "--deepspeed", CONFIGS / "zero0.json")
    assert result.returncode == 2
    assert "--nproc_per_node: got 2, but only 1 GPU(s) are visible" in result.stderr


def test_a_real_cuda_oom_is_recorded_and_the_search_backs_off(tmp_path, no_orphans):
    """No memory model help (model_info given, activations unknown): micro-batch 32 asks for 4/3 of
    the GPU and fails in the CUDA allocator; the tuner records OOM and bisects down to a size that runs."""
    total_mib = torch.cuda.get_device_properties(0).total_memory / 2**20
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 0},
        "autotuning": {
            "enabled": True, "fast": True, "start_profile_step": 2, "end_profile_step": 4,
            "max_train_micro_batch_size_per_gpu": 32, "model_info": {"num_params": 1153},
            "results_dir": str(tmp_path / "results"), "exps_dir": str(tmp_path / "exps"),
            "arg_mappings": {"train_micro_batch_size_per_gpu": "--micro_batch_size"},
        },
    }
    config_file = tmp_path / "ds.json"
    config_file.write_text(json.dumps(config))
    result = run_launcher("--autotuning", "tune", "--nproc_per_node", "1", WORKERS / "toy_train.py",
                          "--mem_per_sample_mb", f"{total_mib / 24:.0f}", "--steps", "5",
                          "--deepspeed", config_file, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = experiments_table(tmp_path / "results")
    first = table.iloc[0]
    assert (first["name"], first["state"]) == ("z0_gas1_mbs32", "oom")
    stderr = (tmp_path / "exps" / "z0_gas1_mbs32" / "stderr.log").read_text()
    assert "CUDA out of memory" in stderr or "OutOfMemoryError" in stderr
    ok = table[table.state == "ok"]
    assert len(ok) and ok.micro_batch_size.max() < 32
    assert ok.micro_batch_size.max() >= 16  # 16 x total/24 fits: the bisection found at least that


# ----- issue 12: a DeepSpeedExamples-style script and the deepspeed launcher's flags, on CUDA -----
DS_STYLE = WORKERS / "ds_style_train.py"


def ds_style_config(tmp_path, stage: int, **extra):
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, **extra}
    path = tmp_path / f"ds_{stage}_{len(extra)}.json"
    path.write_text(json.dumps(config))
    return path


def test_deepspeed_style_script_on_cuda_at_every_stage(tmp_path):
    seen = {}
    for stage in (0, 1, 2, 3):
        out = tmp_path / f"seen{stage}.json"
        result = run_launcher("--nproc_per_node", "1", DS_STYLE, "--steps", "6", "--out", out,
                              "--deepspeed", ds_style_config(tmp_path, stage))
        assert result.returncode == 0, result.stderr[-3000:]
        seen[stage] = json.loads(out.read_text())
    for stage, run in seen.items():
        assert run["device_name"] == "cuda" and run["device_count"] == torch.cuda.device_count()
        assert run["stage"] == stage and run["local_rank_arg"] == 0 and run["module_is_model"]
        assert run["max_memory_allocated"] >= run["memory_allocated"] > 0
        assert run["losses"] == pytest.approx(seen[0]["losses"], abs=1e-5), f"stage {stage}"
    print("ds-style losses on CUDA:", [round(v, 4) for v in seen[0]["losses"]])


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_overflow_skips_the_step_and_the_schedule_on_cuda(tmp_path, stage):
    """A loss scale of 2**24 overflows fp16 gradients at first: those steps are skipped
    (was_step_applied False), the scale backs off, later steps apply, the schedule counts only those."""
    out = tmp_path / "seen.json"
    config = ds_style_config(tmp_path, stage, fp16={"enabled": True, "initial_scale_power": 24})
    result = run_launcher("--nproc_per_node", "1", DS_STYLE, "--steps", "20", "--out", out, "--deepspeed", config)
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads(out.read_text())
    applied = run["step_applied"]
    assert run["fp16"] and applied[0] is False and any(applied), applied
    assert len(run["losses"]) == sum(applied)
    assert run["lr"] == [pytest.approx(1e-2 * 0.5 ** (sum(applied) // 2))]
    print(f"stage {stage}: {applied.count(False)} of {len(applied)} fp16 steps skipped for overflow")


def test_stage1_offload_on_cuda_is_refused_in_one_line(tmp_path):
    config = ds_style_config(tmp_path, 1, zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}})
    result = run_launcher("--nproc_per_node", "1", DS_STYLE, "--steps", "2", "--deepspeed", config)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "use stage 2" in lines[0], result.stderr


def test_include_and_exclude_pick_the_gpus(tmp_path):
    script = tmp_path / "visible.py"
    script.write_text("import os, torch\nprint('visible', os.environ.get('CUDA_VISIBLE_DEVICES'), "
                      "torch.cuda.device_count(), flush=True)\n")
    result = run_launcher("--include", "localhost:0", "--no_local_rank", script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "visible 0 1" in result.stdout
    result = run_launcher("--exclude", "localhost:" + ",".join(map(str, range(torch.cuda.device_count()))), script)
    assert result.returncode == 2 and "every slot is excluded" in result.stderr


# ----- issue 13: warm launches on CUDA -----

def _cuda_processes() -> set[int]:
    import subprocess

    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=60).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def test_warm_ranks_initialise_cuda_themselves_and_the_forkserver_never_does(tmp_path):
    from multiprocessing import forkserver

    from autotuner.config import load_config
    from autotuner.tuning.space.config_space import base_config
    from autotuner.tuning.trials.trial import ExperimentSettings, Trial
    from autotuner.tuning.space.records import Objective, TrialState
    from autotuner.tuning.space.experiment import Experiment
    from autotuner.execution.warm import WarmRunner

    config = load_config({"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {}}})
    settings = ExperimentSettings(script=str(MINIMAL), script_args=("--deepspeed", "unused.json"),
                                  base_config=base_config(config), nproc_per_node=1, data_parallel_size=1,
                                  objective=Objective("throughput"), timeout_s=300,
                                  arg_mappings={"train_micro_batch_size_per_gpu": "--micro_batch_size"})
    lines = []
    runner = WarmRunner(str(MINIMAL), report=lines.append)
    try:
        for stage in (0, 3):
            result = runner.run(Trial(Experiment(stage, 8), tmp_path / f"z{stage}", settings))
            assert result.state is TrialState.OK, (result.error, lines)
            assert result.measurement.device_type == "cuda" and result.measurement.peak_memory_bytes > 0
            assert (tmp_path / f"z{stage}" / "warm_ranks.txt").exists()
        server = forkserver._forkserver._forkserver_pid
        assert server is not None and server not in _cuda_processes()
        assert not any("warm start off" in line for line in lines), lines
        print("\n".join(lines))
    finally:
        runner.close()


def test_warm_and_cold_tuning_on_cuda_agree(tmp_path):
    picks = {}
    for warm in (True, False):
        work = tmp_path / ("warm" if warm else "cold")
        work.mkdir()
        config = read_config_file(str(CONFIGS / "autotune_minimal.json"))
        config["autotuning"].update(warm_start=warm, max_train_micro_batch_size_per_gpu=32)
        (work / "ds.json").write_text(json.dumps(config))
        result = run_launcher("--autotuning", "tune", "--nproc_per_node", "1", MINIMAL, "--deepspeed",
                              work / "ds.json", cwd=work, timeout=500)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert ("warm start off" in result.stdout) is (not warm)
        table = experiments_table(work / "autotuning_results")
        picks[warm] = table
        print(f"warm={warm}:\n{table[['name', 'state', 'metric_value', 'wall_time_s']].to_string()}")
    # The profile and the memory model's verdicts follow from the config and measured memory, so they
    # must agree. Which candidate the search launches next follows measured throughput, which differs
    # between any two runs (an H200 run chose z1_gas32_mbs8 warm, z0_gas32_mbs8 cold), so that part is
    # compared on its outcome: every launch ran, warm as cold.
    for phase_or_state in ("profile", "pruned"):
        column = "phase" if phase_or_state == "profile" else "state"
        agreed = {warm: set(table[table[column] == phase_or_state].name) for warm, table in picks.items()}
        assert agreed[True] == agreed[False], phase_or_state
    for table in picks.values():
        assert set(table[table.state != "pruned"].state) == {"ok"}


def test_a_preload_that_initialises_cuda_falls_back_to_cold_launches(tmp_path):
    config = read_config_file(str(CONFIGS / "autotune_minimal.json"))
    config["autotuning"].update(warm_preload=["cuda_at_import"], max_train_micro_batch_size_per_gpu=16,
                                model_info={"num_params": 1000})
    config["zero_optimization"] = {"stage": 0}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    import os

    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKERS), env_path]))
    try:
        result = run_launcher("--autotuning", "tune", "--nproc_per_node", "1", MINIMAL, "--deepspeed",
                              tmp_path / "ds.json", cwd=tmp_path, timeout=400)
    finally:
        os.environ["PYTHONPATH"] = env_path
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "warm start off: importing the script's modules initialised CUDA in the forkserver" in result.stdout


@pytest.mark.parametrize("stage, knobs", [
    (0, {"bucket_cap_mb": 4, "gradient_as_bucket_view": True}),
    (2, {"forward_prefetch": 2, "backward_prefetch": 2, "reshard_after_backward": False}),
], ids=["ddp", "fsdp2"])
def test_fixed_communication_knobs_apply_on_cuda(tmp_path, stage, knobs):
    """Knobs fed back from an online run (autotuning.online.knobs) are in effect on CUDA, read back
    from the wrapper: DDP is wrapped again with its device, FSDP2's prefetch lists are set."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                  "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
                                  "zero_optimization": {"stage": stage},
                                  "autotuning": {"online": {"knobs": knobs}}}))
    out = tmp_path / "timings.json"
    result = run_launcher("--nproc_per_node", "1", ROOT_WORKLOADS / "wide_mlp.py", "--steps", "12", "--skip", "2",
                          "--layers", "8", "--timings_out", out, "--deepspeed", config, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    figure = json.loads(out.read_text())
    print(f"stage {stage}: {figure}")
    assert {name: figure["knobs"][name] for name in knobs} == knobs
    assert figure["samples_per_s"] > 0


def test_auto_offload_is_searched_beside_the_sharded_stages_on_cuda(tmp_path, no_orphans):
    """zero_optimization.offload_optimizer.device "auto": FSDP2's CPUOffloadPolicy is a variant of
    ZeRO 2 and 3, launched or ruled out with its reason; nothing launched runs out of memory, and
    the pick's device is written into the optimal config."""
    config = {
        "train_micro_batch_size_per_gpu": [4, 8], "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": [2, 3], "offload_optimizer": {"device": "auto"}},
        "autotuning": {"enabled": True, "fast": True, "start_profile_step": 2, "end_profile_step": 4,
                       "remeasure_rounds": 0, "results_dir": str(tmp_path / "results"),
                       "exps_dir": str(tmp_path / "exps"),
                       "arg_mappings": {"train_micro_batch_size_per_gpu": "--micro_batch_size"}},
    }
    config_file = tmp_path / "ds.json"
    config_file.write_text(json.dumps(config))
    result = run_launcher("--autotuning", "tune", "--nproc_per_node", "1", WORKERS / "toy_train.py",
                          "--blocks", "4", "--width", "512", "--steps", "6", "--deepspeed", config_file, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "not tuned" not in result.stdout
    table = experiments_table(tmp_path / "results")
    offloaded = table[table.name.str.contains("_oocpu_")]
    assert len(offloaded), table.to_string()
    assert not (table.state == "oom").any()
    for row in offloaded.itertuples():
        assert row.state == "ok" or (row.state == "pruned" and row.error), table.to_string()
    optimal = read_config_file(tmp_path / "results" / "ds_config_optimal.json")
    best = table[table.chosen].iloc[0]
    assert optimal["zero_optimization"]["offload_optimizer"]["device"] == ("cpu" if "_oocpu_" in best["name"] else "none")
