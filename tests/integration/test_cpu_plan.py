"""`--autotuning plan --hardware` held against real launches on the hardware at hand (issue 80,
part 3): a spec of this CPU measured by `python -m autotuner.app.host_spec`, the GPT-2 example
planned on a fake world of 2 and of 4 ranks (ZeRO 0-3), and the same layouts launched for real
by tunes. One constant is fitted, on one launch (the compute efficiency, on 2 ranks' ZeRO 0);
every other figure is predicted. Goals: per-rank peak memory within 10%, step time within 25%.

The step time is held only where each rank has a core of its own (on a 2-core machine, the 2-rank
launches): 4 ranks sharing 2 cores are timed by how the scheduler interleaves them, which moves
with the machine (on one 2-core machine 4 ranks' FSDP2 stages were within 3-14%, on another 1.8-2.1
times the prediction). Memory is held at every world size.

Tensor parallelism is not in it: HF's GPT-2 builds its blocks from Conv1D, which the
tensor-parallel plan refuses in the plan and in a launch alike."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from tabulate import tabulate

from conftest import ROOT, launcher_env, run_launcher, write_json

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SCRIPT = ROOT / "examples" / "hf_gpt2" / "train.py"
MEMORY_GOAL, STEP_GOAL = 0.10, 0.25
FITTED_ON = (2, "z0_gas4_mbs4")


def _config(stages: list[int]) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "steps_per_print": 1000,
            "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stages},
            "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 8, "remeasure_rounds": 0,
                           "arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                                            "gradient_accumulation_steps": "--gradient_accumulation_steps"}}}


def _args(out: Path) -> tuple[str, ...]:
    # one data cache for every run: the plan's census then reads the tokens the launches built
    return ("--model_size", "tiny", "--max_steps", "50", "--corpus_mb", "0.5", "--output_dir", str(out))


def _launched(tmp_path: Path, ranks: int, stages: list[int]) -> pd.DataFrame:
    where = tmp_path / f"tune_{ranks}_{'_'.join(map(str, stages))}"
    where.mkdir()
    done = run_launcher("--autotuning", "tune", "--nproc_per_node", str(ranks), SCRIPT, *_args(tmp_path / "out"),
                        "--deepspeed", write_json(where / "ds.json", _config(stages)), cwd=where, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    table = pd.read_csv(where / "autotuning_results" / "experiments.csv")
    table = table[table["state"] == "ok"]
    assert set(table["zero_stage"]) == set(stages), table[["name", "state"]]
    return table.assign(ranks=ranks)


def _plan(tmp_path: Path, ranks: int, spec: dict) -> tuple[pd.DataFrame, str]:
    where = tmp_path / f"plan_{ranks}"
    where.mkdir()
    done = run_launcher("--autotuning", "plan", "--hardware", write_json(where / "spec.json", spec),
                        "--nproc_per_node", str(ranks), SCRIPT, *_args(tmp_path / "out"), "--deepspeed",
                        write_json(where / "ds.json", _config([0, 1, 2, 3])), cwd=where, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return pd.read_csv(where / "autotuning_results" / "plan.csv").assign(ranks=ranks), done.stdout


def test_the_gpt2_examples_cpu_plan_predicts_its_launches_at_2_and_4_ranks(tmp_path, no_orphans):
    measured_spec = tmp_path / "cpu.json"
    described = subprocess.run([sys.executable, "-m", "autotuner.app.host_spec", "--out", str(measured_spec)],
                               env=launcher_env(), capture_output=True, text=True, timeout=120)
    assert described.returncode == 0, described.stderr[-3000:]
    spec = pd.read_json(measured_spec, typ="series").to_dict()
    assert spec["device"] == "cpu" and spec["overlap_communication"] is False

    launches = pd.concat([_launched(tmp_path, ranks, stages) for ranks in (2, 4) for stages in ([0, 1], [2, 3])])
    fitted = launches[(launches["ranks"] == FITTED_ON[0]) & (launches["name"] == FITTED_ON[1])]
    step_s = float(fitted["latency_s"].iloc[0])
    two, said = _plan(tmp_path, 2, {**spec, "calibrate": {"layout": FITTED_ON[1], "step_s": step_s}})
    efficiency = float(two["compute_efficiency"].iloc[0])
    assert f"compute efficiency {efficiency:.4g} (fitted on {FITTED_ON[1]}'s {step_s:.4g} s a step)" in said
    assert 0 < efficiency <= 1
    four, said = _plan(tmp_path, 4, {**spec, "compute_efficiency": efficiency})  # stated: predicted, not fitted
    assert f"compute efficiency {efficiency:.4g} (stated)" in said
    plans = pd.concat([two, four]).set_index(["ranks", "name"])

    rows = []
    for launch in launches.itertuples():
        planned = plans.loc[(launch.ranks, launch.name)]
        step_error = planned["predicted_step_s"] / launch.latency_s - 1
        # A profile launch holds its probes' memory too; a search launch is the run as planned.
        memory_error = (planned["predicted_memory_bytes"] / 2**20 / launch.measured_memory_mib - 1
                        if launch.phase != "profile" else float("nan"))
        rows.append({"ranks": launch.ranks, "layout": launch.name, "phase": launch.phase,
                     "step s": launch.latency_s, "predicted s": planned["predicted_step_s"],
                     "step error": step_error, "memory MiB": launch.measured_memory_mib,
                     "predicted MiB": planned["predicted_memory_bytes"] / 2**20, "memory error": memory_error})
    table = pd.DataFrame(rows)
    shown = tabulate(table, headers="keys", tablefmt="pipe", showindex=False, floatfmt=".3g")
    print(f"\ncompute efficiency {efficiency:.4g}, fitted on {FITTED_ON[1]} at {FITTED_ON[0]} ranks\n{shown}")
    assert set(table["ranks"]) == {2, 4} and len(table) >= 8, shown
    timed = table[table["ranks"] <= spec["accelerators_per_node"]]  # the spec's cores: a rank a core
    assert len(timed) >= 4 and (timed["step error"].abs() <= STEP_GOAL).all(), shown
    memory = table["memory error"].dropna()
    assert len(memory) >= 4 and (memory.abs() <= MEMORY_GOAL).all(), shown
