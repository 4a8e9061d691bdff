"""examples/hf_gpt2 end to end: `launcher --autotuning tune` on the tiny preset, 2 CPU ranks,
with the shipped ds_config.json, then the optimal command it wrote trains."""

from __future__ import annotations

import json
import shlex
import subprocess

import pandas as pd
import pytest

from autotuner.tuning.trials.evaluator import DISTURBED_TAG
from autotuner.config import read_config_file
from conftest import ROOT, experiments_table, launcher_env, run_launcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
EXAMPLE = ROOT / "examples" / "hf_gpt2"
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def test_tune_the_gpt2_example_then_train_with_the_optimal_command(tmp_path, no_orphans):
    # The shipped config, narrowed to keep the launches few: stages 0 and 3, a smaller global batch.
    config = read_config_file(EXAMPLE / "ds_config.json")
    config["zero_optimization"]["stage"] = [0, 3]
    config["autotuning"].update(max_train_batch_size=16, max_train_micro_batch_size_per_gpu=8,
                                num_tuning_micro_batch_sizes=2, start_profile_step=2, end_profile_step=4)
    ds_path = tmp_path / "ds_config.json"
    ds_path.write_text(json.dumps(config))
    args = ("--model_size", "tiny", "--max_steps", "6", "--seq_len", "64", "--corpus_mb", "0.5",
            "--output_dir", str(tmp_path / "out"))

    # First the plan: the profile launches alone, then every candidate costed by the models they fitted.
    planned = run_launcher("--autotuning", "plan", "--nproc_per_node", "2", EXAMPLE / "train.py", *args,
                           "--deepspeed", ds_path, cwd=tmp_path, timeout=300)
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    plan = pd.read_csv(results / "plan.csv")
    assert {"name", "zero_stage", "tp", "pp", "micro_batch_size", "gradient_accumulation_steps",
            "activation_checkpointing", "fits", "predicted_memory_bytes", "predicted_step_s",
            "predicted_samples_per_s"} <= set(plan.columns)
    assert set(plan.zero_stage) == {0, 3} and set(plan.tp) == {1} and set(plan.pp) == {1}
    assert (plan.predicted_memory_bytes > 0).all() and (plan.predicted_step_s > 0).all()
    # samples/s of the whole job: the global batch (micro-batch x gas x 2 ranks) over the step.
    global_batch = plan.micro_batch_size * plan.gradient_accumulation_steps * 2
    assert ((global_batch / plan.predicted_step_s / plan.predicted_samples_per_s - 1).abs() < 1e-3).all()
    assert plan.candidate.any() and plan[plan.candidate].fits.all() and plan.picked.sum() == 1
    picked = plan[plan.picked].iloc[0]
    assert f"plan: predicted pick {picked['name']} (*)" in planned.stdout
    # (a launch another process disturbed is kept beside its repeat as <name>_disturbed: one experiment)
    profiled = sorted(p.name for p in (tmp_path / "autotuning_exps").iterdir()
                      if p.is_dir() and not p.name.endswith(DISTURBED_TAG))
    assert len(profiled) >= 2 and not (results / "ds_config_optimal.json").exists()  # the profile only

    tuned = run_launcher("--autotuning", "tune", "--nproc_per_node", "2", EXAMPLE / "train.py", *args,
                         "--deepspeed", ds_path, cwd=tmp_path, timeout=540)
    assert tuned.returncode == 0, tuned.stdout[-3000:] + tuned.stderr[-3000:]
    # The tune reused the plan's profile launches, and its first search launch was predicted as the plan said.
    assert tuned.stdout.count("(from an earlier run)") >= len(profiled), tuned.stdout[-3000:]
    first = experiments_table(results)
    first = first[first.phase == "search"].iloc[0]
    row = plan[plan.name == first["name"]].iloc[0]
    assert row.candidate and abs(row.predicted_memory_bytes / 2**20 - first.predicted_memory_mib) < 0.1
    assert abs(row.predicted_metric / first.predicted_metric - 1) < 1e-3, (row, first)
    for name in ("summary.txt", "experiments.csv", "ds_config_optimal.json", "cmd_optimal.txt"):
        assert (results / name).exists(), name
    assert "Tuning completed in" in tuned.stdout

    table = experiments_table(results)
    ok = table[table.state == "ok"]
    assert len(ok[ok.phase != "remeasure"]) >= 2, table.to_string()
    # The measurements are real: positive throughput and a measured peak per experiment.
    assert (ok.throughput_samples_s > 0).all() and (ok.measured_memory_mib > 0).all()
    # The profile read the sequence length (the workload signature's) from the model's input_ids.
    infos = [json.loads(path.read_text()) for path in (tmp_path / "autotuning_exps").glob("*/model_info.json")]
    assert infos and {info["sequence_length"] for info in infos} == {64}
    # The pick is the marked row: the best single run, or the best median once re-measured.
    best = table[table.chosen].iloc[0]
    assert table.chosen.sum() == 1
    optimal = read_config_file(results / "ds_config_optimal.json")
    assert "autotuning" not in optimal
    assert optimal["train_micro_batch_size_per_gpu"] == best.micro_batch_size
    assert optimal["gradient_accumulation_steps"] == best.gradient_accumulation_steps
    assert optimal["zero_optimization"]["stage"] == best.zero_stage

    # The command the user is told to paste: run_clm-style flags carry the optimum.
    command = shlex.split((results / "cmd_optimal.txt").read_text())
    flag = command.index("--per_device_train_batch_size")
    assert command[flag + 1] == str(best.micro_batch_size)
    trained = subprocess.run(command, cwd=tmp_path, env=launcher_env(), capture_output=True, text=True,
                             timeout=240)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    assert f"ZeRO {best.zero_stage}, micro-batch {best.micro_batch_size}" in trained.stdout
    assert "saved checkpoint to" in trained.stdout
    assert (tmp_path / "out" / "checkpoints" / "global_step6").is_dir()


def test_n_embd_sets_the_width_and_a_width_the_heads_do_not_divide_is_refused(tmp_path):
    """`--n_embd` (benchmarks/transfer.py's BLOCKSxWIDTH models) builds that width."""
    import sys

    refused = subprocess.run([sys.executable, str(EXAMPLE / "train.py"), "--n_embd", "130", "--deepspeed", "x.json"],
                             cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "--n_embd 130: must be a positive multiple of tiny's 4 heads" in refused.stderr
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); from train import build_model; "
             "model = build_model('tiny', 64, 512, 2, 256); "
             "print(model.config.n_embd, model.transformer.h[0].mlp.c_fc.weight.shape[0])")
    built = subprocess.run([sys.executable, "-c", probe, str(EXAMPLE)], cwd=tmp_path, env=launcher_env(),
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    assert built.stdout.split() == ["256", "256"]
