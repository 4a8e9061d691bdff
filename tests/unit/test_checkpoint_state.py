"""The engine state a checkpoint keeps beside DCP's shards (autotuner/runtime/saving/checkpoint.py): written
with torch.save, read back weights-only. No processes."""

from __future__ import annotations

import collections
import io

import pytest
import torch

from autotuner.core.errors import AutotunerError
from autotuner.runtime.saving.checkpoint import engine_state_bytes


def test_a_schedules_counter_and_a_clients_tuples_and_int_keys_come_back_as_they_were():
    state = {"lr_scheduler": {"milestones": collections.Counter({4: 1}), "last_epoch": 3},
             "client_state": {"pos": (3, 4), "per_class": {0: 0.5}, "seen": torch.tensor([1, 2])}}
    back = torch.load(io.BytesIO(engine_state_bytes(state)), weights_only=True)
    assert back["lr_scheduler"]["milestones"] == collections.Counter({4: 1})
    assert 4 in back["lr_scheduler"]["milestones"]  # through JSON the key was "4", and the milestone never hit
    assert back["client_state"]["pos"] == (3, 4) and back["client_state"]["per_class"] == {0: 0.5}
    assert torch.equal(back["client_state"]["seen"], torch.tensor([1, 2]))


class Opaque:
    pass


def test_what_a_weights_only_load_cannot_read_is_refused_at_save_in_one_line():
    with pytest.raises(AutotunerError, match="^save_checkpoint: client_state .*weights-only") as caught:
        engine_state_bytes({"client_state": {"thing": Opaque()}})
    assert "\n" not in str(caught.value)


def test_an_optimizer_state_saved_in_part_is_refused_not_reset():
    # AdamW saved without amsgrad, loaded with it: the parameter had a gradient (its moments are
    # there), so the missing max_exp_avg_sq is refused rather than the whole state dropped.
    from pathlib import Path

    from autotuner.runtime.saving.checkpoint import _parameters_saved_without_state

    state = {"model": {"w": 0}, "optim": {"state.w.exp_avg": 0, "state.w.exp_avg_sq": 0, "state.w.max_exp_avg_sq": 0,
                                          "state.w.step": 0, "state.b.exp_avg": 0, "state.b.step": 0}}
    saved = {"model.w", "optim.state.w.exp_avg", "optim.state.w.exp_avg_sq", "optim.state.w.step"}
    with pytest.raises(AutotunerError, match="missing optim.state.w.max_exp_avg_sq"):
        _parameters_saved_without_state(Path("ckpt"), state, saved)
    # A parameter with none of its state saved never had a gradient: a fresh start for it alone.
    assert _parameters_saved_without_state(Path("ckpt"), state, saved | {"optim.state.w.max_exp_avg_sq"}) == {"b"}


def test_optimizer_groups_split_otherwise_than_when_saved_are_refused():
    # The saved hyperparameters go back group by group: the same count with other members would
    # give the biases the weights' decay. Older checkpoints (no membership saved) check the count.
    from pathlib import Path

    from autotuner.runtime.saving.checkpoint import check_param_groups

    saved = {"param_groups": [{"lr": 1.0}, {"lr": 2.0}], "param_group_members": [["a.weight", "b.weight"], ["a.bias"]]}
    check_param_groups(Path("ckpt"), saved, [["b.weight", "a.weight"], ["a.bias"]])
    with pytest.raises(AutotunerError, match="parameter group 0 holds other parameters than when saved "
                                             r"\(a.bias, b.weight\); pass load_optimizer_states=False"):
        check_param_groups(Path("ckpt"), saved, [["a.weight", "a.bias"], ["b.weight"]])
    with pytest.raises(AutotunerError, match=r"has 2 parameter group\(s\) and this one 1"):
        check_param_groups(Path("ckpt"), {"param_groups": saved["param_groups"]}, [["a.weight", "b.weight", "a.bias"]])
    check_param_groups(Path("ckpt"), {"param_groups": saved["param_groups"]}, [["x"], ["y"]])
