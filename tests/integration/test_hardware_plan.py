"""`launcher --autotuning plan --hardware SPEC.json` (issue 80, part 3): a Llama 3 8B built from its
config planned for 64 A100s (8 nodes of 8) on this 2-core machine, the script run as rank 0 of a
fake world with its model on the meta device, nothing materialised; plan.csv with every
data-parallel candidate; bad input refused in one line, exit 2, before any census."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import WORKERS, launcher_env, run_launcher, write_json

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SCRIPT = WORKERS / "llama_from_config_train.py"
A100 = {"name": "A100 SXM 80GB", "peak_bf16_flops": 312e12, "memory_bytes": 85899345920, "memory_bandwidth": 2.039e12,
        "accelerators_per_node": 8, "intra_node": {"bandwidth": 300e9, "latency": 5e-6},
        "inter_node": {"bandwidth": 25e9, "latency": 10e-6}}
DS = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "zero_optimization": {"stage": [1, 2, 3]}, "activation_checkpointing": {"policy": "auto"},
      "tensor_parallel": {"autotp_size": [1, 8]},
      "autotuning": {"enabled": True, "max_train_micro_batch_size_per_gpu": 1}}

PIPELINE_DS = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
               "bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": [0, 1]}, "pipeline": {"stages": "auto", "schedule": "auto"},
               "autotuning": {"enabled": True, "max_train_micro_batch_size_per_gpu": 4,
                              "arg_mappings": {"pipeline.stages": "--pp"}}}


def plan(out: Path, *flags: str, spec=A100, ds=DS, nodes: int = 8, ranks: int = 8, script_flags=("--size", "8b")):
    out.mkdir(parents=True, exist_ok=True)
    return run_launcher("--autotuning", "plan", "--hardware", write_json(out / "spec.json", spec), "--num_nodes",
                        str(nodes), "--nproc_per_node", str(ranks), *flags, SCRIPT, *script_flags, "--seq", "8192",
                        "--deepspeed", write_json(out / "ds.json", ds), cwd=out, timeout=240)


# The launcher run under a parent of its own, which reports the largest resident set of the
# processes beneath it (pytest's own children include every earlier test's).
WATCHED = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr); "
           "sys.exit(done.returncode)")


def test_an_8b_llama_is_planned_for_64_a100s_on_this_machine_with_nothing_materialised(tmp_path):
    out = tmp_path
    done = subprocess.run([sys.executable, "-c", WATCHED, sys.executable, "-m", "autotuner", "--autotuning", "plan",
                           "--hardware", write_json(out / "spec.json", A100), "--num_nodes", "8", "--nproc_per_node",
                           "8", SCRIPT, "--size", "8b", "--seq", "8192", "--deepspeed", write_json(out / "ds.json", DS)],
                          cwd=out, env=launcher_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # Two censuses of an 8B model ran beneath: no process held more than a few GiB (8B bf16 weights
    # alone would be 15 GiB, their fp32 Adam states 90 more).
    assert int(done.stderr.strip().splitlines()[-1]) < 3 * 2**30, done.stderr[-2000:]
    assert ("plan for 8 node(s) x 8 A100 SXM 80GB (64 ranks; tensor parallel 1, 8, data parallel over the rest): "
            "8,030,261,248 parameters") in done.stdout
    everything = pd.read_csv(tmp_path / "autotuning_results" / "plan.csv")
    table = everything[everything["tp"] == 1]
    needed = {"name", "zero_stage", "tp", "pp", "micro_batch_size", "gradient_accumulation_steps",
              "activation_checkpointing", "fits", "predicted_memory_bytes", "predicted_step_s", "predicted_samples_per_s"}
    assert needed <= set(table.columns)
    assert len(table) == 3 * 3  # ZeRO 1-3 x the three checkpointing policies, micro-batch 1 x gas 1 on 64 ranks
    assert set(everything["train_batch_size"]) == {64} and set(everything["pp"]) == {1}
    memory = table.set_index("name")["predicted_memory_bytes"]
    for policy in ("", "_acselective", "_acfull"):  # ZeRO shards more at each stage
        assert memory[f"z1{policy}_gas1_mbs1"] > memory[f"z2{policy}_gas1_mbs1"] > memory[f"z3{policy}_gas1_mbs1"]
    for stage in (1, 2, 3):  # checkpointing holds less and recomputes more
        assert memory[f"z{stage}_gas1_mbs1"] > memory[f"z{stage}_acselective_gas1_mbs1"] > memory[
            f"z{stage}_acfull_gas1_mbs1"]
        steps = table[table["zero_stage"] == stage].set_index("activation_checkpointing")["predicted_step_s"]
        assert steps["none"] < steps["selective"] < steps["full"]
    assert (table["fits"] == (table["predicted_memory_bytes"] <= 0.9 * A100["memory_bytes"])).all()
    assert not table.set_index("name")["fits"]["z1_gas1_mbs1"]  # 8B at sequence 8192, whole activations: no
    # Tensor parallel 8 inside each node, data parallel 8 across: the global batch held by gas 8; each
    # rank holds an eighth of the split Linears, so less than at degree 1, and waits on the all-reduces.
    eight = everything[everything["tp"] == 8].set_index("name")
    assert len(eight) == 9 and set(eight["gradient_accumulation_steps"]) == {8}
    for stage in (1, 2, 3):
        for policy in ("", "_acselective"):
            at_one = table.set_index("name").loc[f"z{stage}{policy}_gas1_mbs1"]
            at_eight = eight.loc[f"z{stage}_tp8{policy}_gas8_mbs1"]
            assert at_eight["predicted_memory_bytes"] < at_one["predicted_memory_bytes"]
            assert at_eight["predicted_samples_per_s"] < at_one["predicted_samples_per_s"]
    picked = everything[everything["picked"]]
    assert len(picked) == 1 and bool(picked.iloc[0]["fits"])
    assert picked.iloc[0]["predicted_samples_per_s"] == everything[everything["fits"]]["predicted_samples_per_s"].max()
    # Compute-bound at these links: 40-60% of the peak, as torchtitan's FSDP2 rows run (51-61%).
    assert 0.35 < float(picked.iloc[0]["predicted_mfu"]) < 0.65
    assert f"predicted pick: {picked.iloc[0]['name']}" in done.stdout
    assert not (tmp_path / "autotuning_exps").exists()  # nothing launched


def test_what_a_hardware_plan_cannot_take_is_refused_in_one_line(tmp_path):
    missing = {k: v for k, v in A100.items() if k != "memory_bandwidth"}
    cases = {
        "spec_missing_a_field": (dict(spec=missing), "spec.json: memory_bandwidth: missing; a hardware spec needs"),
        "more_ranks_than_a_node_holds": (dict(ranks=16), "--nproc_per_node 16: A100 SXM 80GB nodes hold 8 accelerators"),
        "degree_across_nodes": (dict(ds={**DS, "tensor_parallel": {"autotp_size": [16]}}),
                                "tensor_parallel.autotp_size: 16 does not divide --nproc_per_node 8"),
        "degree_splits_no_heads": (dict(ds={**DS, "tensor_parallel": {"autotp_size": [1, 8]}},
                                        script_flags=("--size", "tiny")),
                                   "tensor_parallel.autotp_size: the model cannot be split over 8 ranks"),
        "offload_not_costed": (dict(ds={**DS, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}),
                               "zero_optimization.offload_optimizer.device 'cpu': --hardware does not cost CPU offload"),
        "sgd_not_costed": (dict(ds={**DS, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}),
                           "optimizer.type SGD: --hardware costs Adam's and AdamW's states and step only"),
        "fp32_compute": (dict(ds={**DS, "bf16": {"enabled": False}}), "bf16.enabled false: fp32 compute is costed at the spec's peak_fp32_flops, which 'A100 SXM 80GB' does not give"),
        "weights_materialised": (dict(script_flags=("--size", "tiny", "--materialise")),
                                 "--hardware: parameter model.embed_tokens.weight is on cpu, not the meta device"),
        # (a script on DeepSpeed's engine, settled by its imports as run_clm.py's Trainer is, or by the flag)
        "deepspeeds_engine": (dict(flags=("--engine", "deepspeed")),
                              "--engine deepspeed was given; a plan for hardware not here counts our engine's step"),
    }
    for name, (kwargs, message) in cases.items():
        done = plan(tmp_path / name, *kwargs.pop("flags", ()), **kwargs)
        said = done.stdout + done.stderr
        assert done.returncode == 2 and message in done.stderr, (name, said[-2000:])
        assert "Traceback" not in said and len(done.stderr.strip().splitlines()) == 1, (name, said[-2000:])
        assert not (tmp_path / name / "autotuning_results" / "plan.csv").exists(), name
    (tmp_path / "train").mkdir()
    done = run_launcher("--hardware", write_json(tmp_path / "train" / "spec.json", A100), "--nproc_per_node", "8",
                        SCRIPT, "--deepspeed", write_json(tmp_path / "train" / "ds.json", DS), cwd=tmp_path / "train")
    assert done.returncode == 2 and "add --autotuning plan" in done.stderr, done.stderr[-2000:]


def test_the_gpt2_example_is_planned_for_a_node_of_a100s_unchanged(tmp_path):
    # The README's example script, as it is: it reads the engine's batch triad, rank and config before
    # its first step and logs loss.item() after backward, which the census answers or never reaches.
    example = Path(__file__).resolve().parents[2] / "examples" / "hf_gpt2"
    done = run_launcher("--autotuning", "plan", "--hardware", write_json(tmp_path / "spec.json", A100),
                        "--nproc_per_node", "8", example / "train.py", "--model_size", "tiny", "--max_steps", "200",
                        "--output_dir", tmp_path / "out", "--deepspeed", example / "ds_config.json", cwd=tmp_path,
                        timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    table = pd.read_csv(tmp_path / "autotuning_results" / "plan.csv")
    assert set(table["zero_stage"]) == {0, 1, 2, 3} and set(table["tp"]) == {1}
    assert table["fits"].all() and (table["predicted_step_s"] > 0).all()
    assert "predicted pick: z" in done.stdout
    assert not (tmp_path / "out" / "checkpoints").exists()  # nothing trained



def test_a_pipeline_module_is_planned_stage_by_stage_for_a_node_of_a100s(tmp_path):
    """A script that trains a PipelineModule with train_batch(), its stages searched (pipeline.stages
    "auto" mapped to its --pp, schedule "auto"): counted once with every layer on the meta device,
    then each stage count and schedule costed from the layers each rank would hold."""
    pipe = WORKERS / "pipe_gpt_train.py"
    done = run_launcher("--autotuning", "plan", "--hardware", write_json(tmp_path / "spec.json", A100),
                        "--nproc_per_node", "8", pipe, "--blocks", "6", "--deepspeed",
                        write_json(tmp_path / "ds.json", PIPELINE_DS), cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # the whole model counted: the tied embedding once (64 x 32), six blocks of 8,416, the final norm's 64
    assert ("plan for 1 node(s) x 8 A100 SXM 80GB (8 ranks; pipeline stages 1, 2, 4, 8, data parallel over the "
            f"rest): {64 * 32 + 6 * 8416 + 64:,} parameters") in done.stdout, done.stdout[:2000]
    table = pd.read_csv(tmp_path / "autotuning_results" / "plan.csv")
    assert set(table["pp"]) == {1, 2, 4, 8} and set(table["zero_stage"]) == {0, 1} and set(table["tp"]) == {1}
    chunked = table[table["stages_per_rank"] == 2]
    assert set(chunked["pipeline_schedule"]) == {"Interleaved1F1B"} and set(chunked["pp"]) == {2, 4}  # 16 > 9 layers
    assert chunked["name"].str.match(r"z[01]_pp[24]v2_gas\d+_mbs\d+$").all()
    row = table.set_index("name")
    # Each rank holds its stage's share: the heaviest of 4 stages holds less than all of the model.
    assert row.loc["z0_pp4_gas32_mbs1", "predicted_memory_bytes"] < row.loc["z0_pp1_gas8_mbs1", "predicted_memory_bytes"]
    assert table["fits"].all() and "predicted pick: z" in done.stdout
