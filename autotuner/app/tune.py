"""`launcher --autotuning tune|run`: settle the request, lock the results, tune, then maybe train."""

from __future__ import annotations

import fcntl
import os
import shlex
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from autotuner.app.request import TuneRequest
from autotuner.app.settle import say as _say, settle, settle_built_engine, tuning_job
from autotuner.tuning.reports.batch_ramp_plan import ramp_lines
from autotuner.core.errors import UsageError
from autotuner.launch.stopping import Stopped
from autotuner.tuning.orchestrator import Autotuner
from autotuner.tuning.reports.plan_table import plan_text, write_plan
from autotuner.tuning.trials.evaluator import TuningFailed
from autotuner.tuning.trials.runner import Placement
from autotuner.execution.forkserver import Forkserver
from autotuner.execution.backends import RunnerRequest, backend_spec


@contextmanager
def exclusive_lock(results_dir: Path):
    """One tuner per results_dir: a second one started while this runs is refused."""
    results_dir.mkdir(parents=True, exist_ok=True)
    handle = open(results_dir / ".lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UsageError(f"autotuning.results_dir: {results_dir} is in use by another tuner (locked); "
                         "wait for it or choose another results_dir") from None
    try:
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _plan(tuner: Autotuner, results_dir: Path) -> int:
    report = tuner.plan()
    print(plan_text(report), end="")
    _say(f"plan written to {write_plan(results_dir, report)}")
    return 0


def autotune(request: TuneRequest, forkserver: Forkserver | None = None) -> int:
    """`forkserver`: the warm path's, started early by the command line (it preloads meanwhile)."""
    settled = settle(request)
    results_dir, exps_dir = settled.results_dir, settled.exps_dir
    info = settled.config.autotuning.model_info
    if request.mode == "plan" and info is not None and info.num_params:
        raise UsageError(f"--autotuning plan: {settled.source}'s autotuning.model_info.num_params skips the profile "
                         "launches, so no step is measured to predict the others from; drop model_info.num_params "
                         "to plan")
    spec = backend_spec(request.backend.backend)
    runner_request = RunnerRequest(request.backend, settled.config.autotuning, settled.settings, settled.num_nodes,
                                   _say, forkserver)
    with spec.open_runner(runner_request) as runner:
        # Where the runner places the experiments (a cluster's nodes) goes into the job before it is
        # built: the device a resume is checked against, and where the optimal command trains.
        job = tuning_job(settled, Placement.of(runner))
        with exclusive_lock(results_dir):
            try:
                tuner = Autotuner(job, results_dir, exps_dir, runner, report=_say,
                                  settle_engine=lambda built: settle_built_engine(settled, built))
                if request.mode == "plan":
                    return _plan(tuner, results_dir)
                outcome = tuner.tune()
            except Stopped as stop:  # the runner's exit below ends the running experiment
                hint = getattr(stop, "resume_hint", "Resume with the same command.")
                print(f"autotuner: stopped by {stop.name}; running experiment ended, finished records kept in "
                      f"{exps_dir}. {hint}", file=sys.stderr, flush=True)
                stop.reported = True
                raise
        print(outcome.summary, end="")
        if outcome.best is None:
            raise TuningFailed(f"no experiment succeeded ({len(outcome.results)} recorded); see "
                               f"{results_dir}/experiments.csv and each experiment's stderr.log under {exps_dir}")
        _say(f"{outcome.best.name} is the optimal setup; config: {outcome.optimal_config_path}")
        where = f" (on each of the {settled.num_nodes} nodes)" if job.placement.rendezvous else ""
        _say(f"train with it{where}: {shlex.join(outcome.optimal_command or ())}")
        if spec.write_outputs is not None:
            for line in spec.write_outputs(runner_request, results_dir):
                _say(line)
        if outcome.deepspeed_command is not None:
            other = shlex.join(outcome.deepspeed_command)
            whose = "accelerate's" if " launch --use_deepspeed " in other else "DeepSpeed's"
            _say(f"or with {whose} own launcher: {other}")
        if request.mode == "tune":
            return 0
        _say("training with the optimal config ...")
        optimal = replace(settled.options, script_args=outcome.optimal_script_args,
                          nproc_per_node=None if settled.options.rank_flags().picks_ranks_itself
                          else settled.plan.nproc_per_node,
                          tuned_values=None if outcome.tuned_values_path is None else str(outcome.tuned_values_path))
        status = runner.train(optimal, quiet=not request.debug)
        for line in ramp_lines(results_dir):
            _say(line)
        tuner.keep_late_noise()
        return status
