"""Pipeline parallelism on our engine, on real gloo ranks under the launcher (issue 79): a GPT-style
PipelineModule with a tied embedding and head (tests/workers/pipe_gpt_train.py) trains the losses
of the same layers unsplit, under each schedule torch offers for one stage per rank and the
looped and interleaved ones over two chunks a rank, with ZeRO 1 beside it, evaluates the same,
resumes from its checkpoint and saves the whole model; DeepSpeedExamples'
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
    train(one, 1, 0, "--eval", "--save16", str(one / "whole"))
    train(two, 2, 0, "--steps", "4", "--save16", str(two / "whole"), **RESUMED)
    return {1: losses(one), 2: losses(two), "whole": two / "whole", "whole1": one / "whole"}


def renamed_as_pipeline(whole: dict) -> dict:
    """The unsplit model's weights under the pipeline's names: its blocks.i are layer i + 1, its
    embedding the tied one."""
    return {("tied_modules.embed.weight" if k == "embed.weight" else
             f"{int(k.split('.')[1]) + 1}.{k.split('.', 2)[2]}"): v for k, v in whole.items()}


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

    # The unbroken run saves its checkpoint after step 2 and trains on; a new launch resumes there.
    unbroken = run("unbroken", 4, 2, 4, "--save16", str(tmp_path / "whole"), "--save", str(tmp_path / "ckpt"),
                   "--save_at", "2")
    assert unbroken == pytest.approx(unsplit[2], rel=1e-5, abs=1e-6) and unbroken[3] < unbroken[0]
    second = run("second", 4, 2, 2, "--load", str(tmp_path / "ckpt"))
    assert second == pytest.approx(unbroken[2:], rel=1e-6)
    # save_16bit_model: every stage's layers in one file, the model the unsplit run trained (its
    # blocks.i are the pipeline's layer i + 1, its embedding the tied one).
    split = torch.load(tmp_path / "whole" / "pytorch_model.bin")
    renamed = renamed_as_pipeline(torch.load(unsplit["whole"] / "pytorch_model.bin"))
    assert sorted(split) == sorted(renamed) and "tied_modules.embed.weight" in split and "5.weight" in split
    assert all(torch.allclose(split[k], renamed[k], atol=1e-5) for k in split)


def test_two_stages_split_two_ways_by_tensor_parallelism_resume_to_the_unsplit_models_run(tmp_path, unsplit):
    # pp 2 x tp 2 on 4 ranks (data-parallel size 1, the unsplit run's global batch): each stage's
    # blocks split by AutoTP's rule over its TP pair inside the (pp, dp, tp) mesh, ZeRO 1 stepping
    # the shards' shadows (the tune below runs ZeRO 0 there). Two steps and a checkpoint, then a
    # new launch resumes from it for the third, evaluates and saves the whole model: the unsplit
    # one-rank run's losses, evaluation and weights (gradient clipping at 0.5 clips: the norm over
    # split and whole weights, stages and TP ranks, is the unsplit model's).
    import torch

    split = {"tensor_parallel": {"autotp_size": 2}, "pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}}
    first = train(tmp_path / "first", 4, 2, "--steps", "2", "--save", str(tmp_path / "ckpt"), **split)
    assert "4 Linear layers split over 2 ranks by DeepSpeed AutoTP's rule; data-parallel size 1" in first.stderr
    train(tmp_path / "second", 4, 2, "--steps", "1", "--load", str(tmp_path / "ckpt"), "--eval", "--save16",
          str(tmp_path / "whole"), **split)
    got = losses(tmp_path / "first") + losses(tmp_path / "second")
    assert got == pytest.approx(unsplit[1], rel=1e-5, abs=1e-6)
    stages = [json.loads((tmp_path / "second" / f"stage_of_rank{rank}.json").read_text()) for rank in range(4)]
    assert [s["stage"] for s in stages] == [0, 0, 1, 1]
    saved = torch.load(tmp_path / "whole" / "pytorch_model.bin")
    renamed = renamed_as_pipeline(torch.load(unsplit["whole1"] / "pytorch_model.bin"))
    assert sorted(saved) == sorted(renamed) and saved["1.fc1.weight"].shape == renamed["1.fc1.weight"].shape
    # Adam divides by each gradient's own scale, so an element whose gradient is near zero moves by
    # up to lr on a rounding-level difference (the TP all-reduces sum in another order): measured
    # 5e-5 at most, against lr 0.01 a step; the losses above hold to 1e-5.
    assert all(torch.allclose(saved[k], renamed[k], atol=2e-4) for k in saved), \
        {k: (saved[k] - renamed[k]).abs().max().item() for k in saved}


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                                      "DualPipeV"])
def test_two_stages_of_two_chunks_each_train_and_evaluate_as_the_unsplit_model(tmp_path, unsplit, schedule):
    # pipeline.stages_per_rank left out: 2 chunks a rank, re-placed at initialize (rank r runs
    # virtual stages r and r + 2, or in a V r and 3 - r), the layers seeded by their index, so the
    # unsplit model's weights. In the V the first rank holds the tied embedding and head both:
    # one weight, its gradient from both chunks, scaled once.
    v_shaped = schedule in ("ZBVZeroBubble", "DualPipeV")
    # (torch runs no forward-only pass over a V: its evaluation is refused, in the refusals test)
    train(tmp_path, 2, 2, *(() if v_shaped else ("--eval",)), pipeline={"schedule": schedule, "stages": 2})
    assert losses(tmp_path) == pytest.approx(unsplit[1][:3] if v_shaped else unsplit[1], rel=1e-5, abs=1e-6)
    stages = [json.loads((tmp_path / f"stage_of_rank{rank}.json").read_text()) for rank in (0, 1)]
    parts = stages[0]["parts"]
    assert len(parts) == 5 and parts[0] == 0 and parts[-1] == 7 and stages[1]["parts"] == parts
    held = [sorted({int(name.split(".")[0]) for name in s["names"] if name[0].isdigit()}) for s in stages]
    for rank, layers in enumerate(held):  # each rank's two chunks, no other layer
        mine = [i for chunk in ((rank, 3 - rank) if v_shaped else (rank, rank + 2))
                for i in range(parts[chunk], parts[chunk + 1])]
        assert layers == [i for i in mine if i in (1, 2, 3, 4, 5)], (rank, layers, parts)
    ends = [(True, True), (False, False)] if v_shaped else [(True, False), (False, True)]
    assert [(s["first"], s["last"]) for s in stages] == ends


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_two_chunks_a_rank_resume_from_their_checkpoint_and_save_the_whole_model(tmp_path, unsplit, schedule):
    # Each rank saves and loads the layers of both its chunks (the checkpoint's ownership is the
    # rank's layer set, not one contiguous range; in a V the first rank's are the first and the
    # last chunk, the tied weight once), then writes the whole model at the end.
    import torch

    chunked = {"pipeline": {"schedule": schedule, "stages": 2}}
    evaluated = schedule != "ZBVZeroBubble"  # (torch runs no forward-only pass over a V)
    train(tmp_path / "first", 2, 2, "--steps", "2", "--save", str(tmp_path / "ckpt"), **chunked)
    train(tmp_path / "second", 2, 2, "--steps", "1", "--load", str(tmp_path / "ckpt"),
          *(("--eval",) if evaluated else ()), "--save16", str(tmp_path / "whole"), **chunked)
    got = losses(tmp_path / "first") + losses(tmp_path / "second")
    assert got == pytest.approx(unsplit[1] if evaluated else unsplit[1][:3], rel=1e-5, abs=1e-6)
    saved = torch.load(tmp_path / "whole" / "pytorch_model.bin")
    renamed = renamed_as_pipeline(torch.load(unsplit["whole1"] / "pytorch_model.bin"))
    assert sorted(saved) == sorted(renamed)
    assert all(torch.allclose(saved[k], renamed[k], atol=1e-5) for k in saved)


def test_what_a_pipeline_cannot_train_is_refused_in_one_line(tmp_path):
    # In a launch: a stage count that does not divide the ranks stops it, one line, exit 2 (one rank
    # is enough for two stages not to divide it).
    done = train(tmp_path / "launch", 1, 2, expect=2)
    assert "PipelineModule(num_stages=2): must divide the number of ranks (1)" in done.stderr
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
        "v_eval": "eval_batch(): pipeline.schedule ZBVZeroBubble has no forward-only pass in torch",
        "model_axis_without_autotp": "its model axis of 2 splits each stage by tensor parallelism; set "
                                     "tensor_parallel.autotp_size 2 too",
        "zero_2": "ZeRO 2 and 3 are not supported with pipeline parallelism",
        "stages_disagree": "pipeline.stages 4: the script's PipelineModule built 2 stages",
        "v_three_chunks": "pipeline.stages_per_rank 3: schedule 'ZBVZeroBubble' runs exactly 2 stages on each rank",
        "dual_pipe_v_few": "pipeline.schedule DualPipeV: 2 micro-batches (gradient_accumulation_steps) for 4 virtual "
                           "stages",
        "unknown_schedule": "pipeline.schedule: got 'Zigzag'; expected one of '1F1B', 'GPipe', 'Interleaved1F1B'",
        "chunks_under_1f1b": "pipeline.stages_per_rank 2: schedule '1F1B' runs one stage per rank",
        "more_chunks_than_layers": "pipeline.stages_per_rank 3: 2 stages x 3 chunks for 5 layers",
        "not_whole_rounds": "pipeline.schedule Interleaved1F1B: 5 micro-batches (gradient_accumulation_steps) over 2 "
                            "stages are not whole rounds",
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
    done = run_launcher("--nproc_per_node", str(ranks), EXAMPLE, "-p", str(pp), "--backend", "gloo", "--steps", "2",
                        "--image_size", "64", "--dataset_size", "16", "--dropout", "0", "--out", out / "losses.json",
                        "--deepspeed_config", write_json(out / "ds.json", EXAMPLE_CONFIG), cwd=out, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    if pp:  # the pipeline engine's own progress line, each step (steps_per_print 1), as DeepSpeed prints it
        assert "steps: 2 loss: " in done.stdout and "samples/sec: " in done.stdout, done.stdout[-2000:]
    return losses(out)


def test_deepspeed_examples_pipeline_script_trains_as_data_parallel_with_only_its_imports_swapped(tmp_path):
    whole = run_example(tmp_path / "p0", 1, 0)
    assert len(whole) == 2 and len(set(whole)) == 2  # 2 steps: the second reads the set again
    assert run_example(tmp_path / "p2", 2, 2) == pytest.approx(whole, rel=1e-4)
    assert run_example(tmp_path / "p2dp2", 4, 2) == pytest.approx(whole, rel=1e-4)  # 2 stages x 2 data parallel



# ----- tuning the pipeline stages (the stages reach the script as its --pp flag) -----
TUNE = {"enabled": True, "start_profile_step": 2, "end_profile_step": 3, "exp_timeout_s": 120,
        "tuner_type": "gridsearch", "remeasure_rounds": 0, "history": False,
        "max_train_micro_batch_size_per_gpu": 4, "arg_mappings": {"pipeline.stages": "--pp"}}


def tune(out: Path, ranks: int, mode: str, *flags: str, expect: int = 0, autotuning: dict | None = None,
         env: dict[str, str] | None = None, **config):
    from conftest import launcher_env

    out.mkdir(parents=True, exist_ok=True)
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "steps_per_print": 1000,
          "pipeline": {"stages": "auto"}, **config, "autotuning": {**TUNE, **(autotuning or {})}}
    done = run_launcher("--autotuning", mode, "--nproc_per_node", str(ranks), SCRIPT, *flags, "--out",
                        out / "losses.json", "--deepspeed", write_json(out / "ds.json", ds), cwd=out, timeout=600,
                        env={**launcher_env(), **(env or {})})
    assert done.returncode == expect, done.stdout[-3000:] + done.stderr[-3000:]
    return done, done.stdout + done.stderr


def test_a_tune_searches_the_pipeline_stages_at_the_users_global_batch_and_trains_the_pick(tmp_path):
    # 4 ranks, stages "auto": 1, 2 and 4, each profiled at its own layout; train_batch_size 16 holds at
    # each (micro-batch x gas make up for the data-parallel size 4, 2, 1); the pick then trains.
    from conftest import experiments_table

    _, said = tune(tmp_path, 4, "run", "--steps", "6", train_batch_size=16, zero_optimization={"stage": [0, 1, 2]})
    assert "pipeline: searching stages 1, 2, 4 (each profiled at its own layout, data-parallel size 4, 2, 1)" in said
    table = experiments_table(tmp_path / "autotuning_results")
    assert set(table["state"]) <= {"ok", "pruned"}, table[["name", "state", "error"]]  # no OOM, no failed launch
    assert set(table["pp"]) == {1, 2, 4} and all(f"_pp{pp}_" in n for pp, n in zip(table["pp"], table["name"]))
    ran = table[table["state"] == "ok"]
    dp = {1: 4, 2: 2, 4: 1}
    assert all(m * g * dp[pp] == 16 for m, g, pp in
               zip(ran["micro_batch_size"], ran["gradient_accumulation_steps"], ran["pp"]))
    assert set(table["zero_stage"]) <= {0, 1}  # ZeRO 2 is not searched at a pipeline, and the summary says so
    for pp in (1, 2, 4):
        assert f"layout: pipeline {pp} x data parallel {dp[pp]}: kept" in said
    assert said.count("ZeRO 2 and 3 not searched here (the pipeline engine refuses them") == 3
    # A pipelined profile launch recorded each stage: its parameters (the tied embedding on both
    # ends) and the activations its first micro-batch saved; the memory model costs the heaviest.
    info = json.loads(next((tmp_path / "autotuning_exps").glob("z0_pp2_*/model_info.json")).read_text())
    assert info["pipeline_stages"] == 2 and info["stage_of_rank"] == [0, 0, 1, 1]
    assert sum(info["stage_num_params"]) == info["num_params"] + 64 * 32  # the tied weight counted on both stages
    assert all(size > 0 for size in info["stage_activation_bytes"])
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    best = table[table["chosen"]].iloc[0]
    assert optimal["pipeline"]["stages"] == best["pp"]
    assert f"--pp {best['pp']}" in said  # the optimal command passes the stages as the script's flag
    assert len(losses(tmp_path)) == 6  # the run trained the pick's layout for the script's steps


def test_a_tune_of_split_stages_runs_the_pipeline_by_tensor_parallel_layout_and_predicts_its_memory(tmp_path):
    # 4 ranks, stages [2] (through --pp) x autotp_size [2] (through the config): one layout, pp 2 x
    # tp 2, data-parallel size 1, so micro-batch x gas make up train_batch_size 16 alone; ZeRO 0
    # (the resume test above trains ZeRO 1 there). The ranks build what each experiment set, and
    # the per-stage memory model, with each stage's split parameters over its TP pair, predicts
    # the search's launches.
    from conftest import experiments_table

    _, said = tune(tmp_path, 4, "tune", "--dim", "128", train_batch_size=16, zero_optimization={"stage": [0]},
                   pipeline={"stages": [2]}, tensor_parallel={"autotp_size": [2]})
    assert "layout: pipeline 2 x tensor parallel 2 x data parallel 1: kept" in said, said[-3000:]
    table = experiments_table(tmp_path / "autotuning_results")
    assert set(table["state"]) <= {"ok", "pruned"} and (table["state"] == "ok").sum() >= 2, table[SHOWN]
    ran = table[table["state"] == "ok"]
    assert set(ran["zero_stage"]) == {0} and set(ran["pp"]) == {2} and set(ran["tp"]) == {2}
    assert all(n.startswith("z0_pp2_tp2_gas") for n in ran["name"])
    assert all(m * g == 16 for m, g in zip(ran["micro_batch_size"], ran["gradient_accumulation_steps"]))
    predicted = ran.dropna(subset=["memory_error_pct"])
    assert len(predicted) >= 1 and (predicted["memory_error_pct"].abs() < 10).all(), table[SHOWN]
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["pipeline"]["stages"] == 2 and optimal["tensor_parallel"]["autotp_size"] == 2
    assert "--pp 2" in said


SHOWN = ["name", "phase", "state", "predicted_memory_mib", "measured_memory_mib", "memory_error_pct", "error"]


def test_a_memory_bound_tune_leaves_out_the_stages_that_do_not_fit_and_picks_two(tmp_path):
    # A 24-block model on 2 ranks within 900 MiB a rank: whole it holds about 1090 MiB (out of memory),
    # split in two about 700 at every size, under the 810 the 10% margin leaves: only pipeline 2 fits,
    # and the memory model predicts it. Both sides keep 110-190 MiB of room, since CI's resident sets run
    # higher than this machine's: at 12 blocks (room 51 MiB) CI's first pipeline-2 launch left no other
    # size under the margin, and at 8 blocks (room 20) it pruned the one search launch.
    from conftest import experiments_table

    _, said = tune(tmp_path, 2, "tune", "--dim", "512", "--blocks", "24", train_batch_size=8,
                   zero_optimization={"stage": 0}, autotuning={"memory_per_rank_bytes": 900 * 2**20})
    table = experiments_table(tmp_path / "autotuning_results")
    assert "layout: pipeline 1: left out" in said and "out of memory" in said.split("layout: pipeline 1: left out")[1]
    assert set(table[table["pp"] == 1]["state"]) == {"oom"}, said[-3000:]
    two = table[table["pp"] == 2]
    # None of pipeline 2's runs out of memory or fails; the predictive tuner may prune one whose bound
    # cannot beat the best measured (a timing call, which the CI machine's noise can tip either way).
    shown = two[SHOWN].to_string() + "\n" + said[-3000:]
    assert set(two["state"]) <= {"ok", "pruned"} and (two["state"] == "ok").sum() >= 1, shown
    predicted = two[two["state"] == "ok"].dropna(subset=["memory_error_pct"])
    assert len(predicted) >= 1 and (predicted["memory_error_pct"].abs() < 10).all(), shown
    assert table[table["chosen"]].iloc[0]["pp"] == 2


def test_a_schedule_auto_tune_runs_1f1b_and_interleaved_1f1b_each_at_its_own_layout_and_writes_the_pick(tmp_path):
    # 4 ranks, stages [2], schedule "auto": pipeline 2 under 1F1B, and under Interleaved1F1B over 2
    # virtual stages a rank (the chunks re-place the layers, so it is a layout of its own, profiled
    # apart). The interleaved profile measures all of a rank's chunks; the pick's schedule is written.
    from conftest import experiments_table

    _, said = tune(tmp_path, 4, "tune", "--dim", "128", train_batch_size=32, zero_optimization={"stage": 0},
                   pipeline={"stages": [2], "schedule": "auto"}, autotuning={"max_train_micro_batch_size_per_gpu": 8})
    assert "layouts: searching pipeline 2, pipeline 2 (2 stages per rank) (each profiled at its own layout" in said
    table = experiments_table(tmp_path / "autotuning_results")
    assert set(table["state"]) <= {"ok", "pruned"}, table[SHOWN]
    ran = table[table["state"] == "ok"]
    assert {"z0_pp2_gas8_mbs2", "z0_pp2v2_gas8_mbs2"} <= set(ran["name"]), table[SHOWN]
    assert set(ran[ran["name"].str.contains("_pp2v2_")]["stages_per_rank"]) == {2}
    exps = tmp_path / "autotuning_exps"
    plain, chunked = (json.loads((exps / name / "model_info.json").read_text())
                      for name in ("z0_pp2_gas8_mbs2", "z0_pp2v2_gas8_mbs2"))
    assert (plain["pipeline_schedule"], plain["pipeline_stages_per_rank"]) == ("1F1B", 1)
    assert (chunked["pipeline_schedule"], chunked["pipeline_stages_per_rank"]) == ("Interleaved1F1B", 2)
    # The searched schedule is a tuned value: each launch's ranks report the one they built, and a
    # launch that built another would be failed as built otherwise, never recorded under this name.
    for name in ran["name"]:
        built = dict(json.loads((exps / name / "metrics.json").read_text())["built"])
        assert built["pipeline.schedule"] == ("Interleaved1F1B" if "_pp2v2_" in name else "1F1B"), (name, built)
    # The same layers over the same ranks (embedding and 2 blocks against blocks 0 and 2 and the
    # embedding, by parameters): each rank's chunks together hold and save what its stage does.
    assert sum(chunked["stage_num_params"]) == sum(plain["stage_num_params"])
    assert sum(chunked["stage_activation_bytes"]) == sum(plain["stage_activation_bytes"]) > 0
    assert "layout: pipeline 2 (2 stages per rank) x data parallel 2:" in said
    best = table[table["chosen"]].iloc[0]
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())["pipeline"]
    expected = ("Interleaved1F1B", 2) if "_pp2v2_" in best["name"] else ("1F1B", None)
    assert (optimal["schedule"], optimal.get("stages_per_rank")) == expected, (best["name"], optimal)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble"])
def test_an_interleaved_tune_predicts_each_stages_memory_over_its_chunks_and_trains_the_pick(tmp_path, schedule):
    # The schedule fixed: the layout searched at 2 chunks a rank, the memory model holding torch's
    # interleaved warm-up (2.5 micro-batches' worth on stage 0 at 4 micro-batches), or under the
    # zero-bubble one min(gas, stages) micro-batches' graphs awaiting their weight gradients on
    # every rank; the pick trains.
    from conftest import experiments_table

    _, said = tune(tmp_path, 4, "run", "--dim", "128", "--steps", "4", train_batch_size=32,
                   zero_optimization={"stage": 0}, pipeline={"stages": [2], "schedule": schedule},
                   autotuning={"max_train_micro_batch_size_per_gpu": 8})
    table = experiments_table(tmp_path / "autotuning_results")
    ran = table[table["state"] == "ok"]
    assert len(ran) >= 3 and all("_pp2v2_" in name for name in ran["name"]), table[SHOWN]
    predicted = ran.dropna(subset=["memory_error_pct"])
    assert len(predicted) >= 1 and (predicted["memory_error_pct"].abs() < 10).all(), table[SHOWN]
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())["pipeline"]
    assert (optimal["schedule"], optimal["stages_per_rank"], optimal["stages"]) == (schedule, 2, 2)
    assert len(losses(tmp_path)) == 4, said[-2000:]


def test_a_1f1b_launch_at_twice_the_largest_profiled_micro_batch_is_predicted_within_10_percent(tmp_path):
    # benchmarks/pipeline_memory.py's 1F1B case: sequences of 256 at width 256 over 8 blocks, so stage 0's
    # activations (2 micro-batches in flight, about 6.5 MiB a sample) are a fifth of its resident set at
    # micro-batch 8. The profile runs micro-batches 2 and 4; the grid then launches 8, predicted by a
    # line carried to twice the largest profiled size. glibc's heap held at a fixed mmap threshold
    # (as the tuner advises on a CPU): the resident set then follows the tensors.
    from conftest import experiments_table

    tune(tmp_path, 4, "tune", "--dim", "256", "--blocks", "8", "--seq", "256", train_batch_size=32,
         train_micro_batch_size_per_gpu=[2, 4, 8], zero_optimization={"stage": 0},
         pipeline={"stages": 2, "schedule": "1F1B"}, autotuning={"max_train_micro_batch_size_per_gpu": 8},
         env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    table = experiments_table(tmp_path / "autotuning_results").set_index("name")
    assert set(table["state"]) == {"ok"}, table[SHOWN[1:]]
    assert table.loc[["z0_pp2_gas8_mbs2", "z0_pp2_gas4_mbs4"], "predicted_memory_mib"].isna().all()  # the profile
    assert abs(table.loc["z0_pp2_gas2_mbs8", "memory_error_pct"]) < 10, table[SHOWN[1:]]
    # The command the tune prints trains as given: its config fixes all three batch values, counted
    # over the data-parallel size 2, as DeepSpeed's pipeline engine counts them (2 steps here).
    import shlex
    import subprocess

    from conftest import launcher_env

    command = shlex.split((tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text())
    done = subprocess.run([*command, "--steps", "2"], cwd=tmp_path, env=launcher_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and len(losses(tmp_path)) == 2, done.stderr[-3000:]


def test_what_a_pipeline_tune_cannot_run_is_refused_before_any_launch(tmp_path):
    cases = {
        "list_unmapped": ({"pipeline": {"stages": [1, 2]}}, {"arg_mappings": {}},
                          "pipeline.stages: got [1, 2]; a search of the stages needs them to reach the script"),
        "not_dividing": ({"pipeline": {"stages": [3]}}, {},
                         "pipeline.stages: 3 in [3] does not divide the number of ranks (2)"),
        "zero_3_only": ({"zero_optimization": {"stage": 3}}, {},
                        "ZeRO 2 and 3 are not supported with pipeline parallelism"),
        "v_shaped": ({"pipeline": {"stages": "auto", "schedule": "ZBVZeroBubble"}}, {},
                     "pipeline.schedule ZBVZeroBubble: a tune does not cost a V's placement"),
        "chunks_under_1f1b": ({"pipeline": {"stages": "auto", "stages_per_rank": 2}}, {},
                              "pipeline.stages_per_rank 2: schedule '1F1B' runs one stage per rank"),
        "auto_unmapped": ({"pipeline": {"schedule": "auto"}}, {"arg_mappings": {}},
                          'pipeline.schedule "auto": a tune searches the schedule with the stages'),
    }
    for name, (config, autotuning, message) in cases.items():
        done, said = tune(tmp_path / name, 2, "tune", expect=2, autotuning=autotuning, train_batch_size=8, **config)
        assert message in done.stderr and "Traceback" not in said, (name, said[-2000:])
        assert not (tmp_path / name / "autotuning_exps").exists(), name  # nothing launched


@pytest.mark.parametrize("precision, steps", [({"bf16": {"enabled": True}}, 3), ({"fp16": {"enabled": True}}, 6)],
                         ids=["bf16", "fp16"])
def test_two_stages_train_as_the_unsplit_model_in_half_precision(tmp_path, unsplit, precision, steps):
    # Each stage's forward under autocast, fp32 weights: the same ops in the same dtypes as the
    # unsplit model on our engine's ZeRO 0, so the same losses (the half precision's rounding, not
    # the split, sets the tolerance), and unlike fp32's. fp16 at DeepSpeed's initial scale 2**16:
    # the last stage's loss scaled, every stage's gradients unscaled before the clip, the first
    # steps' overflow skipping the step on every stage, the scale halved by DeepSpeed's rule, then
    # training: the unsplit engine's steps, skipped and taken.
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(whole, 1, 0, "--steps", str(steps), **precision)
    train(split, 2, 2, "--steps", str(steps), pipeline={"stages": 2}, **precision)
    got = losses(split)
    assert got == pytest.approx(losses(whole), rel=1e-3) and got[-1] < got[0]
    assert got[:3] != pytest.approx(unsplit[1][:3], rel=1e-6)  # the half precision did run (fp32's differ)
    if "fp16" in precision:
        assert got[1] == got[0], got  # the first step overflowed and was skipped: the same weights again
