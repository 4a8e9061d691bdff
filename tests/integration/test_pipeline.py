"""Pipeline parallelism on our engine, on real gloo ranks under the launcher (issue 79): a GPT-style
PipelineModule with a tied embedding and head (tests/workers/pipe_gpt_train.py) trains the losses
of the same layers unsplit, under each schedule torch offers for one stage per rank, with ZeRO 1
beside it, evaluates the same, resumes from its checkpoint and saves the whole model; DeepSpeedExamples'
pipeline script trains as data parallel; what a pipeline cannot train is refused in one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import WORKERS, run_launcher, write_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SCRIPT = WORKERS / "pipe_gpt_train.py"
# Clipping low enough to clip: the pipeline's norm over its stages (a tied weight counted once)
# must be the unsplit model's.
BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "steps_per_print": 100}


def train(out: Path, ranks: int, pp: int, *flags: str, expect: int = 0, **config):
    out.mkdir(parents=True, exist_ok=True)
    steps = () if "--steps" in flags else ("--steps", "3")
    done = run_launcher("--nproc_per_node", str(ranks), SCRIPT, "--pp", str(pp), *steps, "--out",
                        out / "losses.json", *flags, "--deepspeed_config", write_json(out / "ds.json", {**BASE, **config}),
                        cwd=out, timeout=300)
    assert done.returncode == expect, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def losses(out: Path) -> list[float]:
    return json.loads((out / "losses.json").read_text())


# The checkpoint test's run: ZeRO 1 with a schedule, gas 2 (its state resumes too).
RESUMED = {"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory) -> dict[int, list[float]]:
    """The same layers as one model on our engine (forward/backward/step): on 1 rank (3 steps, then
    the evaluation), and on 2 data-parallel ranks at RESUMED's settings (4 steps)."""
    one, two = tmp_path_factory.mktemp("unsplit1"), tmp_path_factory.mktemp("unsplit2")
    train(one, 1, 0, "--eval")
    train(two, 2, 0, "--steps", "4", **RESUMED)
    return {1: losses(one), 2: losses(two)}


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_two_stages_train_and_evaluate_as_the_unsplit_model(tmp_path, unsplit, schedule):
    train(tmp_path, 2, 2, "--eval", pipeline={"schedule": schedule, "stages": 2})
    got, want = losses(tmp_path), unsplit[1]
    assert len(got) == len(want) == 4 and want[2] < want[0]  # 3 steps that learn, then the evaluation
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    stages = [json.loads((tmp_path / f"stage_of_rank{rank}.json").read_text()) for rank in (0, 1)]
    # DeepSpeed's "parameters" split of [embed, 4 blocks, norm, head]; each rank holds its own layers
    # (global indices in the names) and the tied embedding.
    assert [s["parts"] for s in stages] == [[0, 3, 7]] * 2
    assert [(s["first"], s["last"]) for s in stages] == [(True, False), (False, True)]
    assert stages[0]["names"][-1] == stages[1]["names"][-1] == "tied_modules.embed.weight"
    assert all(name.startswith(("1.", "2.")) for name in stages[0]["names"][:-1])
    assert all(name.startswith(("3.", "4.", "5.")) for name in stages[1]["names"][:-1])


def test_zero_1_over_two_by_two_trains_as_the_unsplit_model_resumes_unbroken_and_saves_the_whole_model(
        tmp_path, unsplit):
    import torch

    def run(name, ranks, pp, steps, *flags):
        out = tmp_path / name
        train(out, ranks, pp, "--steps", str(steps), *flags, **RESUMED)
        return losses(out)

    unbroken = run("unbroken", 4, 2, 4, "--save16", str(tmp_path / "whole"))
    assert unbroken == pytest.approx(unsplit[2], rel=1e-5, abs=1e-6) and unbroken[3] < unbroken[0]
    first = run("first", 4, 2, 2, "--save", str(tmp_path / "ckpt"))
    second = run("second", 4, 2, 2, "--load", str(tmp_path / "ckpt"))
    assert first + second == pytest.approx(unbroken, rel=1e-6)
    # save_16bit_model: every stage's layers in one file, the same model one stage trains.
    run("one_stage", 2, 1, 4, "--save16", str(tmp_path / "whole1"))
    split, one = (torch.load(tmp_path / d / "pytorch_model.bin") for d in ("whole", "whole1"))
    assert sorted(split) == sorted(one) and "tied_modules.embed.weight" in split and "5.weight" in split
    assert all(torch.allclose(split[k], one[k], atol=1e-6) for k in split)


