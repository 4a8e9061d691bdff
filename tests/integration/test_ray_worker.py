"""The Ray rank worker's own class, without Ray: a rank on a node that does not share the tuner's
filesystem gets the trial's inputs and sends back the files it wrote (a real rank process)."""

from __future__ import annotations

import sys

from autotuner.execution.ray_worker import TOKEN_FILE, RankRun, RankWorker

RANK = """
import json, os, pathlib
here = pathlib.Path(os.environ["EXP_DIR"])
config = json.loads((here / "ds_config.json").read_text())
(here / "metrics.json").write_text(json.dumps({"micro": config["train_micro_batch_size_per_gpu"]}))
(here / "rank_errors").mkdir(exist_ok=True)
(here / "rank_errors" / "rank0.json").write_text("{}")
(here / "scratch.bin").write_text("not an output")
print("rank says hi")
"""


def spec(directory, token="t1", **changes) -> RankRun:
    values = dict(command=(sys.executable, "-c", RANK), env={"EXP_DIR": str(directory)}, cwd=str(directory.parent),
                  directory=str(directory), token=token,
                  inputs={"ds_config.json": b'{"train_micro_batch_size_per_gpu": 4}'},
                  output_patterns=("metrics.json", "rank_errors/*"))
    return RankRun(**{**values, **changes})


def test_a_node_without_the_directory_gets_the_inputs_and_returns_the_outputs_then_cleans_up(tmp_path):
    remote = tmp_path / "node" / "exps" / "z0_gas1_mbs4"  # the tuner's path, absent on this "node"
    (tmp_path / "node").mkdir()
    outcome = RankWorker().run(0, spec(remote, cwd=str(tmp_path)))
    assert outcome.status == 0 and outcome.error is None
    assert outcome.files == {"metrics.json": b'{"micro": 4}', "rank_errors/rank0.json": b"{}"}
    assert outcome.stdout == b"rank says hi\n"
    assert not (tmp_path / "node" / "exps").exists()  # what the worker made is removed again


def test_a_node_sharing_the_directory_runs_in_place_and_returns_no_files(tmp_path):
    shared = tmp_path / "exps" / "z0_gas1_mbs4"
    shared.mkdir(parents=True)
    (shared / TOKEN_FILE).write_text("t1")
    (shared / "ds_config.json").write_text('{"train_micro_batch_size_per_gpu": 8}')
    outcome = RankWorker().run(0, spec(shared, inputs={}))
    assert outcome.status == 0 and outcome.files == {}
    assert (shared / "metrics.json").read_text() == '{"micro": 8}'


def test_stale_outputs_on_a_node_are_removed_before_the_rank_runs(tmp_path):
    remote = tmp_path / "exps" / "z0"
    remote.mkdir(parents=True)  # left over on the node, without this trial's token
    (remote / "metrics.json").write_text("stale")
    failing = (sys.executable, "-c", "raise SystemExit(3)")
    outcome = RankWorker().run(1, spec(remote, command=failing))
    assert outcome.status == 3 and outcome.files == {}
    assert not (remote / "metrics.json").exists()
