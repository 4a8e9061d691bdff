"""LaunchOptions are typed end to end: to_argv is the inverse of the launcher's parser, and the
rank flags a tuner's launches carry over keep the order earlier runs' fingerprints hold."""

from __future__ import annotations

import random
from dataclasses import fields

import pytest

from autotuner.app.cli import _single_rank_count, build_parser
from autotuner.launch.options import LaunchOptions, RankFlags


def parsed(argv: tuple[str, ...]) -> LaunchOptions:
    args = build_parser().parse_args(list(argv))
    args.nproc_per_node = _single_rank_count(args.nproc_per_node)
    return LaunchOptions.from_args(args)


VALUES = {
    "nproc_per_node": [None, 1, 4], "num_nodes": [1, 2], "node_rank": [0, 1], "master_addr": [None, "10.0.0.1"],
    "master_port": [None, 29600], "rdzv_endpoint": [None, "head:29400"], "rdzv_id": [None, "job7"],
    "rdzv_conf": ["", "timeout=60,join_timeout=30"], "rdzv_backend": [None, "c10d", "static"], "hostfile": [None, "hosts"], "include": [None, "localhost:0,1"],
    "exclude": [None, "localhost:1"], "no_local_rank": [False, True], "bind_cores_to_rank": [False, True],
    "bind_core_list": [None, "0,2-5"], "each_rank_log_dir": [None, "logs"], "launcher": ["pdsh", "slurm"],
    "launcher_args": ["", "--account=ml", "--qos high -p debug"], "slurm_comment": [None, "run 7"],
    "force_multi": [False, True], "ssh_port": [None, 2222], "ssh_check": [True, False],
    "report_file": [None, "r.json"], "tuned_values": [None, "autotuning_results/tuned_values.json"],
}


def test_every_field_has_values_to_try():
    assert set(VALUES) == {f.name for f in fields(LaunchOptions)} - {"script", "script_args"}


@pytest.mark.parametrize("seed", range(40))
def test_to_argv_parses_back_to_the_same_options(seed):
    rng = random.Random(seed)
    options = LaunchOptions(script="train.py", script_args=("--lr", "1e-3", "--deepspeed", "ds.json"),
                            **{name: rng.choice(values) for name, values in VALUES.items()})
    assert parsed(options.to_argv()) == options


def test_defaults_give_just_the_script():
    assert LaunchOptions(script="t.py", script_args=("--a",)).to_argv() == ("t.py", "--a")


def test_rank_flags_keep_their_order_and_say_who_sets_the_rank_count():
    options = LaunchOptions(script="t.py", include="localhost:0", bind_cores_to_rank=True, bind_core_list="0-3",
                            master_port=29500)
    flags = options.rank_flags()
    # --master_port is not carried over: each launch picks its own.
    assert flags.to_argv() == ("--include", "localhost:0", "--bind_core_list", "0-3", "--bind_cores_to_rank")
    assert flags.picks_ranks_itself and not RankFlags(no_local_rank=True).picks_ranks_itself
    # A hostfile's slots: --nproc_per_node takes that many of them (DeepSpeed's --num_gpus), so the
    # settled count goes to each launch and the optimal command beside it, not dropped.
    assert not RankFlags(hostfile="hosts").picks_ranks_itself


def test_a_hostfile_with_nproc_per_node_launches_and_writes_that_many_ranks(tmp_path):
    from autotuner.config import load_config
    from autotuner.tuning.reports.optimal_commands import optimal_command
    from autotuner.tuning.trials.trial import rank_count_flags
    from fakes import experiment_settings

    settings = experiment_settings(load_config({"train_micro_batch_size_per_gpu": 2}),
                                   rank_flags=RankFlags(hostfile=str(tmp_path / "hosts")))
    assert rank_count_flags(settings) == ("--nproc_per_node", "2")
    command = optimal_command(settings, ())
    at = command.index("--nproc_per_node")
    assert command[at:at + 4] == ("--nproc_per_node", "2", "--hostfile", str(tmp_path / "hosts"))
    assert RankFlags(master_port=29600).to_argv() == ("--master_port", "29600")


def test_a_flag_given_twice_is_read_where_argparse_reads_it_the_last():
    from autotuner.launch.script_args import config_path, find_flag

    args = ("--deepspeed", "a.json", "--learning_rate", "1e-4", "--deepspeed=b.json", "--learning_rate", "3e-4")
    assert config_path(args) == "b.json"  # the script trains on b.json: tune that one
    assert find_flag(args, "--learning_rate") == (5, "3e-4")
    assert find_flag(("--x",), "--learning_rate") is None


