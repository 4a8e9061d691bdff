"""Shared helpers: write a config, run the launcher (or tune the toy script) as a real process,
and check nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
MINIMAL = ROOT / "examples" / "minimal" / "train.py"
CONFIGS = ROOT / "configs"
TOY = WORKERS / "toy_train.py"
TOY_MAPPINGS = {"train_micro_batch_size_per_gpu": "--micro_batch_size",
                "gradient_accumulation_steps": "--gradient_accumulation_steps"}
# The grid search unless a test names its tuner: most tuning tests check its rules and count its
# launches in order (the predictive default has its own tests), over a 2-step window. No final
# re-measurement unless a test asks for it: the toy's sub-millisecond steps sit within its noise,
# so every tune would add up to 3 rounds of launches that test nothing of its own.
# The history database costs about 0.6 s a tuning run (optuna's schema): off for the toy tunes that
# do not test it (test_history.py, test_autotune_e2e.py and test_ray_backend.py do).
TOY_AUTOTUNING = {"enabled": True, "arg_mappings": TOY_MAPPINGS, "start_profile_step": 2, "end_profile_step": 4,
                  "exp_timeout_s": 120, "tuner_type": "gridsearch", "remeasure_rounds": 0, "history": False}
REMEASURED = {"remeasure_rounds": 3}  # more than the default 1: the final pick re-measured round after round


def experiments_table(results_dir: Path) -> pd.DataFrame:
    """A tune's experiments.csv (every launch a row, re-measurements included) from its results folder."""
    return pd.read_csv(results_dir / "experiments.csv")


def write_json(path: Path, config: dict) -> Path:
    path.write_text(json.dumps(config))
    return path


def write_config(path: Path, autotuning: dict | None = None, *, tuning_defaults: dict | None = None, **top) -> Path:
    """ds.json to tune the toy script: AdamW, ZeRO 0, the micro-batch searched, TOY_AUTOTUNING.
    `top` replaces top-level keys; `tuning_defaults` (a test file's own) then `autotuning`
    override the autotuning section key by key."""
    config = {"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
              "zero_optimization": {"stage": 0}, **top,
              "autotuning": {**TOY_AUTOTUNING, **(tuning_defaults or {}), **(autotuning or {})}}
    return write_json(path, config)


