"""What a Ray experiment leaves in its directory, as every runner's launches do: each rank's output
in rank order, the files ranks on other filesystems wrote, where and when it ran
(placement.json), and the launcher's report that `judge` reads. Nothing here talks to Ray."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from autotuner.core.atomic import write_json_atomic
from autotuner.core.boundary import write_record
from autotuner.core.launch_records import LaunchReport
from autotuner.execution.placement import Placement
from autotuner.execution.ray_worker import TOKEN_FILE, RankOutcome
from autotuner.execution.trial_launch import judge
from autotuner.launch.elastic import failure_lines, failure_report
from autotuner.tuning.space.records import TrialResult
from autotuner.tuning.trials.trial import RANK_ERRORS_DIR, Trial

PLACEMENT_FILE = "placement.json"  # where each rank ran, the rendezvous, and when


@dataclass
class RunningTrial:
    """One experiment on the cluster, from its placement to its end."""

    trial: Trial
    placement: Placement
    group: Any  # the placement group
    workers: list
    pending: dict  # ObjectRef -> rank
    started: float
    port: int
    started_unix: float = field(default_factory=time.time)
    outcomes: dict = field(default_factory=dict)  # rank -> RankOutcome
    lost: dict = field(default_factory=dict)  # rank -> why its actor died
    stopping_since: float | None = None
    timed_out: bool = False
    first_failed: int | None = None  # the rank seen to fail first: the cause, as elastic's agent reports it


def finished_result(running: RunningTrial, wall: float) -> TrialResult:
    """The experiment's result once every rank has ended (or was given up on): its files
    written, its report recorded, then judged as every runner's launches are."""
    trial = running.trial
    for rank in running.pending.values():
        running.lost.setdefault(rank, "did not end after its peers failed; its actor was killed")
    gather(running)
    hosts = tuple(dict.fromkeys(r.address for r in running.placement.ranks))  # the nodes, by address
    if running.timed_out:
        return replace(judge(trial, None, True, wall), hosts=hosts)
    statuses = {rank: o.status for rank, o in running.outcomes.items() if o.status != 0}
    statuses.update({rank: 1 for rank in running.lost})
    if not statuses:
        report = LaunchReport(exit_code=0)
    else:
        error_dir = str(trial.directory / RANK_ERRORS_DIR)
        first = running.first_failed if running.first_failed is not None else min(statuses)
        if first in running.lost:
            report = LaunchReport(1, first, None, f"Ray: {running.lost[first]}")
        else:
            report = failure_report(error_dir, first, statuses)
        with open(trial.directory / "stderr.log", "a") as log:
            log.writelines(line + "\n" for line in failure_lines(error_dir, report, statuses, quiet=True))
    write_record(trial.report_path, report)
    return replace(judge(trial, report.exit_code, False, wall), hosts=hosts)


def gather(running: RunningTrial) -> None:
    """Each rank's output, in rank order, the files ranks on other filesystems wrote, and
    where and when it ran (placement.json)."""
    trial = running.trial
    write_placement(running, ended=True)
    with open(trial.directory / "stdout.log", "ab") as out, open(trial.directory / "stderr.log", "ab") as err:
        for rank in sorted(running.outcomes):
            outcome: RankOutcome = running.outcomes[rank]
            out.write(outcome.stdout)
            err.write(outcome.stderr)
            if outcome.error:
                err.write(f"ray: rank {rank} did not start: {outcome.error}\n".encode())
            for name, content in outcome.files.items():
                path = trial.directory / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content)
        for rank, why in sorted(running.lost.items()):
            err.write(f"ray: rank {rank}: {why}\n".encode())
    (trial.directory / TOKEN_FILE).unlink(missing_ok=True)


def unplaced_result(trial: Trial, why: str) -> TrialResult:
    """An experiment the cluster can no longer hold: failed, with why in its files."""
    report = LaunchReport(1, None, None, f"Ray: {why}")
    write_record(trial.report_path, report)
    with open(trial.directory / "stderr.log", "a") as log:
        log.write(f"ray: {trial.experiment.name} not run: {why}\n")
    result = judge(trial, 1, False, 0.0)
    return replace(result, error=f"not placed on the Ray cluster: {why}")


def write_placement(running: RunningTrial, ended: bool) -> None:
    """placement.json: where each rank runs and the rendezvous; written at the start (no end time
    yet) and again at the end."""
    write_json_atomic(running.trial.directory / PLACEMENT_FILE, {
        "ranks": [{"rank": r.rank, "local_rank": r.local_rank, "node_rank": r.node_rank, "node_id": r.node_id,
                   "address": r.address} for r in running.placement.ranks],
        "master_addr": running.placement.master.address, "master_port": running.port,
        "started_unix": running.started_unix, "ended_unix": time.time() if ended else None})
