"""The Slurm backend's pure parts: what scontrol says about nodes and the job, and the sbatch script."""

from __future__ import annotations

import shlex

from autotuner.execution.sbatch import sbatch_script
from autotuner.execution.slurm_runner import job_end, trial_hostfile, unusable_nodes

SHOW_NODE = ("NodeName=node1 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 State=IDLE Weights=1\n"
             "NodeName=node2 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 State=DOWN+DRAIN Weights=1\n"
             "NodeName=node3 Arch=x86_64 NodeAddr=10.0.0.3 State=MIXED Weights=1\n"
             "NodeName=node4 Arch=x86_64 NodeAddr=10.0.0.4 State=IDLE+NOT_RESPONDING Weights=1\n")


def test_down_draining_and_silent_nodes_are_unusable():
    assert unusable_nodes(SHOW_NODE) == {"node2", "node4"}


def test_a_job_runs_until_slurm_says_otherwise():
    assert job_end("JobId=7 JobName=t JobState=RUNNING Reason=None NodeList=node[1-2]", 0) is None
    assert job_end("JobId=7 JobName=t JobState=CANCELLED Reason=None", 0) == "CANCELLED"
    assert job_end("JobId=7 JobState=TIMEOUT", 0) == "TIMEOUT"
    assert job_end("", 1) == "no longer known to Slurm"


def test_the_sbatch_script_runs_the_optimal_command_on_the_tuned_node_count():
    command = "/venv/bin/launcher --nproc_per_node 4 train.py --deepspeed 'results dir/ds_config_optimal.json'"
    script = sbatch_script(command, 2, 4, "/work/my run", {"SLURM_GPUS_ON_NODE": "4"})
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash" and "#SBATCH --nodes=2" in lines and "#SBATCH --ntasks-per-node=1" in lines
    assert "#SBATCH --gpus-per-node=4" in lines
    assert "cd '/work/my run'" in lines
    assert shlex.split(lines[-1]) == ["/venv/bin/launcher", "--launcher", "slurm", "--num_nodes", "2",
                                      "--nproc_per_node", "4", "train.py", "--deepspeed",
                                      "results dir/ds_config_optimal.json"]
    module = sbatch_script("python -m autotuner --nproc_per_node 1 t.py", 1, 1, "/w", {})
    assert shlex.split(module.splitlines()[-1])[:7] == ["python", "-m", "autotuner", "--launcher", "slurm",
                                                         "--num_nodes", "1"]
    assert "--gpus-per-node" not in module
    # cmd_optimal.txt of a --backend slurm tune places its ranks already: kept as it is.
    placed = "/venv/bin/launcher --launcher slurm --num_nodes 2 --nproc_per_node 4 train.py"
    assert sbatch_script(placed, 2, 4, "/w", {}).splitlines()[-1] == placed


def test_an_experiments_hostfile_names_its_nodes_with_the_ranks_of_each():
    assert trial_hostfile(("node3", "node4"), 2) == "node3 slots=2\nnode4 slots=2\n"


def test_a_trial_and_its_result_cross_to_a_nodes_server_and_back_intact(tmp_path):
    from autotuner.config import DeepSpeedConfig
    from autotuner.execution.node_server import decode, encode, server_command
    from autotuner.tuning.space.experiment import Experiment
    from autotuner.tuning.space.records import TrialResult, TrialState
    from autotuner.tuning.trials.trial import Trial
    from fakes import experiment_settings

    trial = Trial(Experiment(1, 4), tmp_path / "z1_gas1_mbs4", experiment_settings(DeepSpeedConfig()))
    line = encode(("run", 7, trial))
    assert line.endswith(b"\n") and b"\n" not in line[:-1]  # one message, one line
    assert decode(line) == ("run", 7, trial)
    result = TrialResult(trial.experiment, TrialState.OOM, error="out of memory on rank 0")
    assert decode(encode(("result", 7, result))) == ("result", 7, result)
    # srun's own notes on the same stream are not messages
    assert decode(b"srun: Job step created\n") is None and decode(b"\n") is None
    assert server_command("/py", "train.py", ("numpy",))[2:] == ["-m", "autotuner.execution.node_server",
                                                                 "--script", "train.py", "--preload=numpy"]
