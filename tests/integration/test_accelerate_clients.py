"""accelerate's way to train with DeepSpeed (issue 77, section 2): Hugging Face's
run_clm_no_trainer.py, unchanged from ../shared/clients, takes no --deepspeed flag; our launcher
plays `accelerate launch`'s part (launch/accelerate_launch.py): --deepspeed's file reaches the
ranks through accelerate's variables, no --local_rank, and on CPU accelerate's state counts the
launch's ranks. 2 CPU ranks, a tiny GPT-2 made here, nothing downloaded.

The client names `DistributedType.TPU`, which accelerate 1.x calls XLA (its own bug, under any
launcher): the old name is put back by a sitecustomize on the ranks' PYTHONPATH, never in the client.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, experiments_table
from hf_configs import MISSING, hf_env, write_tiny_gpt2

CLIENT = ROOT.parent / "shared" / "clients" / "hf_run_clm_no_trainer" / "run_clm_no_trainer.py"
pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(600),
    pytest.mark.skipif(not CLIENT.is_file(), reason=f"needs Hugging Face's run_clm_no_trainer.py at {CLIENT}"),
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: pip install 'autotuner[hf,deepspeed]'"),
]
TPU_NAME_BACK = """\
import accelerate.utils.dataclasses as _dataclasses
if not hasattr(_dataclasses.DistributedType, "TPU"):
    type.__setattr__(_dataclasses.DistributedType, "TPU", _dataclasses.DistributedType.XLA)
"""
MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
            "gradient_accumulation_steps": "--gradient_accumulation_steps"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = write_tiny_gpt2(tmp_path_factory.mktemp("clm_no_trainer"))
    lines = (root / "train.txt").read_text().splitlines()
    (root / "valid.txt").write_text("\n".join(lines[:60]) + "\n")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(TPU_NAME_BACK)
    return root


def client_args(tiny: Path, out: Path, micro: int = 2, gas: int = 1) -> list[str]:
    return [str(CLIENT), "--model_name_or_path", str(tiny / "model"), "--train_file", str(tiny / "train.txt"),
            "--validation_file", str(tiny / "valid.txt"), "--per_device_train_batch_size", str(micro),
            "--per_device_eval_batch_size", "2", "--gradient_accumulation_steps", str(gas), "--block_size", "32",
            "--num_train_epochs", "1", "--max_train_steps", "4", "--learning_rate", "1e-3", "--seed", "0",
            "--output_dir", str(out)]


def launch(tiny: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**hf_env(cwd), "PYTHONPATH": str(tiny / "site")}
    return subprocess.run([sys.executable, "-m", "autotuner", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=500)


@pytest.fixture(scope="module")
def plain(tiny, tmp_path_factory):
    """One plain launch per ZeRO stage: {stage: (output dir, the launch)}."""
    runs = {}
    for stage in (0, 2, 3):
        cwd = tmp_path_factory.mktemp(f"z{stage}")
        config = cwd / "ds.json"
        config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                      "zero_optimization": {"stage": stage}}))
        done = launch(tiny, cwd, "--nproc_per_node", "2", *client_args(tiny, cwd / "out"), "--deepspeed", str(config))
        assert done.returncode == 0, done.stderr[-4000:]
        runs[stage] = (cwd / "out", done)
    return runs


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_plain_launch_trains_through_the_evaluation_and_saves_a_model_that_loads(plain, stage):
    from transformers import AutoModelForCausalLM

    out, done = plain[stage]
    results = json.loads((out / "all_results.json").read_text())  # the client writes the perplexity alone
    assert math.isfinite(results["perplexity"]) and results["perplexity"] > 1
    # accelerate counted both ranks: the global batch is micro-batch 2 x 2 ranks, and the
    # evaluation's gather over them went through (it died on CPU with a world of 1).
    assert "Total train batch size (w. parallel, distributed & accumulation) = 4" in done.stdout + done.stderr
    assert "launcher: note: engine:" in done.stderr and "accelerate's DeepSpeed plugin trains it on DeepSpeed's" \
        in done.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0
    # Every stage trains the same model on the same batches: ZeRO 2 to the same evaluation as ZeRO 0;
    # ZeRO 3 builds the model under DeepSpeed's zero.Init (transformers' from_pretrained at stage 3),
    # whose random draws differ (GPT-2's dropout), so only close.
    reference = json.loads((plain[0][0] / "all_results.json").read_text())["perplexity"]
    assert results["perplexity"] == pytest.approx(reference, rel=1e-6 if stage < 3 else 5e-2)


def test_a_tune_with_only_the_batch_mapped_measures_what_accelerate_built_and_trains_the_pick(tiny, tmp_path,
                                                                                              no_orphans):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": [1, 2], "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": [0, 2]},
        "autotuning": {"enabled": True, "tuner_type": "gridsearch", "start_profile_step": 1, "end_profile_step": 2,
                       "remeasure_rounds": 0, "exp_timeout_s": 120, "min_window_s": 0, "history": False,
                       "arg_mappings": MAPPINGS}}))
    done = launch(tiny, tmp_path, "--autotuning", "run", "--nproc_per_node", "2", *client_args(tiny, tmp_path / "out"),
                  "--deepspeed", str(config))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "engine: the script trains on DeepSpeed's own engine (DeepSpeedEngine)" in done.stdout
    assert "taken to train on our engine" not in done.stdout + done.stderr
    table = experiments_table(tmp_path / "autotuning_results")
    assert set(table.state) == {"ok"} and set(table.engine) == {"deepspeed"}
    assert set(table.zero_stage) == {0, 2} and set(table.micro_batch_size) == {1, 2}
    for row in table.itertuples():  # what accelerate's plugin built is what each experiment is recorded under
        metrics = json.loads((tmp_path / "autotuning_exps" / row.name / "metrics.json").read_text())
        assert (metrics["zero_stage"], metrics["micro_batch_size"], metrics["gradient_accumulation_steps"]) == \
            (row.zero_stage, row.micro_batch_size, row.gradient_accumulation_steps), row.name
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    picked = table[table.chosen].iloc[0]
    assert optimal["zero_optimization"]["stage"] == picked.zero_stage
    # The pick trained to its evaluation; no "or with DeepSpeed's own launcher" line for a script
    # DeepSpeed's launcher cannot start (it would pass --deepspeed and --local_rank).
    assert math.isfinite(json.loads((tmp_path / "out" / "all_results.json").read_text())["perplexity"])
    assert "or with DeepSpeed's own launcher" not in done.stdout
