"""A DeepSpeedExamples-style fine-tuning script (tests/workers/random_ltd_style_train.py: token-based
lr_kwargs on every step, rank 0 alone saving with save_without_random_ltd at the end, and once
midway while the other rank goes on) trains and saves its whole model on our engine at every stage,
2 ranks: FSDP2's shards are served to rank 0 (runtime/saving/rank_zero_gather.py)."""

import json

import pytest
import torch

from conftest import WORKERS, run_launcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SCRIPT = WORKERS / "random_ltd_style_train.py"


def train(tmp_path, stage: int, *flags: str):
    config = tmp_path / f"ds{stage}.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                  "zero_optimization": {"stage": stage}}))
    out = tmp_path / f"out{stage}"
    done = run_launcher("--nproc_per_node", "2", SCRIPT, "--output_dir", out, "--token_based_lr_decay",
                        *flags, "--deepspeed_config", config, timeout=200)
    return done, out


def assert_same_weights(saved: dict, reference: dict) -> None:
    assert sorted(saved) == sorted(reference)
    for key, value in saved.items():
        assert isinstance(value, torch.Tensor) and value.shape == reference[key].shape, key
        assert torch.equal(value.cpu(), reference[key].cpu()), key


def test_the_script_trains_and_saves_its_whole_model_at_every_stage(tmp_path, no_orphans):
    from transformers import GPT2Config, GPT2LMHeadModel

    losses = {}
    for stage in (0, 1, 2, 3):
        done, out = train(tmp_path, stage, "--midway_save_after", "2")
        assert done.returncode == 0, done.stderr[-3000:]
        saved = torch.load(out / "pytorch_model.bin", weights_only=True)
        assert_same_weights(saved, torch.load(out / "reference.bin", weights_only=True))
        assert_same_weights(torch.load(out / "midway.bin", weights_only=True),
                            torch.load(out / "midway_reference.bin", weights_only=True))
        # What the script saved is a whole model: it loads strictly into a fresh one.
        GPT2LMHeadModel(GPT2Config.from_json_file(out / "config.json")).load_state_dict(saved, strict=True)
        losses[stage] = json.loads((out / "losses.json").read_text())
    for stage in (1, 2, 3):
        assert losses[stage]["losses"] == pytest.approx(losses[0]["losses"], abs=1e-5), f"stage {stage}"
        assert losses[stage]["lrs"] == losses[0]["lrs"], f"stage {stage}"
    assert len(set(losses[0]["losses"])) > 1
    # The schedule drives the optimizer the engine steps (at stage 1 a ZeroRedundancyOptimizer):
    # a schedule without lr_kwargs is stepped to the train batch size (4), DeepSpeed's fallback.
    for scheduled, applied in losses[1]["lrs"]:
        assert scheduled == applied == pytest.approx(1e-3 * (100 - 4) / 99)


def test_random_ltd_itself_is_refused_before_training(tmp_path, no_orphans):
    done, out = train(tmp_path, 0, "--random_ltd")
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if "random-LTD" in line]
    assert lines and "is not supported by autotuner" in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (out / "losses.json").exists()


def test_save_without_random_ltd_matches_deepspeeds_own(tmp_path):
    ds_helper = pytest.importorskip("deepspeed.runtime.data_pipeline.data_routing.helper")
    from collections import OrderedDict

    from autotuner.compression.helper import recursive_getattr, recursive_setattr
    from autotuner.runtime.data_pipeline.data_routing.helper import remove_random_ltd_state_dict, save_without_random_ltd

    ds_utils = pytest.importorskip("deepspeed.utils.module_utils")
    state = OrderedDict([("h.0.random_ltd_layer.attn.weight", torch.ones(1)), ("wte.weight", torch.zeros(2)),
                         ("a.random_ltd_layer.b.random_ltd_layer.c", torch.ones(3))])
    ours, theirs = remove_random_ltd_state_dict(state), ds_helper.remove_random_ltd_state_dict(state)
    assert list(ours) == list(theirs) == ["h.0.attn.weight", "wte.weight", "a.b.c"]

    class Wrapped(torch.nn.Module):  # an engine-like object: the model under .module
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(3, 1)))
    for given in (model, Wrapped(model)):
        ours, theirs = save_without_random_ltd(given), ds_helper.save_without_random_ltd(given)
        assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert recursive_getattr(model, "1.0") is ds_utils.recursive_getattr(model, "1.0")
    recursive_setattr(model, "1.0", torch.nn.Identity())
    assert isinstance(model[1][0], torch.nn.Identity)
