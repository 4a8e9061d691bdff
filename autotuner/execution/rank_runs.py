"""What each rank of an experiment placed on Ray runs: the command and environment a local
launch would give it (launch/plan.py), with torch elastic's per-rank variables for its place,
DeepSpeed's exports for other nodes, and the node's own GPUs and interpreter."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from autotuner.core.boundary import ERROR_DIR_ENV, REQUEST_ENV
from autotuner.execution.placement import Layout, Placement, RankPlace, RankShape, rank_variables
from autotuner.execution.ray_worker import RankRun
from autotuner.launch.nodes import exported_env
from autotuner.launch.plan import LaunchPlan, build_plan
from autotuner.core.rank_setup import QUIET_ERRORS_ENV
from autotuner.tuning.trials.trial import CONFIG_FILE, METRICS_FILE, MODEL_INFO_FILE, RANK_ERRORS_DIR, REQUEST_FILE, Trial
from autotuner.execution.trial_launch import launch_options, trial_environment

RANK_OUTPUTS = (METRICS_FILE, f"{METRICS_FILE}.oom-rank*", MODEL_INFO_FILE, f"{RANK_ERRORS_DIR}/*")
# The tuner's variables a rank needs wherever it runs (the rest of this machine's are not sent).
TRIAL_VARIABLES = (REQUEST_ENV, "PYTHONUNBUFFERED", QUIET_ERRORS_ENV, ERROR_DIR_ENV)


def trial_rank_runs(trial: Trial, placement: Placement, described: list[dict], master: str, port: int, token: str,
                    layout: Layout, shape: RankShape) -> list[RankRun]:
    """One RankRun per rank of a tuner's trial; `described`: each rank's actor (node, GPUs, python)."""
    environ = {**trial_environment(trial, dict(os.environ)), QUIET_ERRORS_ENV: "1",
               ERROR_DIR_ENV: str(trial.directory / RANK_ERRORS_DIR)}
    (trial.directory / RANK_ERRORS_DIR).mkdir(exist_ok=True)
    plan = build_plan(replace(launch_options(trial), nproc_per_node=layout.nproc_per_node, hostfile=None,
                              include=None, exclude=None), sys.executable, environ)
    inputs = {name: (trial.directory / name).read_bytes() for name in (CONFIG_FILE, REQUEST_FILE)}
    carried = {key: environ[key] for key in TRIAL_VARIABLES if key in environ}
    return [replace(rank_run(plan, place_, described, master, port, layout, shape, carried),
                    directory=str(trial.directory), token=token, inputs=inputs, output_patterns=RANK_OUTPUTS)
            for place_ in placement.ranks]


def rank_run(plan: LaunchPlan, place_: RankPlace, described: list[dict], master: str, port: int, layout: Layout,
             shape: RankShape, carried: dict | None = None) -> RankRun:
    env = {**exported_env(dict(os.environ), os.getcwd()), **(carried or {}),
           **{k: v for k, v in plan.env.items() if k != "CUDA_VISIBLE_DEVICES"},
           **rank_variables(place_, layout, master, port, plan.run_id)}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, int(shape.cpus)))  # the cores its bundle reserves
    if shape.gpus > 0:
        # As torchrun on a node: every rank there sees the node's GPUs; LOCAL_RANK picks one.
        same_node = [d for d in described if d["node_id"] == place_.node_id]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(sorted({g for d in same_node for g in d["gpu_ids"]}, key=int))
    command = tuple(arg.replace("${local_rank}", str(place_.local_rank)) for arg in plan.command)
    if command and command[0] == sys.executable:
        command = (described[place_.rank]["python"], *command[1:])  # the node's own interpreter
    return RankRun(command, env, os.getcwd(), "")