def test_the_optimal_command_of_a_slurm_tune_trains_on_the_allocations_nodes():
    # Under --backend slurm the experiments ran as job steps on N nodes each; cmd_optimal.txt run
    # from salloc's shell (often a login node) must do the same, not train on the tuner's host.
    from autotuner.config import load_config
    from autotuner.execution.slurm_runner import SlurmRunner
    from autotuner.launch.slurm import Allocation
    from autotuner.tuning.reports.optimal_commands import optimal_command
    from fakes import experiment_settings

    runner = SlurmRunner(Allocation("7", "node[1-4]", ("node1", "node2", "node3", "node4")), 2, 2, print)
    assert runner.placement_flags == ("--launcher", "slurm", "--num_nodes", "2")
    from autotuner.tuning.trials.runner import Placement

    placement = Placement.of(runner)
    settings = experiment_settings(load_config({"train_micro_batch_size_per_gpu": 2}))
    command = optimal_command(settings, ("--deepspeed", "o.json"), placement=placement)
    at = command.index("--launcher")
    assert command[at:at + 6] == ("--launcher", "slurm", "--num_nodes", "2", "--nproc_per_node", "2")

    # DeepSpeed's own launcher trains on one node without a hostfile: its command is written for
    # one-node experiments only.
    from autotuner.tuning.reports.optimal_commands import deepspeed_command

    assert placement.nodes == 2 and Placement().nodes == 1
    assert deepspeed_command(settings, ("--deepspeed", "o.json"), False, {}, placement=placement) is None
    assert deepspeed_command(settings, ("--deepspeed", "o.json"), False, {}) is not None


def test_deepspeeds_command_runs_as_the_experiments_ran():
    # DeepSpeed's launcher leaves OMP_NUM_THREADS unset (each rank takes every core) and, under
    # --num_gpus, drops CUDA_VISIBLE_DEVICES for GPUs 0..N-1: both are written as measured.
    from autotuner.config import load_config
    from autotuner.tuning.reports.optimal_commands import deepspeed_command
    from fakes import experiment_settings

    settings = experiment_settings(load_config({"train_micro_batch_size_per_gpu": 2}))
    cpu = deepspeed_command(settings, ("--deepspeed", "o.json"), False, {"OMP_NUM_THREADS": "3"})
    assert cpu[:4] == ("env", "OMP_NUM_THREADS=3", "LOCAL_SIZE=2", cpu[3]) and cpu[3].endswith("deepspeed")
    assert cpu[4:6] == ("--num_gpus", "2")
    gpu = deepspeed_command(settings, (), True, {"CUDA_VISIBLE_DEVICES": "2,3,5", "OMP_NUM_THREADS": "8"})
    assert gpu[:2] == ("env", "OMP_NUM_THREADS=8") and gpu[3:5] == ("--include", "localhost:2,3")
    # GPUs named by UUID, or chosen by the user's own --include over them: not expressible, not written.
    assert deepspeed_command(settings, (), True, {"CUDA_VISIBLE_DEVICES": "GPU-1a,GPU-2b"}) is None
    included = experiment_settings(load_config({"train_micro_batch_size_per_gpu": 2}),
                                   rank_flags=RankFlags(include="localhost:1"))
    assert deepspeed_command(included, (), True, {"CUDA_VISIBLE_DEVICES": "2,3"}) is None
    # Without a variable of the user's, the split the experiments had.
    from autotuner.launch.plan import usable_cpus

    assert deepspeed_command(settings, (), False, {})[1] == f"OMP_NUM_THREADS={max(1, usable_cpus() // 2)}"


def test_a_ray_tunes_optimal_command_keeps_the_ranks_thread_count():
    from autotuner.config import load_config
    from autotuner.tuning.reports.optimal_commands import optimal_command
    from fakes import experiment_settings

    from autotuner.tuning.trials.runner import Placement

    settings = experiment_settings(load_config({"train_micro_batch_size_per_gpu": 2}))
    placement = Placement(env=(("OMP_NUM_THREADS", "1"),))
    assert optimal_command(settings, (), placement=placement)[:2] == ("env", "OMP_NUM_THREADS=1")
