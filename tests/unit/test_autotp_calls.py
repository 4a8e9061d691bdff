"""DeepSpeed 0.19.8's AutoTP calls around initialize, without ranks: tp_model_init notes its
arguments and refuses a second call that contradicts them, initialize's merge folds them into the
tensor_parallel section (filling what the config leaves out, refusing what contradicts it), and
deepspeed.utils.groups refuses in one line before any layout is built. The training itself, and
the groups after initialize, are tests/integration/test_autotp_api.py."""

from __future__ import annotations

import pytest
import torch

import autotuner
from autotuner.config.loader import load_config
from autotuner.core.errors import ConfigError, UsageError
from autotuner.runtime import tp_init


@pytest.fixture(autouse=True)
def nothing_noted(monkeypatch):
    monkeypatch.setattr(tp_init, "_recorded", None)
    monkeypatch.setattr(tp_init, "_training_mode", False)


def config(**top):
    return load_config({"train_batch_size": 2, **top})


class Mpu:
    def get_model_parallel_world_size(self):
        return 2


def test_tp_model_init_returns_the_model_unchanged_and_notes_its_arguments():
    model = torch.nn.Linear(2, 2)
    assert autotuner.tp_model_init(model, 2, torch.bfloat16) is model
    assert autotuner.tp_model_init(model=model, tp_size=2, dtype=torch.bfloat16, config={"ignored": 1}) is model
    assert tp_init.recorded_tp_model_init() == tp_init.TPModelInitArgs(2, torch.bfloat16, None)
    assert tp_init.autotp_training_mode()


@pytest.mark.parametrize("second", [dict(tp_size=4, dtype=torch.bfloat16), dict(tp_size=2, dtype=torch.float16),
                                    dict(tp_size=2, dtype=torch.bfloat16, tp_group=object())],
                         ids=["tp_size", "dtype", "tp_group"])
def test_a_second_tp_model_init_that_contradicts_the_first_is_refused(second):
    model = torch.nn.Linear(2, 2)
    autotuner.tp_model_init(model, tp_size=2, dtype=torch.bfloat16)
    with pytest.raises(UsageError) as refused:
        autotuner.tp_model_init(model, **second)
    assert "an earlier call in this process gave tp_size=2, dtype=torch.bfloat16" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_set_autotp_mode_is_at_deepspeeds_two_paths():
    from autotuner.module_inject import set_autotp_mode

    assert autotuner.set_autotp_mode is set_autotp_mode
    set_autotp_mode(training=True)
    assert tp_init.autotp_training_mode()
    set_autotp_mode()
    assert not tp_init.autotp_training_mode()


def test_without_tp_model_init_the_config_comes_back_as_it_was():
    cfg = config(tensor_parallel={"autotp_size": 2})
    assert tp_init.merge_into_config(cfg, None) == (cfg, None)


def test_tp_model_init_fills_the_sizes_the_config_leaves_out():
    autotuner.tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.float32)
    merged, group = tp_init.merge_into_config(config(), None)
    assert group is None
    assert merged.tensor_parallel.autotp_size == 2 and merged.tensor_parallel.tp.tp_size == 2
    assert merged.to_dict()["tensor_parallel"] == {"autotp_size": 2, "tp": {"tp_size": 2}}
    # The config's own values stay where they agree.
    same, _ = tp_init.merge_into_config(config(tensor_parallel={"autotp_size": 2, "tp": {"tp_size": 2}}), Mpu())
    assert same.tensor_parallel.autotp_size == 2 and same.tensor_parallel.tp.tp_size == 2


@pytest.mark.parametrize("top, message", [
    ({"tensor_parallel": {"autotp_size": 4}},
     "tensor_parallel.autotp_size 4 in the config and tp_model_init(tp_size=2) disagree"),
    ({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 1}}},
     "tensor_parallel.tp.tp_size 1 in the config and tp_model_init(tp_size=2) disagree"),
    ({"bf16": {"enabled": True}}, "tp_model_init(dtype=torch.float32) but the config trains in bf16"),
    ({"fp16": {"enabled": True}}, "tp_model_init(dtype=torch.float32) but the config trains in fp16"),
    ({"tensor_parallel": {"dtype": "fp16"}}, "tensor_parallel.dtype fp16 in the config and tp_model_init"),
    ({"tensor_parallel": {"partition_config": {"layer_specs": []}}}, "tensor_parallel.partition_config"),
], ids=["autotp_size", "tp.tp_size", "bf16", "fp16", "tensor_parallel.dtype", "refused_key_once_split"])
def test_what_contradicts_tp_model_init_is_refused_in_one_line(top, message):
    autotuner.tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.float32)
    with pytest.raises(ConfigError) as refused:
        tp_init.merge_into_config(config(**top), None)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_dtype_the_config_agrees_with_merges():
    autotuner.tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.bfloat16)
    merged, _ = tp_init.merge_into_config(config(bf16={"enabled": True}, tensor_parallel={"dtype": "bf16"}), None)
    assert merged.tensor_parallel.autotp_size == 2


def test_a_tp_group_beside_an_mpu_is_refused():
    autotuner.tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.float32, tp_group=object())
    with pytest.raises(UsageError, match=r"tp_model_init was given a tp_group; pass the groups one way"):
        tp_init.merge_into_config(config(), Mpu())


GROUP_FUNCTIONS = ["get_tensor_model_parallel_group", "get_model_parallel_group", "get_data_parallel_group",
                   "get_tensor_model_parallel_world_size", "get_model_parallel_world_size",
                   "get_tensor_model_parallel_rank", "get_model_parallel_rank", "get_tensor_model_parallel_src_rank",
                   "get_data_parallel_world_size", "get_data_parallel_rank"]


@pytest.mark.parametrize("name", GROUP_FUNCTIONS)
def test_the_groups_are_refused_before_any_layout_is_built(name):
    # DeepSpeed asserts "... group is not initialized" here; we say so in one line.
    groups = autotuner.utils.groups
    with pytest.raises(UsageError) as refused:
        getattr(groups, name)()
    assert str(refused.value).startswith(f"deepspeed.utils.groups.{name}(): the tensor-parallel groups are not built")


def test_init_tp_mesh_device_needs_the_process_group(monkeypatch):
    import torch.distributed as dist

    from autotuner.utils.groups import _init_tp_mesh_device

    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # another test of this process may have made one
    with pytest.raises(UsageError, match=r"call deepspeed.init_distributed\(\) first"):
        _init_tp_mesh_device(2)
