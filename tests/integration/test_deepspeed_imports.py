"""Real scripts import far more than they use: every `deepspeed.*` path DeepSpeedExamples' scripts
import (counted at its commit 83757d9c, docs/deepspeed_examples_imports.md) imports from autotuner;
only using a feature we do not carry fails, with one line and exit status 2."""

from __future__ import annotations

import functools
import importlib
import textwrap

import pytest
import torch

import autotuner
from autotuner.core.errors import UnsupportedError
from conftest import run_launcher

# Imported with `import` / `from ... import` somewhere in DeepSpeedExamples.
IMPORTED = """
deepspeed deepspeed.accelerator deepspeed.comm deepspeed.compression.compress deepspeed.compression.helper
deepspeed.inference deepspeed.inference.v2.ragged deepspeed.module_inject deepspeed.moe.utils deepspeed.ops.adam
deepspeed.ops.op_builder deepspeed.ops.sparse_attention deepspeed.pipe
deepspeed.runtime.data_pipeline.data_routing.helper deepspeed.runtime.data_pipeline.data_sampling.data_analyzer
deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset deepspeed.runtime.domino.transformer
deepspeed.runtime.utils deepspeed.runtime.zero.offload_config deepspeed.runtime.zero.partition_parameters
deepspeed.utils deepspeed.utils.logging
""".split() + ["deepspeed.checkpointing", "deepspeed.moe.layer", "deepspeed.runtime.pipe",
               "deepspeed.runtime.data_pipeline.curriculum_scheduler", "deepspeed.monitor.monitor",
               "deepspeed.monitor.config", "deepspeed.profiling.flops_profiler",
               "deepspeed.profiling.flops_profiler.profiler"]  # named by the issue
# Reached only as attributes after `import deepspeed`.
ATTRIBUTE_CHAINS = """
deepspeed.module_inject.replace_policy deepspeed.moe deepspeed.moe.layer deepspeed.runtime deepspeed.runtime.config
deepspeed.runtime.zero deepspeed.zero
""".split()
FROM_IMPORTS = """
deepspeed:get_accelerator deepspeed:module_inject deepspeed:DeepSpeedTransformerLayer
deepspeed:DeepSpeedTransformerConfig deepspeed:replace_transformer_layer deepspeed.accelerator:get_accelerator
deepspeed.compression.compress:init_compression deepspeed.compression.compress:redundancy_clean
deepspeed.compression.helper:convert_conv1d_to_linear deepspeed.compression.helper:recursive_getattr
deepspeed.compression.helper:recursive_setattr deepspeed.inference:DeepSpeedTPConfig
deepspeed.inference:RaggedInferenceEngineConfig deepspeed.inference.v2.ragged:DSStateManagerConfig
deepspeed.moe.utils:split_params_into_different_moe_groups_for_optimizer deepspeed.ops.adam:DeepSpeedCPUAdam
deepspeed.ops.adam:FusedAdam deepspeed.ops.op_builder:AsyncIOBuilder deepspeed.ops.op_builder:GDSBuilder
deepspeed.ops.sparse_attention:BSLongformerSparsityConfig deepspeed.ops.sparse_attention:BertSparseSelfAttention
deepspeed.ops.sparse_attention:BigBirdSparsityConfig deepspeed.ops.sparse_attention:DenseSparsityConfig
deepspeed.ops.sparse_attention:FixedSparsityConfig deepspeed.ops.sparse_attention:SparseAttentionUtils
deepspeed.ops.sparse_attention:VariableSparsityConfig deepspeed.pipe:PipelineModule
deepspeed.runtime.data_pipeline.data_routing.helper:convert_to_random_ltd
deepspeed.runtime.data_pipeline.data_routing.helper:save_without_random_ltd
deepspeed.runtime.data_pipeline.data_sampling.data_analyzer:DataAnalyzer
deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset:MMapIndexedDataset
deepspeed.runtime.domino.transformer:DominoTransformer deepspeed.runtime.utils:see_memory_usage
deepspeed.runtime.utils:set_random_seed deepspeed.runtime.zero.offload_config:OffloadDeviceEnum
deepspeed.runtime.zero.offload_config:OffloadStateTypeEnum deepspeed.runtime.zero.partition_parameters:ZeroParamStatus
deepspeed.utils:RepeatingLoader deepspeed.utils.logging:logger deepspeed.runtime.config:LAMB_OPTIMIZER
deepspeed.runtime.config:ONEBIT_LAMB_OPTIMIZER deepspeed.zero:GatheredParameters deepspeed.zero:Init
deepspeed.profiling.flops_profiler:get_model_profile deepspeed.profiling.flops_profiler:FlopsProfiler
deepspeed.monitor.monitor:MonitorMaster
""".split()


def ours(path: str) -> str:
    return "autotuner" + path[len("deepspeed"):]


@pytest.mark.parametrize("path", IMPORTED)
def test_every_module_path_scripts_import_imports(path):
    importlib.import_module(ours(path))


@pytest.mark.parametrize("path", ATTRIBUTE_CHAINS)
def test_every_attribute_chain_scripts_use_resolves_after_import(path):
    functools.reduce(getattr, path.split(".")[1:], autotuner)


@pytest.mark.parametrize("pair", FROM_IMPORTS)
def test_every_name_scripts_import_exists(pair):
    module, name = pair.split(":")
    assert hasattr(importlib.import_module(ours(module)), name)


