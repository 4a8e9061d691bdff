"""DeepSpeed's autotuning tutorial as written (issue 29, section 3): Hugging Face's own run_clm.py,
byte for byte from ../shared/clients, tuned and trained under our launcher on DeepSpeed's engine,
2 CPU ranks, with the tutorial's config and with Hugging Face's documented "auto" config. Also an
`accelerate launch`-style script (Accelerator + DeepSpeedPlugin), served by the same hooks.

The model is a tiny GPT-2 and a word-level BPE tokenizer made here; nothing is downloaded
(HF_HUB_OFFLINE, HF_DATASETS_OFFLINE; no --do_eval, which would fetch `evaluate`'s metric).
Skipped without the shared script, transformers, accelerate, datasets, evaluate, tokenizers or
DeepSpeed.

On a CPU-only machine accelerate alone sees no distributed backend under DeepSpeed (each rank's
Trainer would think it is rank 0 of 1); the ranks our launcher starts give it the launch's gloo
world (launch/accelerate_launch.py), so the Trainer shards the data over both ranks as on GPUs.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from autotuner.app import engines
from autotuner.app.engines import deepspeed_cpu_runs_fp16, script_engine
from autotuner.core.errors import UsageError
from conftest import WORKERS, experiments_table
from hf_configs import (HF_AUTO, MAPPINGS, MISSING, RUN_CLM, TEST_SIZED, hf_env, run_clm_args,
                        write_tiny_gpt2)

ACCELERATE_SCRIPT = WORKERS / "accelerate_train.py"
pytestmark = [
    pytest.mark.skipif(not RUN_CLM.is_file(), reason=f"needs Hugging Face's run_clm.py at {RUN_CLM}"),
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: pip install 'autotuner[hf,deepspeed]'"),
]
# The tutorial's ds_config.json, verbatim (its trailing space in "gradient_accumulation_steps " too).
TUTORIAL = {"train_micro_batch_size_per_gpu": "auto", "fp16": {"enabled": True},
            "autotuning": {"enabled": True, "arg_mappings": {
                "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                "gradient_accumulation_steps ": "--gradient_accumulation_steps"}}}


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> Path:
    return write_tiny_gpt2(tmp_path_factory.mktemp("tiny_gpt2"))


def launcher(mode: str, tmp_path: Path, script_args: list[str], config: dict) -> subprocess.CompletedProcess:
    (tmp_path / "ds.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "autotuner", "--autotuning", mode, "--nproc_per_node", "2", *script_args,
               "--deepspeed", str(tmp_path / "ds.json")]
    return subprocess.run(command, cwd=tmp_path, env=hf_env(tmp_path), capture_output=True, text=True, timeout=400)


# Micro-batches 1 and 2 only (a profile launch and one searched): these tests are not about the
# search beyond them (micro-batch 4 was one more launch, ~4 s, in each tune). Not the compile
# test's: its compiled launch at a micro-batch inductor has not cached costs ~40 s more.
SIZED = {**TEST_SIZED, "max_train_micro_batch_size_per_gpu": 2}


def with_test_sizes(config: dict) -> dict:
    return {**config, "autotuning": {**config["autotuning"], **SIZED}}


def shm_buffers() -> set[Path]:
    return set(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))


@pytest.fixture
def shm_before(no_orphans):
    """DeepSpeed's CPU allreduce buffers before the test; those it adds are removed afterwards."""
    before = shm_buffers()
    yield before
    for path in shm_buffers() - before:
        path.unlink(missing_ok=True)


def assert_only_the_trainings_buffers_left(before: set[Path]) -> None:
    """The tuner's launches unlink DeepSpeed's 66 MiB-per-rank buffers; a plain DeepSpeed training
    (the final one) leaves its pair, under one port, as DeepSpeed always does on CPU."""
    left = shm_buffers() - before
    ports = {path.name.rsplit("_", 2)[-2] for path in left}
    assert len(left) <= 2 and len(ports) <= 1, sorted(path.name for path in left)