def launcher_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONWARNINGS", "ignore")
    # A rank that aborts in C++ ("terminate called without an active exception", status 134; seen
    # once in CI, never reproduced here) then prints every thread's Python stack, to find where.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def run_launcher(*args: str, timeout: float = 180, cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m autotuner ARGS` as a real process; its output is returned as text."""
    return subprocess.run(
        [sys.executable, "-m", "autotuner", *map(str, args)],
        cwd=cwd or ROOT,
        env=env or launcher_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tune_command(config: Path, *script_args: str, script: Path = TOY, mode: str = "tune",
                 nproc_per_node: int = 2) -> list[str]:
    return [sys.executable, "-m", "autotuner", "--autotuning", mode, "--nproc_per_node", str(nproc_per_node),
            str(script), *map(str, script_args), "--deepspeed", str(config)]


def tune(cwd: Path, config: Path, *script_args: str, script: Path = TOY, mode: str = "tune",
         env: dict[str, str] | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    """`launcher --autotuning MODE --nproc_per_node 2 SCRIPT ARGS --deepspeed CONFIG`, run in `cwd`."""
    return subprocess.run(tune_command(config, *script_args, script=script, mode=mode), cwd=cwd,
                          env=env or launcher_env(), capture_output=True, text=True, timeout=timeout)


def run_engine_check(check: str, tmp_path: Path, nproc_per_node: int = 2) -> dict:
    """Run one check of tests/workers/engine_checks.py under the launcher; its JSON result."""
    import json

    out = tmp_path / f"{check}.json"
    result = run_launcher("--nproc_per_node", str(nproc_per_node), WORKERS / "engine_checks.py", "--check", check,
                          "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == nproc_per_node
    return data


def orphans_marked(marker: str) -> list:
    """Live processes whose environment carries this test's marker but which are no longer under
    this test's process tree: orphans of the launch (a warm runner's forkserver stays a child)."""
    ours = {child.pid for child in psutil.Process().children(recursive=True)}
    found = []
    for process in psutil.process_iter():
        try:
            if (process.pid not in ours and process.environ().get("AUTOTUNER_TEST_MARK") == marker
                    and process.status() != psutil.STATUS_ZOMBIE):
                found.append((process.pid, process.ppid(), " ".join(process.cmdline())[:120]))
        except psutil.Error:
            continue
    return found


def measure_toy_marked(tmp_path: Path, monkeypatch, runner_kind: str, *script_args: str):
    """One measured launch of the toy (micro-batch 2, ZeRO 0), cold or warm, its processes marked:
    the result, and the marked processes still alive outside this test's tree right after it."""
    from autotuner.app.measure import Experiment, measure, measurement_settings, warm_runner

    marker = f"{runner_kind}-{tmp_path.name}"
    monkeypatch.setenv("AUTOTUNER_TEST_MARK", marker)
    settings = measurement_settings(TOY, script_args, {"train_micro_batch_size_per_gpu": 2,
                                                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                                    start_profile_step=2, end_profile_step=3, arg_mappings=TOY_MAPPINGS)
    runner = warm_runner(TOY) if runner_kind == "warm" else None
    try:
        result = measure(Experiment(0, 2, 1), settings, tmp_path / "exp", runner)
        return result, orphans_marked(marker)
    finally:
        if runner is not None:
            runner.close()


def assert_no_children_left() -> None:
    """Every process this test started (and theirs) has ended."""
    alive = [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left behind: {[(p.pid, p.cmdline()) for p in alive]}"


UNIT_TIER = ROOT / "tests" / "unit"


def pytest_configure(config):
    """matplotlib builds its font cache on its first import, running `fc-list`: done here, before
    the unit tier's guard against processes, so a unit test that plots is not failed for it on a
    fresh machine (the plot extra is optional)."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass
ORPHAN_GRACE_S = 15.0  # an orphaned cold launcher ends its ranks within its 10 s grace; only waited for when one is left


# Set once per process, not by a test: pytest's running test, torch's compiler cache, accelerate's
# and DeepSpeed's CUDA check at import, and the GPT-2 example's offline switches at its import.
SET_BY_LIBRARIES = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK",
                    "HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY"}


@pytest.fixture(autouse=True)
def _environment_left_as_found():
    """A test leaves os.environ as it found it (monkeypatch's changes are undone before this looks):
    a launcher run in this process sets its ranks' settings there, and every later launcher the
    suite starts inherits them (AUTOTUNER_CONFIG_CHECKED once silenced a later run's config warning)."""
    before = dict(os.environ)
    yield
    changed = sorted(key for key in {*before, *os.environ} - SET_BY_LIBRARIES if before.get(key) != os.environ.get(key))
    if changed:
        for key in changed:
            if key in before:
                os.environ[key] = before[key]
            else:
                os.environ.pop(key, None)
        pytest.fail(f"the test left the environment changed: {changed} (run the launcher as a process, or use monkeypatch)")


@pytest.fixture(autouse=True)
def _no_marked_orphans(request, monkeypatch):
    """Every integration test marks its processes (an environment variable every launch inherits)
    and fails if a marked process outlives it outside this process's tree: an orphan, reparented
    when what started it died, which a look at our own descendants cannot see."""
    if Path(str(request.node.path)).is_relative_to(UNIT_TIER):
        yield
        return
    marker = f"{os.getpid()}:{request.node.nodeid}"
    monkeypatch.setenv("AUTOTUNER_TEST_MARK", marker)
    yield
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while (left := orphans_marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes this test started outlived it, orphaned: {left}"


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """tests/unit is the tier without processes: a test there that starts one fails at once
    (it belongs in tests/integration)."""
    if not Path(str(request.node.path)).is_relative_to(UNIT_TIER):
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError("a unit test started a process; move it to tests/integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    yield


@pytest.fixture
def no_orphans():
    yield
    assert_no_children_left()


@pytest.fixture(scope="session")
def slurm_cluster():
    """A two-node Slurm cluster on this machine (tests/slurm_cluster.py), for the whole session;
    its daemons are stopped at the end. Skips where Slurm is not installed or cannot start."""
    import shutil
    import tempfile

    from slurm_cluster import ClusterUnavailable, start_cluster, stop_cluster

    # A short directory: slurmstepd's sockets live in the spool directories (107-byte socket paths).
    directory = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp" if os.access("/tmp", os.W_OK) else None))
    try:
        cluster = start_cluster(directory)
    except ClusterUnavailable as err:
        shutil.rmtree(directory, ignore_errors=True)
        if os.environ.get("AUTOTUNER_REQUIRE_SLURM") == "1":  # .ci/run installed Slurm: these tests must run
            pytest.fail(f"Slurm is installed (AUTOTUNER_REQUIRE_SLURM=1) but its cluster did not start: {err}")
        pytest.skip(f"no Slurm cluster: {err}")
    try:
        yield cluster
    finally:
        stop_cluster(cluster)
        shutil.rmtree(directory, ignore_errors=True)