def test_what_a_pipeline_cannot_train_is_refused_in_one_line(tmp_path):
    # In a launch: a stage count that does not divide the ranks stops it, one line, exit 2.
    done = train(tmp_path / "launch", 2, 3, expect=2)
    assert "PipelineModule(num_stages=3): must divide the number of ranks (2)" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    # The rest in one 4-rank launch, each request's error as the ranks raised it.
    out = tmp_path / "refusals"
    train(out, 4, 2, "--refusals")
    found = json.loads((out / "refusals.json").read_text())
    expected = {
        "stages_divide": "PipelineModule(num_stages=3): must divide the number of ranks (4)",
        "more_stages_than_layers": "PipelineModule: 4 stages for 3 layers",
        "type_matches_nothing": "'conv' matches no layer's class name",
        "no_such_method": "not a method; expected \"parameters\", \"uniform\" or \"type:REGEX\"",
        "tensor_parallel_in_a_stage": "tensor parallelism inside pipeline stages is not supported yet",
        "zero_2": "ZeRO 2 and 3 are not supported with pipeline parallelism",
        "bf16": "bf16.enabled: mixed precision is not supported with pipeline parallelism yet",
        "stages_disagree": "pipeline.stages 4: the script's PipelineModule built 2 stages",
        "interleaved": "'Interleaved1F1B' runs several stages on each rank",
        "unknown_schedule": "pipeline.schedule: got 'Zigzag'; expected one of '1F1B', 'GPipe'",
    }
    for name, message in expected.items():
        assert found[name] is not None, name
        text, code = found[name]
        assert message in text and "\n" not in text and code == 2, (name, text, code)
    for call in ("forward", "backward", "step"):  # DeepSpeed's refusal, word for word
        assert found[call] == ["PipelineError: Only train_batch() is accessible in pipeline mode.", None]


EXAMPLE = WORKERS / "ds_pipeline_example_train.py"
# The example's ds_config.json at a CPU's size: every step one pass over the synthetic set, so a
# run that reads it in another order (train_base's loader shuffles) trains the same steps.
EXAMPLE_CONFIG = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                  "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}},
                  "steps_per_print": 1, "wall_clock_breakdown": False}


def run_example(out: Path, ranks: int, pp: int) -> list[float]:
    out.mkdir(parents=True, exist_ok=True)
    done = run_launcher("--nproc_per_node", str(ranks), EXAMPLE, "-p", str(pp), "--backend", "gloo", "--steps", "3",
                        "--image_size", "64", "--dataset_size", "16", "--dropout", "0", "--out", out / "losses.json",
                        "--deepspeed_config", write_json(out / "ds.json", EXAMPLE_CONFIG), cwd=out, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    if pp:  # the pipeline engine's own progress line, each step (steps_per_print 1), as DeepSpeed prints it
        assert "steps: 3 loss: " in done.stdout and "samples/sec: " in done.stdout, done.stdout[-2000:]
    return losses(out)


def test_deepspeed_examples_pipeline_script_trains_as_data_parallel_with_only_its_imports_swapped(tmp_path):
    whole = run_example(tmp_path / "p0", 1, 0)
    assert len(whole) == 3 and len(set(whole)) == 3
    assert run_example(tmp_path / "p2", 2, 2) == pytest.approx(whole, rel=1e-4)
    assert run_example(tmp_path / "p2dp2", 4, 2) == pytest.approx(whole, rel=1e-4)  # 2 stages x 2 data parallel