REFUSED_ON_USE = [
    ("moe.layer.MoE", lambda: autotuner.moe.layer.MoE(hidden_size=8, expert=None, num_experts=2), "mixture-of-experts"),
    ("data_analyzer.DataAnalyzer",
     lambda: importlib.import_module("autotuner.runtime.data_pipeline.data_sampling.data_analyzer").DataAnalyzer(None),
     "data efficiency"),
    ("curriculum", lambda: importlib.import_module(
        "autotuner.runtime.data_pipeline.curriculum_scheduler").CurriculumScheduler({}), "curriculum"),
    ("sparse attention", lambda: importlib.import_module("autotuner.ops.sparse_attention").FixedSparsityConfig(4),
     "sparse attention"),
    ("replace_transformer_layer", lambda: autotuner.replace_transformer_layer(None), "module_inject"),
    ("init_inference", lambda: autotuner.init_inference(None), "inference"),
]


@pytest.mark.parametrize("what,use,says", REFUSED_ON_USE, ids=[r[0] for r in REFUSED_ON_USE])
def test_using_an_unsupported_feature_is_refused_in_one_line(what, use, says):
    with pytest.raises(UnsupportedError) as refused:
        use()
    message = str(refused.value)
    assert "is not supported by autotuner" in message and says in message and "\n" not in message
    assert refused.value.exit_code == 2


def test_moe_param_groups_without_expert_parameters_come_back_unchanged():
    from autotuner.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    model = torch.nn.Linear(4, 2)
    groups = [{"params": list(model.parameters()), "lr": 0.1, "name": "dense"}]
    assert split(groups) is groups and split(groups[0]) is groups[0]
    expert = torch.nn.Parameter(torch.ones(2))
    expert.allreduce = False  # DeepSpeed's mark of an expert parameter
    with pytest.raises(UnsupportedError, match="mixture-of-experts"):
        split([{"params": [expert]}])


def test_deepspeed_checkpointing_gives_the_gradients_of_the_plain_forward():
    from autotuner import checkpointing

    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"number_checkpoints": 2}})
    assert checkpointing.is_configured()
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.GELU())
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    plain = block(x).sum()
    plain.backward()
    expected = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    torch.manual_seed(1)  # the same dropout mask: the recompute restores the forward's random state
    checkpointed = checkpointing.checkpoint(block, x).sum()
    checkpointed.backward()
    assert torch.allclose(plain, checkpointed)
    for want, got in zip(expected, [p.grad for p in block.parameters()] + [x.grad]):
        assert torch.allclose(want, got, atol=1e-6)
    with pytest.raises(UnsupportedError, match="partition_activations"):
        checkpointing.configure(None, partition_activations=True)


def test_rng_tracker_forks_a_named_state_and_keeps_the_default_one():
    from autotuner import checkpointing

    checkpointing.model_parallel_cuda_manual_seed(123)
    tracker = checkpointing.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the named state went on where it left off


# A DeepSpeedExamples-style script: top-level imports of features it never uses on this path.
SCRIPT = textwrap.dedent("""
    import argparse, torch
    import autotuner as deepspeed
    from autotuner.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from autotuner.pipe import PipelineModule
    from autotuner.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd
    from autotuner.runtime.zero.partition_parameters import ZeroParamStatus
    from autotuner.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from autotuner.utils import RepeatingLoader

    parser = argparse.ArgumentParser()
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    model = torch.nn.Linear(4, 1)
    if args.moe:
        model = deepspeed.moe.layer.MoE(hidden_size=4, expert=model, num_experts=2)
    groups = split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters())}])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
    for _ in range(3):
        loss = engine(torch.randn(2, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    if engine.global_rank == 0:
        print("trained", flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_script_with_unused_feature_imports_runs_and_the_feature_is_refused_when_used(tmp_path, no_orphans):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = run_launcher("--nproc_per_node", "2", script, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained" in result.stdout
    refused = run_launcher("--nproc_per_node", "2", script, "--moe", timeout=180)
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "deepspeed.moe is not supported by autotuner" in lines[0], refused.stderr


ENGINE_MEMBERS = textwrap.dedent("""
    import json, sys, torch
    import autotuner as deepspeed
    from autotuner.core.errors import UnsupportedError

    engine, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 1), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
    counted = [engine.is_gradient_accumulation_boundary()]
    engine.set_gradient_accumulation_boundary(True)  # DeepSpeed's manual override, held until set again
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
    engine.set_gradient_accumulation_boundary(None)
    refused = []
    for name in ("train_batch", "eval_batch"):
        try:
            getattr(engine, name)()
        except UnsupportedError as err:
            refused.append(str(err))
    print(json.dumps({"counted": counted, "steps": engine.global_steps, "refused": refused}))
""")


def test_engine_boundary_override_and_pipeline_batches(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import launcher_env

    result = subprocess.run([sys.executable, "-c", ENGINE_MEMBERS], env=launcher_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["counted"] == [False] and out["steps"] == 2  # each overridden micro-step was a boundary
    assert len(out["refused"]) == 2 and all("train_batch/eval_batch drive a pipeline engine" in r
                                            for r in out["refused"])


def test_a_ranks_multi_line_error_keeps_every_line_bounded():
    from autotuner.core.launch_records import MESSAGE_LIMIT, error_message

    # Hugging Face's batch-size mismatch puts the useful part on an earlier line.
    hf = ("Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n"
          "- ds train_batch_size=2 vs hf train_batch_size=1\n"
          "The easiest method is to set these DeepSpeed config values to 'auto'.")
    line = error_message(hf)
    assert "ds train_batch_size=2 vs hf train_batch_size=1" in line and "\n" not in line
    assert line.endswith("to 'auto'.")
    long = error_message("start\n" + "x" * 5000 + "\nthe end")
    assert len(long) <= MESSAGE_LIMIT and long.startswith("start") and long.endswith("the end")