def assert_every_experiment_measured_on_deepspeed(tmp_path: Path) -> pd.DataFrame:
    """Every launch ran on DeepSpeed's engine, and its throughput counts DeepSpeed's global batch
    (micro x gas x 2 ranks), whatever world size the Trainer believed in."""
    table = experiments_table(tmp_path / "autotuning_results")
    assert len(table) >= 2 and (table.state == "ok").all() and (table.engine == "deepspeed").all(), table.to_string()
    for name in table.name:
        directory = tmp_path / "autotuning_exps" / name
        metrics = json.loads((directory / "metrics.json").read_text())
        global_batch = metrics["micro_batch_size"] * metrics["gradient_accumulation_steps"] * 2
        assert metrics["world_size"] == 2 and metrics["train_batch_size"] == global_batch, metrics
        assert metrics["throughput"] == pytest.approx(global_batch / metrics["latency"], rel=1e-6)
        assert "train_batch_size" not in json.loads((directory / "ds_config.json").read_text())
    return table


def assert_results_written(tmp_path: Path, result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    for name in ("summary.txt", "experiments.csv", "ds_config_optimal.json", "cmd_optimal.txt"):
        assert (results / name).is_file(), name
    assert "Tuning completed in" in result.stdout
    return json.loads((results / "ds_config_optimal.json").read_text())


def assert_trained(result: subprocess.CompletedProcess, out: Path) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "autotuner: training with the optimal config" in result.stdout
    assert json.loads((out / "train_results.json").read_text())["train_loss"] > 0
    assert (out / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tutorials_config_tunes_then_trains_run_clm_on_deepspeeds_engine(tiny_gpt2, tmp_path, shm_before):
    """The tutorial's ds_config.json and flags, --fp16 included, where this CPU has fp16 kernels
    (DeepSpeed 0.19's CPU engine runs fp16 with its loss scaler there). Elsewhere DeepSpeed's
    engine refuses fp16 in every rank, so the launcher refuses it first, in one line, and the
    tutorial runs in fp32 as that line says."""
    args = run_clm_args(tiny_gpt2, tmp_path / "out", "--fp16")
    tutorial, precision = TUTORIAL, "fp16"
    if not deepspeed_cpu_runs_fp16():
        refused = launcher("tune", tmp_path, args, with_test_sizes(TUTORIAL))
        errors = [line for line in refused.stderr.splitlines() if line.startswith("launcher: error:")]
        assert refused.returncode == 2 and len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert "fp16.enabled: true, but DeepSpeed's engine refuses fp16 on this CPU" in errors[0]
        assert "drop the script's --fp16 to train in fp32" in errors[0]
        args = run_clm_args(tiny_gpt2, tmp_path / "out")
        tutorial, precision = {**TUTORIAL, "fp16": {"enabled": False}}, "fp32"
    tuned = launcher("tune", tmp_path, args, with_test_sizes(tutorial))
    optimal = assert_results_written(tmp_path, tuned)
    table = assert_every_experiment_measured_on_deepspeed(tmp_path)
    assert set(table.zero_stage) == {0}  # the tutorial's config names no stage: DeepSpeed's default, 0
    metrics = json.loads((tmp_path / "autotuning_exps" / table.name[0] / "metrics.json").read_text())
    assert metrics["precision"] == precision
    assert optimal["fp16"] == {"enabled": precision == "fp16"} and "train_batch_size" not in optimal
    command = shlex.split((tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text())
    best = table[table.chosen].iloc[0]
    assert command[command.index("--per_device_train_batch_size") + 1] == str(best.micro_batch_size)
    assert not (tmp_path / "out" / "train_results.json").exists()  # tune trains nothing
    assert shm_buffers() <= shm_before  # the experiments unlinked DeepSpeed's buffers

    trained = launcher("run", tmp_path, args, with_test_sizes(tutorial))  # reuses the tuned records
    assert f"{best['name']}: ok (from an earlier run)" in trained.stdout
    assert_trained(trained, tmp_path / "out")
    assert_only_the_trainings_buffers_left(shm_before)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hugging_faces_auto_config_tunes_and_trains_with_the_autos_passed_through(tiny_gpt2, tmp_path, shm_before):
    result = launcher("run", tmp_path, run_clm_args(tiny_gpt2, tmp_path / "out"), with_test_sizes(HF_AUTO))
    assert "left \"auto\" for Hugging Face's Trainer (or accelerate) to fill in" in result.stdout
    optimal = assert_results_written(tmp_path, result)
    table = assert_every_experiment_measured_on_deepspeed(tmp_path)
    assert set(table.zero_stage) == {2}
    # Unchanged in every experiment's config and in the optimum: the Trainer filled them in.
    experiment = json.loads((tmp_path / "autotuning_exps" / table.name[0] / "ds_config.json").read_text())
    for config in (experiment, optimal):
        assert config["gradient_clipping"] == "auto" and config["optimizer"]["params"]["lr"] == "auto"
        assert config["fp16"]["enabled"] == "auto" and config["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert "train_batch_size" not in optimal
    assert_trained(result, tmp_path / "out")
    assert_only_the_trainings_buffers_left(shm_before)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_accelerate_deepspeed_plugin_script_is_tuned_and_trained_on_deepspeeds_engine(tmp_path, shm_before):
    assert script_engine(str(ACCELERATE_SCRIPT)).engine == "deepspeed"
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 1},
              "autotuning": {"enabled": True, "arg_mappings": MAPPINGS, **SIZED}}
    result = launcher("run", tmp_path, [str(ACCELERATE_SCRIPT)], config)
    assert_results_written(tmp_path, result)
    assert_every_experiment_measured_on_deepspeed(tmp_path)
    assert "autotuner: training with the optimal config" in result.stdout
    assert "trained 6 steps" in result.stdout + result.stderr
    assert_only_the_trainings_buffers_left(shm_before)


def test_run_clm_is_tuned_on_deepspeeds_engine_and_refused_in_one_line_without_deepspeed(monkeypatch):
    assert script_engine(str(RUN_CLM)).engine == "deepspeed"
    monkeypatch.setattr(engines, "deepspeed_installed", lambda: False)
    with pytest.raises(UsageError) as caught:
        script_engine(str(RUN_CLM))
    message = str(caught.value)
    assert caught.value.exit_code == 2 and "\n" not in message
    assert "imports transformers.Trainer (line " in message
    assert "), which trains on DeepSpeed's engine with --deepspeed" in message
    assert "autotuner[deepspeed]" in message and "import autotuner as deepspeed" not in message


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpointing_and_compile_are_tuned_on_deepspeeds_engine_through_the_trainers_own_flags(
        tiny_gpt2, tmp_path, shm_before):
    """activation_checkpointing.policy and compile.enabled mapped to the Trainer's
    --gradient_checkpointing and --torch_compile (accelerate then calls engine.compile()): each
    experiment passes its values there, and no config DeepSpeed reads carries our keys."""
    mappings = {**MAPPINGS, "activation_checkpointing.policy": "--gradient_checkpointing",
                "compile.enabled": "--torch_compile"}
    config = {"train_micro_batch_size_per_gpu": "auto", "activation_checkpointing": {"policy": ["none", "full"]},
              "compile": {"enabled": "auto"},
              "autotuning": {"enabled": True, "arg_mappings": mappings, **TEST_SIZED, "exp_timeout_s": 300,
                             "start_profile_step": 2, "end_profile_step": 3}}  # compiling falls in step 1
    result = launcher("tune", tmp_path, run_clm_args(tiny_gpt2, tmp_path / "out"), config)
    optimal = assert_results_written(tmp_path, result)
    assert "not tuned" not in result.stdout
    assert "(with activation checkpointing: full" in result.stdout  # the profile measured each policy
    assert "the script's --max_steps" in result.stdout  # 6 planned steps: compiling must pay back in them
    table = experiments_table(tmp_path / "autotuning_results")
    assert table.name.str.contains("_acfull_").any()  # searched (launched, or pruned with its reason)
    ran = table[table.state == "ok"]
    assert (ran.engine == "deepspeed").all() and len(ran) >= 2
    compiled = ran[ran.name.str.contains("_cT_")]
    assert len(compiled) >= 1, table.to_string()
    for row in ran.itertuples():
        directory = tmp_path / "autotuning_exps" / row.name
        command = shlex.split((directory / "cmd.txt").read_text())
        flags = (command[command.index("--gradient_checkpointing") + 1], command[command.index("--torch_compile") + 1])
        assert flags == ("true" if "_acfull_" in row.name else "false", "true" if "_cT_" in row.name else "false")
        written = json.loads((directory / "ds_config.json").read_text())
        assert "activation_checkpointing" not in written and "compile" not in written
    assert "activation_checkpointing" not in optimal and "compile" not in optimal
    best = table[table.chosen].iloc[0]
    command = shlex.split((tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text())
    assert command[command.index("--torch_compile") + 1] == ("true" if "_cT_" in best["name"] else "false")
    assert any(line.startswith("compile: ") for line in result.stdout.splitlines())  # the summary's line
