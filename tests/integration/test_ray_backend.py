"""`launcher --autotuning tune --backend ray` on two simulated Ray nodes on this machine
(ray.cluster_utils.Cluster, one CPU each): real tuner processes driving real ranks.

Skipped when Ray is not installed (pip install 'autotuner[ray]'); CI installs it. The cluster's
own processes are this test process's children, so orphans are checked by the ranks' pid files.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from conftest import ORPHAN_GRACE_S, TOY, experiments_table, launcher_env, orphans_marked, write_config
from fault_fuzz import RAY_FAULTS, draw_cases, run_ray_case
from process_checks import wait_for

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'autotuner[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
RAY_TUNING = {"exp_timeout_s": 240, "model_info": {"num_params": 1000}, "remeasure_rounds": 0}
OBJECT_STORE = 100 * 2**20  # Ray's smallest is 75 MiB; nothing big travels through it


@pytest.fixture(scope="module")
def cluster():
    """Two nodes with one CPU each: a head and a worker."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": OBJECT_STORE,
                                                          "include_dashboard": False})
    nodes.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
    nodes.wait_for_nodes()
    yield nodes
    nodes.shutdown()


def ray_config(path: Path, micro: list[int], **autotuning) -> Path:
    return write_config(path, {**RAY_TUNING, **autotuning}, train_micro_batch_size_per_gpu=micro,
                        gradient_accumulation_steps=1)


def tune_command(config: Path, *flags: str, script_args: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "autotuner", "--autotuning", "tune", *flags, str(TOY), "--ms_per_sample", "20",
            "--steps", "6", *script_args, "--deepspeed", str(config)]


