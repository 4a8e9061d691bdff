"""`--backend ray`: each experiment is a Ray placement group, one bundle per rank, on a cluster
the user already runs (`--ray_address`) or on a Ray instance started here for the run.

The runner places each experiment itself (cluster/placement.py) and pins every bundle to its
node by Ray's node-id label, so exclusive nodes are a guarantee, not a hope. Ranks are started by
`RankWorker` actors inside the bundles, with the command and environment a local launch would
give them; the first rank's node hosts the rendezvous, on a port that no other experiment running
there holds. Several experiments run at once when the cluster has room (`capacity`): the search
`submit`s them and takes results in the order they finish (`next_result`).

A rank that fails, or a node that is lost, fails only its experiment; the others' ranks are
stopped. A node lost before any rank of an experiment started (its placement group or actors
still waiting there) fails nothing: the experiment is placed again on the nodes left. Every actor and placement group is removed when its experiment ends and again in
`close`, on every path out of the tuner; a Ray instance started here is shut down.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

import autotuner
from autotuner.execution.placement import (EXCLUSIVE, ClusterNode, Layout, Placement, RankShape, concurrency, feasible,
                                         node_kinds, place, rendezvous_flags, taken)
from autotuner.execution.rank_runs import rank_run, trial_rank_runs
from autotuner.execution.ray_trial_files import (PLACEMENT_FILE, RunningTrial, finished_result, unplaced_result,
                                                 write_placement)
from autotuner.execution.ray_worker import TOKEN_FILE, RankWorker
from autotuner.core.errors import UsageError
from autotuner.launch.options import LaunchOptions
from autotuner.launch.plan import build_plan
from autotuner.launch.stopping import GRACE_S, install_stop_handlers, mark_work_started, raise_if_stopped
from autotuner.tuning.trials.trial import Trial
from autotuner.execution.trial_launch import prepare
from autotuner.tuning.space.records import TrialResult

POLL_S = 0.2
PLACEMENT_TIMEOUT_S = 120.0  # a placement group the cluster said it can hold must be ready by then
NODE_CHECK_S = 1.0  # while a placement waits: how often the nodes it is pinned to are checked
STOP_WAIT_S = 20.0  # after a rank failed: how long the others get to end before their actors are killed
NODE_ID_LABEL = "ray.io/node-id"
HEAD_RESOURCE = "node:__internal_head__"
READY, TIMED_OUT, NODE_LOST = "ready", "timed out", "node lost"  # what a wait for a placement ended with


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: start Ray here for this run
    placement: str = EXCLUSIVE
    max_concurrent: int | None = None
    cpus_per_rank: float = 1.0
    gpus_per_rank: float | None = None  # None: 1 when the cluster has GPUs, else 0
    num_nodes: int = 1


def require_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--backend ray: Ray is not installed; pip install 'autotuner[ray]'") from None
    return ray


class RayRunner:
    name = "ray"

    def __init__(self, options: RayOptions, nproc_per_node: int, report: Callable[[str], None] = print):
        ray = require_ray()
        self._ray = ray
        self._report = report
        self._options = options
        self._started_ray = options.address is None
        try:
            # Our package travels with the job, so every node's workers and ranks run this very
            # version of it (the script, its Python and libraries must be on the nodes already).
            ray.init(address=options.address, include_dashboard=False, log_to_driver=True, logging_level="ERROR",
                     configure_logging=True, runtime_env={"py_modules": [str(Path(autotuner.__file__).parent)]})
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise UsageError(f"--ray_address {options.address}: cannot connect to a Ray cluster there ({err})") from None
        install_stop_handlers()  # ray.init made SIGTERM a bare sys.exit: our stop path ends the experiments
        mark_work_started()  # the cluster's actors are ours to end, though no local process is
        self._worker_class = ray.remote(RankWorker)
        self._nodes = self._live_nodes()
        reported = self._ray.nodes()
        self.hardware = node_kinds(reported)
        gpus = options.gpus_per_rank
        if gpus is None:
            gpus = 1.0 if any(n.gpus for n in self._nodes) else 0.0
        self.shape = RankShape(options.cpus_per_rank, gpus)
        self.layout = Layout(options.num_nodes, nproc_per_node)
        why = feasible(self._nodes, self.layout, self.shape)
        if why is not None:
            self.close()
            raise UsageError(f"--backend ray: the experiments cannot be placed: {why}")
        # The optimal command's rendezvous at the head node, whose control processes every node reaches.
        head = next((node.get("NodeManagerAddress") for node in reported
                     if node.get("Alive") and HEAD_RESOURCE in node.get("Resources", {})), None)
        self.placement_flags = rendezvous_flags(options.num_nodes, head or self._nodes[0].address)
        # Each rank's threads were its bundle's CPUs (rank_runs.py); a plain launch would split the node's.
        self.placement_env = () if "OMP_NUM_THREADS" in os.environ else (
            ("OMP_NUM_THREADS", str(max(1, int(self.shape.cpus)))),)
        self.capacity = concurrency(self._nodes, self.layout, self.shape, options.placement, options.max_concurrent)
        where = "a Ray instance started for this run" if self._started_ray else f"the Ray cluster at {options.address}"
        report(f"ray: {where}: {len(self._nodes)} node(s), {sum(n.cpus for n in self._nodes):g} CPU(s), "
               f"{sum(n.gpus for n in self._nodes):g} GPU(s); each experiment {self.layout.num_nodes} node(s) x "
               f"{self.layout.nproc_per_node} rank(s), nodes {options.placement}, up to {self.capacity} at once")
        self._waiting: deque[Trial] = deque()
        self._running: list[RunningTrial] = []
        self._finished: deque[tuple[Trial, TrialResult]] = deque()
        self._used: dict[str, int] = {}
        self._ports: dict[str, set[int]] = {}

    # ----- the cluster -----
    def _live_nodes(self) -> list[ClusterNode]:
        nodes, heads = [], []
        for node in self._ray.nodes():
            if not node.get("Alive"):
                continue
            resources = node.get("Resources", {})
            nodes.append(ClusterNode(node["NodeID"], node.get("NodeManagerAddress", ""), resources.get("CPU", 0.0),
                                     resources.get("GPU", 0.0)))
            heads.append(HEAD_RESOURCE in resources)
        # The head node runs Ray's own control processes: experiments go there last.
        return [node for _, node in sorted(zip(heads, nodes), key=lambda pair: pair[0])]

    # ----- one trial -----
    def run(self, trial: Trial) -> TrialResult:
        self.submit(trial)
        return self.next_result()[1]

    def submit(self, trial: Trial) -> None:
        prepare(trial)
        (trial.directory / PLACEMENT_FILE).unlink(missing_ok=True)
        (trial.directory / "stdout.log").write_bytes(b"")
        (trial.directory / "stderr.log").write_bytes(b"")
        self._waiting.append(trial)
        self._start_waiting()

    def next_result(self) -> tuple[Trial, TrialResult]:
        """The next experiment to finish, in the order they finish."""
        while not self._finished:
            if not self._running and not self._waiting:
                raise RuntimeError("next_result with nothing submitted")
            self._poll()
            self._start_waiting()
        return self._finished.popleft()

    def _start_waiting(self) -> None:
        while self._waiting:
            self._nodes = self._live_nodes()
            trial = self._waiting[0]
            why = feasible(self._nodes, self.layout, self.shape)
            if why is not None:  # nodes were lost: it would wait forever
                self._waiting.popleft()
                self._finish_unplaced(trial, f"the cluster can no longer hold it: {why}")
                continue
            if len(self._running) >= self.capacity:
                return
            placement = place(self._nodes, self._used, self.layout, self.shape, self._options.placement)
            if placement is None:
                return
            self._waiting.popleft()
            self._start(trial, placement)

    def _start(self, trial: Trial, placement: Placement) -> None:
        ray = self._ray
        pinned = {rank.node_id for rank in placement.ranks}
        group = self._group(placement)
        waited = self._wait_while_pinned_nodes_live([group.ready()], pinned)
        if waited != READY:
            ray.util.remove_placement_group(group)
            if waited == NODE_LOST:
                self._place_again(trial, placement)
            else:
                self._finish_unplaced(trial, f"its placement group was not ready within {PLACEMENT_TIMEOUT_S:.0f} s")
            return
        workers = self._actors(group, placement)
        self._hold(placement)
        running = RunningTrial(trial, placement, group, workers, {}, time.monotonic(), 0)
        self._running.append(running)
        lost = False
        try:
            describing = [w.describe.remote() for w in workers]
            lost = self._wait_while_pinned_nodes_live(describing, pinned) == NODE_LOST
            if not lost:  # ready, or past PLACEMENT_TIMEOUT_S already: no second wait
                described = _interruptible(ray.get, describing, timeout=0)
                master = described[0]["address"]
                running.port = _interruptible(ray.get, workers[0].free_port.remote(sorted(self._ports.get(master, ()))),
                                              timeout=PLACEMENT_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - an actor that never came up fails this trial only
            lost = not self._pinned_nodes_live(pinned)
            if not lost:
                running.lost[0] = f"its ranks' actors did not start ({type(err).__name__}: {err})"
                running.stopping_since = time.monotonic()
                return
        if lost:
            self._release(running)
            self._place_again(trial, placement)
            return
        self._ports.setdefault(master, set()).add(running.port)
        write_placement(running, ended=False)
        token = uuid.uuid4().hex
        (trial.directory / TOKEN_FILE).write_text(token)
        specs = trial_rank_runs(trial, placement, described, master, running.port, token, self.layout, self.shape)
        running.pending = {w.run.remote(rank, spec): rank for rank, (w, spec) in enumerate(zip(workers, specs))}

    def _wait_while_pinned_nodes_live(self, refs: list, pinned: set[str]) -> str:
        """Wait for every ref (a placement group's readiness, its actors' first answers) up to
        PLACEMENT_TIMEOUT_S: READY, TIMED_OUT, or NODE_LOST as soon as a node the bundles are
        pinned to has left the cluster (a bundle pinned there would never be placed)."""
        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        while True:
            ready, _ = _interruptible(self._ray.wait, refs, num_returns=len(refs), timeout=NODE_CHECK_S)
            if len(ready) == len(refs):
                return READY
            if not self._pinned_nodes_live(pinned):
                return NODE_LOST
            if time.monotonic() > deadline:
                return TIMED_OUT

    def _pinned_nodes_live(self, pinned: set[str]) -> bool:
        return pinned <= {node.node_id for node in self._live_nodes()}

    def _place_again(self, trial: Trial, placement: Placement) -> None:
        """A node of the placement left the cluster before any rank started: nothing ran, so the
        experiment waits again, first in line, for the nodes left (or fails unplaced if they
        cannot hold it)."""
        live = {node.node_id for node in self._live_nodes()}
        lost = sorted({f"{r.node_id[:8]} ({r.address})" for r in placement.ranks if r.node_id not in live})
        self._report(f"ray: {trial.experiment.name}: node(s) {', '.join(lost)} left the cluster before its ranks "
                     "started; it is placed again on the nodes left")
        self._waiting.appendleft(trial)

    def _group(self, placement: Placement):
        """The placement group: one bundle per rank, each pinned to its node by Ray's node-id label."""
        from ray.util.placement_group import placement_group

        return placement_group([self.shape.bundle() for _ in placement.ranks], strategy="PACK",
                               bundle_label_selector=[{NODE_ID_LABEL: r.node_id} for r in placement.ranks])

    def _actors(self, group, placement: Placement) -> list:
        """One RankWorker per bundle (threaded: `stop` must reach it while `run` blocks)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return [self._worker_class.options(
            num_cpus=self.shape.cpus, num_gpus=self.shape.gpus, max_concurrency=2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)).remote()
            for index in range(len(placement.ranks))]

    def _hold(self, placement: Placement) -> None:
        for node_id, slots in taken(placement, self._options.placement, self._nodes, self.shape).items():
            self._used[node_id] = self._used.get(node_id, 0) + slots

    # ----- waiting -----
    def _poll(self) -> None:
        raise_if_stopped()
        ray = self._ray
        refs = [ref for running in self._running for ref in running.pending]
        if refs:
            _interruptible(ray.wait, refs, num_returns=1, timeout=POLL_S)
        else:
            time.sleep(POLL_S)
        now = time.monotonic()
        for running in list(self._running):
            for ref in [ref for ref in running.pending]:
                ready, _ = _interruptible(ray.wait, [ref], timeout=0)
                if not ready:
                    continue
                rank = running.pending.pop(ref)
                try:
                    running.outcomes[rank] = _interruptible(ray.get, ref)
                except Exception as err:  # noqa: BLE001 - the actor or its node died
                    running.lost[rank] = _lost_text(err)
                if running.first_failed is None and (rank in running.lost or running.outcomes[rank].status != 0):
                    running.first_failed = rank
            failed = running.lost or any(o.status != 0 for o in running.outcomes.values())
            if running.stopping_since is None and now - running.started > running.trial.settings.timeout_s:
                running.timed_out = True
            if running.stopping_since is None and (failed or running.timed_out) and running.pending:
                running.stopping_since = now
                for worker in running.workers:
                    worker.stop.remote()  # the ranks' sessions; the actors stay to report
            overdue = running.stopping_since is not None and now - running.stopping_since > STOP_WAIT_S
            if not running.pending or overdue:
                self._finalize(running)

    def _finalize(self, running: RunningTrial) -> None:
        self._release(running)
        self._finished.append((running.trial, finished_result(running, time.monotonic() - running.started)))

    def _release(self, running: RunningTrial) -> None:
        for node_id, slots in taken(running.placement, self._options.placement, self._nodes, self.shape).items():
            self._used[node_id] = max(0, self._used.get(node_id, 0) - slots)
        if running.port:
            self._ports.get(running.placement.master.address, set()).discard(running.port)
        self._remove(running)
        self._running.remove(running)

    def _remove(self, running: RunningTrial) -> None:
        for worker in running.workers:
            try:
                self._ray.kill(worker)
            except Exception:  # noqa: BLE001 - already dead with its node
                pass
        try:
            self._ray.util.remove_placement_group(running.group)
        except Exception:  # noqa: BLE001
            pass

    def _finish_unplaced(self, trial: Trial, why: str) -> None:
        self._finished.append((trial, unplaced_result(trial, why)))

    # ----- the optimum's training run, and the end -----
    def train(self, options: LaunchOptions, quiet: bool) -> int:
        """The user's job on the cluster, placed as an experiment was, to its end; the ranks'
        output reaches this terminal through Ray's log forwarding."""
        ray = self._ray
        self._nodes = self._live_nodes()
        why = feasible(self._nodes, self.layout, self.shape)
        if why is not None:
            raise UsageError(f"--backend ray: the training run cannot be placed: {why}")
        # Every experiment has ended, so the cluster is free and a feasible layout has a place.
        placement = place(self._nodes, self._used, self.layout, self.shape, self._options.placement)
        if placement is None:
            raise UsageError("--backend ray: the training run cannot be placed on the free nodes")
        group = self._group(placement)
        _interruptible(ray.get, group.ready())
        workers = self._actors(group, placement)
        running = RunningTrial(None, placement, group, workers, {}, time.monotonic(), 0)  # type: ignore[arg-type]
        self._running.append(running)
        self._hold(placement)
        try:
            described = _interruptible(ray.get, [w.describe.remote() for w in workers])
            master = described[0]["address"]
            port = _interruptible(ray.get, workers[0].free_port.remote([]))
            plan = build_plan(replace(options, nproc_per_node=self.layout.nproc_per_node, hostfile=None, include=None,
                                      exclude=None), sys.executable)
            runs = [replace(rank_run(plan, p, described, master, port, self.layout, self.shape), live=True)
                    for p in placement.ranks]
            refs = [w.run.remote(p.rank, spec) for w, p, spec in zip(workers, placement.ranks, runs)]
            statuses = [outcome.status for outcome in _interruptible(ray.get, refs)]
        finally:
            self._release(running)
        return max(statuses, default=0)

    def close(self) -> None:
        """Every running experiment's ranks are asked to stop at once, and waited for within the
        grace period; then their actors and placement groups go, and a Ray we started is shut down."""
        with contextlib.suppress(Exception):  # actors already lost with their node
            stops = [worker.stop.remote() for running in self._running for worker in running.workers]
            if stops:
                self._ray.wait(stops, num_returns=len(stops), timeout=GRACE_S + 1.0)
        for running in list(self._running):
            self._remove(running)
        self._running.clear()
        if self._ray.is_initialized():
            self._ray.shutdown()


def _interruptible(call: Callable, *args, **kwargs):
    """A blocking Ray call through which Ctrl-C and SIGTERM still stop the tuner: the handlers'
    exception, raised inside Ray's compiled code, comes out as a SystemError caused by it."""
    try:
        return call(*args, **kwargs)
    except SystemError as err:
        cause = err.__cause__ or err.__context__
        if isinstance(cause, BaseException) and not isinstance(cause, Exception):
            raise cause from None
        raise


def _lost_text(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    detail = next((line for line in text if "died" in line.lower() or "node" in line.lower()), text[0] if text else "")
    return f"its actor died ({type(err).__name__}): {detail[:300]}"
