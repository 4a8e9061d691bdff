"""DeepSpeed's AutoTP training API on our engine: a script shaped like DeepSpeedExamples'
autotp_example.py (tests/workers/autotp_example_style.py: its own groups in an mpu, the config's
tensor_parallel.autotp_size, AdamW built first, the batch broadcast from a TP group's first rank)
trains a tiny Llama split over 2 ranks to the losses of 1 unsplit rank, to DeepSpeed 0.19.8's own
engine's losses on the same script (its deepspeed.utils.groups answering as DeepSpeed's), and
through deepspeed.tp_model_init and groups built before initialize too; an mpu or a tp_model_init
that contradicts the config is refused in one line. The rank-free parts
(tp_model_init's record and merge, the groups before initialize) are tests/unit/test_autotp_calls.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import WORKERS, launcher_env, run_launcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="needs DeepSpeed: pip install 'autotuner[deepspeed]'")
SCRIPT = WORKERS / "autotp_example_style.py"


def train(out: Path, ranks: int, *flags: str, env: dict[str, str] | None = None) -> dict:
    done = run_launcher("--nproc_per_node", str(ranks), SCRIPT, "--out", out, *flags, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """Our engine: {"tp1": 1 rank unsplit, "tp2": the model split over 2 ranks}."""
    root = tmp_path_factory.mktemp("autotp")
    return {"tp1": train(root / "tp1.json", 1, "--tp_size", "1"),
            "tp2": train(root / "tp2.json", 2, "--tp_size", "2")}


def test_split_over_two_ranks_it_trains_to_the_losses_of_one_rank(ours):
    assert len(ours["tp2"]["losses"]) == 4
    assert ours["tp2"]["losses"] == pytest.approx(ours["tp1"]["losses"], abs=1e-5)
    # Split indeed: rank 0 holds the embeddings, norms and head whole, and half of each block's Linears.
    assert ours["tp2"]["parameters_held"] < ours["tp1"]["parameters_held"]


def test_deepspeeds_groups_functions_answer_with_the_engines_layout(ours):
    # deepspeed.utils.groups after initialize: the tensor- (= model-) parallel group is ranks 0-1,
    # each rank is its own data-parallel group; the engine's getters agree.
    rank0, rank1 = ours["tp2"]["groups"]
    assert rank0 == {"tp": [2, 0], "mp": [2, 0], "dp": [1, 0], "tp_source_rank": 0, "tp_ranks": [0, 1],
                     "mp_ranks": [0, 1], "dp_ranks": [0], "engine": [0, 0, 0]}
    assert rank1 == {"tp": [2, 1], "mp": [2, 1], "dp": [1, 0], "tp_source_rank": 0, "tp_ranks": [0, 1],
                     "mp_ranks": [0, 1], "dp_ranks": [1], "engine": [0, 1, 1]}


@needs_deepspeed
def test_deepspeeds_engine_trains_the_same_script_to_the_same_losses(ours, tmp_path):
    env = {**launcher_env(), "DS_ACCELERATOR": "cpu"}
    theirs = train(tmp_path / "ds.json", 2, "--tp_size", "2", "--engine", "deepspeed", env=env)
    assert theirs["losses"] == pytest.approx(ours["tp2"]["losses"], abs=1e-4)
    # DeepSpeed's AutoTP splits the same layers: rank 0 holds as many parameter elements.
    assert theirs["parameters_held"] == ours["tp2"]["parameters_held"]
    assert theirs["groups"] == ours["tp2"]["groups"]


def test_tp_model_init_and_groups_built_first_give_the_same_training(ours, tmp_path):
    # autotp_memory_compare.py's "traditional" mode calls tp_model_init before initialize; the
    # script also builds DeepSpeed's groups first, which initialize keeps (as DeepSpeed's does).
    noted = train(tmp_path / "tpi.json", 2, "--tp_size", "2", "--tp_model_init", "--init_tp_mesh_device")
    assert noted["losses"] == pytest.approx(ours["tp2"]["losses"], abs=1e-5)
    assert noted["parameters_held"] == ours["tp2"]["parameters_held"]
    assert noted["groups"] == [{**view, "kept_the_groups_built_first": True} for view in ours["tp2"]["groups"]]


@pytest.mark.parametrize("ranks, flags, message", [
    # The script's groups are tp 1 x dp 2; its config asks to split over 2 ranks.
    (2, ("--tp_size", "1", "--config_autotp_size", "2"),
     "initialize(mpu=...): the mpu's model-parallel world size is 1 but the config's tensor_parallel.autotp_size "
     "gives 2"),
    (1, ("--tp_size", "1", "--tp_model_init", "--tp_model_init_size", "2"),
     "tensor_parallel.autotp_size 1 in the config and tp_model_init(tp_size=2) disagree"),
], ids=["mpu_size", "tp_model_init_size"])
def test_a_contradiction_is_refused_in_one_line(tmp_path, ranks, flags, message):
    done = run_launcher("--nproc_per_node", str(ranks), SCRIPT, "--out", tmp_path / "losses.json", *flags,
                        timeout=300)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launcher: error: rank ") and message in lines[0], done.stderr
    assert not (tmp_path / "losses.json").exists()


def parameters(function) -> list[tuple[str, str, str]]:
    import inspect

    return [(p.name, p.kind.name, repr(p.default)) for p in inspect.signature(function).parameters.values()]


@needs_deepspeed
def test_the_calls_take_deepspeeds_parameters():
    import warnings

    import autotuner
    from autotuner.utils import groups

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import deepspeed
        from deepspeed.utils import groups as their_groups
    names = [*groups.__all__, "_init_tp_mesh_device"]
    pairs = [(deepspeed.tp_model_init, autotuner.tp_model_init), (deepspeed.set_autotp_mode, autotuner.set_autotp_mode),
             (deepspeed.module_inject.set_autotp_mode, autotuner.module_inject.set_autotp_mode),
             *[(getattr(their_groups, name), getattr(groups, name)) for name in names]]
    for theirs, ours in pairs:
        assert parameters(ours) == parameters(theirs), theirs.__qualname__


def test_groups_built_before_initialize_are_this_process_groups_until_it_ends():
    # In this process, a world of one: _init_tp_mesh_device builds the (dp, tp) groups, once; the
    # engine refuses another size; a new process group has none until they are built again.
    import torch.distributed as dist

    from autotuner.core.errors import UsageError
    from autotuner.runtime.distributed import init_distributed
    from autotuner.runtime.training.tensor_parallel import parallel_layout
    from autotuner.utils import groups

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        data, model = groups._init_tp_mesh_device(tensor_model_parallel_size=1)
        assert groups.get_model_parallel_group() is model and groups.get_data_parallel_group() is data
        assert groups._init_tp_mesh_device(tensor_model_parallel_size=2) is None  # already built: DeepSpeed's no-op
        assert [groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank(),
                groups.get_tensor_model_parallel_src_rank(), groups.get_data_parallel_world_size(),
                groups.get_data_parallel_rank()] == [1, 0, 0, 1, 0]
        with pytest.raises(UsageError, match="already built for 1 ranks"):
            parallel_layout(init_distributed(), 2)
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(UsageError, match="the tensor-parallel groups are not built"):
            groups.get_data_parallel_rank()
    finally:
        dist.destroy_process_group()


def test_two_by_two_the_pairs_train_data_parallel_with_the_script_groups(tmp_path):
    # 4 ranks, the script's own groups: tensor-parallel pairs (0, 1) and (2, 3), data-parallel
    # groups (0, 2) and (1, 3). The same losses as 2 unsplit data-parallel ranks.
    split = train(tmp_path / "2x2.json", 4, "--tp_size", "2")
    whole = train(tmp_path / "dp2.json", 2, "--tp_size", "1")
    assert split["losses"] == pytest.approx(whole["losses"], abs=1e-5)
    rank2 = split["groups"][2]
    assert rank2 == {"tp": [2, 0], "mp": [2, 0], "dp": [2, 1], "tp_source_rank": 2, "tp_ranks": [2, 3],
                     "mp_ranks": [2, 3], "dp_ranks": [0, 2], "engine": [1, 0, 0]}