def run(work: Path, command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=work, env=launcher_env(), capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def table(work: Path) -> pd.DataFrame:
    return experiments_table(work / "autotuning_results").set_index("name")


def placement(work: Path, name: str) -> dict:
    return json.loads((work / "autotuning_exps" / name / "placement.json").read_text())


PROBE = """
import json, time, ray
ray.init(address=%r, logging_level="ERROR")
deadline = time.monotonic() + 30  # removals reach the cluster's view asynchronously
while True:
    free, total = ray.available_resources().get("CPU", 0), ray.cluster_resources().get("CPU", 0)
    if free == total or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps([free, total]))
"""


def free_cpus(address: str) -> tuple[float, float]:
    """(available, total) CPUs of the cluster, asked by a driver of its own: equal once nothing
    of ours holds any."""
    probe = PROBE
    out = subprocess.run([sys.executable, "-c", probe % address], capture_output=True, text=True, timeout=120,
                         env=launcher_env())
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def alive(pid_dir: Path) -> list[int]:
    pids = [int(p.stem) for p in pid_dir.glob("*.pid")] if pid_dir.exists() else []
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_a_two_rank_experiment_spreads_over_both_nodes_with_the_records_of_a_local_run(cluster, tmp_path):
    ray_work, local_work = tmp_path / "ray", tmp_path / "local"
    ray_work.mkdir()
    local_work.mkdir()
    run(ray_work, tune_command(ray_config(ray_work / "ds.json", [2, 4]), "--backend", "ray", "--ray_address",
                               cluster.address, "--num_nodes", "2", "--nproc_per_node", "1"))
    run(local_work, tune_command(ray_config(local_work / "ds.json", [2, 4]), "--nproc_per_node", "2"))
    for name in ("z0_gas1_mbs2", "z0_gas1_mbs4"):
        where = placement(ray_work, name)
        assert [r["node_rank"] for r in where["ranks"]] == [0, 1]
        assert len({r["node_id"] for r in where["ranks"]}) == 2  # one rank on each node
        assert where["master_addr"] == where["ranks"][0]["address"]
    on_ray, local = table(ray_work), table(local_work)
    assert list(on_ray.index) == list(local.index) and list(on_ray.state) == list(local.state) == ["ok", "ok"]
    # 20 ms of sleep per sample dominates each step: the same figure either way, within noise.
    for name in local.index:
        assert on_ray.loc[name, "metric_value"] == pytest.approx(local.loc[name, "metric_value"], rel=0.25)
    assert (ray_work / "autotuning_exps" / "z0_gas1_mbs2" / "metrics.json").exists()
    assert free_cpus(cluster.address) == (2.0, 2.0)  # every placement group and actor was removed
    # The records' device is the cluster's nodes (kinds, not load), the local run's this machine's.
    device = json.loads((ray_work / "autotuning_exps" / "z0_gas1_mbs2" / "exp.json").read_text())["fingerprint"]["device"]
    assert device == "ray nodes: CPU=1 GPU=0", device
    # The optimal command trains as the experiments ran, two nodes of one rank: a c10d rendezvous
    # at the head, the same command on each node (the multinode tests run that form).
    command = (ray_work / "autotuning_results" / "cmd_optimal.txt").read_text()
    # ... with each rank's thread count as its bundle had it (1 CPU), not the node's split.
    assert command.startswith("env OMP_NUM_THREADS=1 ") or "OMP_NUM_THREADS" in os.environ, command
    heads = {r["address"] for name in ("z0_gas1_mbs2", "z0_gas1_mbs4") for r in placement(ray_work, name)["ranks"]}
    found = re.search(r" --num_nodes 2 --rdzv_endpoint (\S+):29400 --rdzv_id autotuner-optimal --nproc_per_node 1 ",
                      command)
    assert found and found.group(1) in heads, command
    assert not json.loads((local_work / "autotuning_exps" / "z0_gas1_mbs2" / "exp.json").read_text())[
        "fingerprint"]["device"].startswith("ray nodes")


@pytest.fixture(scope="module")
def pool_run(cluster, tmp_path_factory):
    """One `--autotuning run` of the grid over four sizes on the two-slot pool, with the history and
    every launch's argv: the parallel-pool test and the training-run test assert on its outputs
    (a launch each cost about 20 s)."""
    work = tmp_path_factory.mktemp("pool_run")
    echo = work / "argv.txt"
    command = tune_command(ray_config(work / "ds.json", [2, 4, 8, 16], history=True), "--backend", "ray",
                           "--ray_address", cluster.address, "--nproc_per_node", "1",
                           script_args=("--echo_args_to", str(echo)))
    command[command.index("tune")] = "run"
    # Set up before any test's own marker: this launch carries one of its own, checked as conftest checks a test's.
    marker = f"{os.getpid()}:pool_run"
    result = subprocess.run(command, cwd=work, env={**launcher_env(), "AUTOTUNER_TEST_MARK": marker},
                            capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while (left := orphans_marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes the shared run started outlived it, orphaned: {left}"
    return work, result, echo.read_text().splitlines(), free_cpus(cluster.address)


def test_two_one_rank_experiments_run_in_parallel_on_the_two_slot_pool(pool_run):
    work, result, _, _ = pool_run
    assert "nodes exclusive, up to 2 at once" in result.stdout
    records = table(work)
    assert list(records.state) == ["ok"] * 4
    where = {name: placement(work, name) for name in records.index}
    first, second = where["z0_gas1_mbs2"], where["z0_gas1_mbs4"]  # the first batch: asked together
    assert first["ranks"][0]["node_id"] != second["ranks"][0]["node_id"]  # exclusive nodes
    assert first["master_port"] != second["master_port"]
    overlap = min(first["ended_unix"], second["ended_unix"]) - max(first["started_unix"], second["started_unix"])
    assert overlap > 0, where
    ports_in_flight = [(w["started_unix"], w["ended_unix"], w["master_port"]) for w in where.values()]
    for a in ports_in_flight:  # experiments that overlapped in time never shared a rendezvous port
        for b in ports_in_flight:
            if a is not b and min(a[1], b[1]) > max(a[0], b[0]):
                assert a[2] != b[2]


def test_the_default_tuner_runs_its_most_optimistic_candidates_at_once_on_the_two_slot_pool(cluster, tmp_path):
    # Three sizes: the first two asked are the two largest, not just every size there is.
    config = ray_config(tmp_path / "ds.json", [4, 8, 16], tuner_type="predictive")
    run(tmp_path, tune_command(config, "--backend", "ray", "--ray_address", cluster.address, "--nproc_per_node", "1"))
    records = table(tmp_path)
    # Nothing measured yet (model_info given, no profile): the two largest sizes are asked together.
    first, second = placement(tmp_path, "z0_gas1_mbs16"), placement(tmp_path, "z0_gas1_mbs8")
    assert first["ranks"][0]["node_id"] != second["ranks"][0]["node_id"]
    assert min(first["ended_unix"], second["ended_unix"]) > max(first["started_unix"], second["started_unix"])
    assert set(records.state) == {"ok"}


def test_autotuning_run_trains_the_optimum_on_the_cluster(pool_run):
    work, result, launches, cpus_after = pool_run
    assert "training with the optimal config" in result.stdout
    assert len(launches) == 5  # four experiments, then the training run with the optimum
    assert str(work / "autotuning_results" / "ds_config_optimal.json") in launches[-1]
    assert all("ds_config_optimal.json" not in launch for launch in launches[:-1])
    assert cpus_after == (2.0, 2.0)
    # The history records the cluster's launches as it does local ones (the tuner writes it).
    optuna = pytest.importorskip("optuna")
    url = f"sqlite:///{work / 'autotuning_results' / 'history.db'}"
    (study,) = optuna.get_all_study_summaries(url, include_best_trial=False)
    trials = optuna.load_study(study_name=study.study_name, storage=url).trials
    assert sorted(t.user_attrs["name"] for t in trials) == ["z0_gas1_mbs16", "z0_gas1_mbs2", "z0_gas1_mbs4",
                                                            "z0_gas1_mbs8"]


def test_ctrl_c_ends_every_rank_and_leaves_nothing_on_the_cluster(cluster, tmp_path):
    pid_dir = tmp_path / "pids"
    command = tune_command(ray_config(tmp_path / "ds.json", [2, 4], history=True), "--backend", "ray", "--ray_address",
                           cluster.address, "--nproc_per_node", "1",
                           script_args=("--hang_at_step", "2", "--pid_dir", str(pid_dir)))
    tuner = subprocess.Popen(command, cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(alive(pid_dir)) < 2 and time.monotonic() < deadline:  # both experiments' ranks hang
        time.sleep(0.5)
    assert len(alive(pid_dir)) == 2, tuner.communicate(timeout=60)
    tuner.send_signal(signal.SIGINT)
    out, err = tuner.communicate(timeout=120)
    assert tuner.returncode == 130, out[-3000:] + err[-3000:]
    assert "stopped by SIGINT" in err
    deadline = time.monotonic() + 30
    while alive(pid_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(pid_dir) == []
    assert free_cpus(cluster.address) == (2.0, 2.0)


def test_a_node_lost_mid_experiment_fails_that_experiment_only_and_tuning_goes_on(cluster, tmp_path):
    """Runs last: it removes the worker node (and adds a fresh one back)."""
    pid_dir = tmp_path / "pids"
    command = tune_command(ray_config(tmp_path / "ds.json", [2, 4, 8]), "--backend", "ray", "--ray_address",
                           cluster.address, "--nproc_per_node", "1",
                           script_args=("--fault_at_micro", "2:hang", "--hang_at_step", "2", "--pid_dir", str(pid_dir)))
    tuner = subprocess.Popen(command, cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    # The first experiment asked goes to the first node, and the head node comes last.
    started = tmp_path / "autotuning_exps" / "z0_gas1_mbs2" / "placement.json"
    deadline = time.monotonic() + 240
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert started.exists(), tuner.communicate(timeout=60)
    node_id = json.loads(started.read_text())["ranks"][0]["node_id"]
    doomed = next(node for node in cluster.list_all_nodes() if node.node_id == node_id)
    time.sleep(3)  # inside the hang (step 2) by now
    if doomed is cluster.head_node:
        pytest.skip("the hanging experiment landed on the head node, which a Cluster cannot remove")
    cluster.remove_node(doomed)
    try:
        out, err = tuner.communicate(timeout=400)
    finally:
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
    assert tuner.returncode == 0, out[-4000:] + err[-4000:]
    records = table(tmp_path)
    assert records.loc["z0_gas1_mbs2", "state"] == "failed"
    assert "Ray: " in records.loc["z0_gas1_mbs2", "error"]
    assert records.loc["z0_gas1_mbs4", "state"] == records.loc["z0_gas1_mbs8", "state"] == "ok"
    deadline = time.monotonic() + 30
    while alive(pid_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(pid_dir) == []


HOLD_NODE = """
import sys, time, ray
from ray.util.placement_group import placement_group
ray.init(address=%r, logging_level="ERROR")
group = placement_group([{"CPU": 1}], bundle_label_selector=[{"ray.io/node-id": %r}])
ray.get(group.ready(), timeout=60)
print("held", flush=True)
time.sleep(600)
"""


def test_a_node_lost_while_an_experiment_waits_for_its_placement_places_it_again_on_the_nodes_left(cluster, tmp_path):
    """Another job holds the worker node's CPU, so the first experiment's placement group, pinned
    there, waits; then the node leaves. Nothing of that experiment ran: it is placed again on the
    head and measured, rather than waiting out the placement timeout and failing."""
    worker = next(node for node in cluster.list_all_nodes() if node is not cluster.head_node)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_NODE % (cluster.address, worker.node_id)],
                              env=launcher_env(), stdout=subprocess.PIPE, text=True, start_new_session=True)
    tuner = None
    try:
        assert holder.stdout.readline().strip() == "held"
        command = tune_command(ray_config(tmp_path / "ds.json", [2, 4], tuner_type="gridsearch"), "--backend",
                               "ray", "--ray_address", cluster.address, "--nproc_per_node", "1")
        tuner = subprocess.Popen(command, cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        first = tmp_path / "autotuning_exps" / "z0_gas1_mbs2" / "stdout.log"
        wait_for(first.exists, 120, "the first experiment's directory", tuner)
        time.sleep(2)  # its placement group is pending on the held node by now
        assert not (first.parent / "placement.json").exists(), "the experiment started on the held node"
        cluster.remove_node(worker)
        out, err = tuner.communicate(timeout=100)  # well inside the 120 s placement timeout
    finally:
        if tuner is not None and tuner.poll() is None:
            tuner.kill()
            tuner.wait()
        holder.kill()
        holder.wait()
        if len(cluster.list_all_nodes()) < 2:
            cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
            cluster.wait_for_nodes()
    assert tuner.returncode == 0, out[-4000:] + err[-4000:]
    assert "z0_gas1_mbs2: node(s) " in out + err and "left the cluster before its ranks started; it is placed again " \
        "on the nodes left" in out + err, out[-3000:] + err[-3000:]
    records = table(tmp_path)
    assert (records.state == "ok").all(), records[["state", "error"]]
    head = cluster.head_node.node_id
    assert [r["node_id"] for r in placement(tmp_path, "z0_gas1_mbs2")["ranks"]] == [head]
    assert free_cpus(cluster.address) == (2.0, 2.0)


RAY_FUZZ_SEED = int(os.environ.get("AUTOTUNER_FAULT_FUZZ_SEED") or random.SystemRandom().randrange(1, 10**6))
RAY_TUNE_LENGTH_S = 12.0  # the fuzz tune's clean length on 2 cores (11 s measured): instants are drawn up to it
# One case a run (each costs about 25 s): its fault is the first of the three shuffled by the seed,
# which differs every run, so every fault kind is drawn over runs (and any fault replays by its seed).
RAY_CASES = draw_cases(RAY_FUZZ_SEED, 1, {"ray": RAY_TUNE_LENGTH_S}, ("ray",), RAY_FAULTS)


@pytest.mark.parametrize("case", RAY_CASES, ids=[f"seed{RAY_FUZZ_SEED}-case{c.index}-{c.fault}-{c.delay_s:.1f}s"
                                                 for c in RAY_CASES])
def test_a_node_lost_or_the_tuner_stopped_at_a_random_instant_leaves_nothing_behind(cluster, tmp_path, case):
    """Replays with AUTOTUNER_FAULT_FUZZ_SEED=S (the seed is in the test id)."""
    def lose_node():
        worker = next(node for node in cluster.list_all_nodes() if node is not cluster.head_node)
        cluster.remove_node(worker)

    try:
        outcome = run_ray_case(case, tmp_path / "run", cluster.address, lose_node, RAY_TUNE_LENGTH_S)
    finally:
        if len(cluster.list_all_nodes()) < 2:
            cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
            cluster.wait_for_nodes()
    assert outcome.ok, f"{case.describe(RAY_FUZZ_SEED)}: " + " | ".join(outcome.problems)
    assert free_cpus(cluster.address) == (2.0, 2.0)
