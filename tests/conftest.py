"""Shared helpers: run the launcher as a real process, and check nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
MINIMAL = ROOT / "examples" / "minimal" / "train.py"
CONFIGS = ROOT / "configs"


def launcher_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_launcher(*args: str, timeout: float = 180, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m autotuner ARGS` as a real process; its output is returned as text."""
    return subprocess.run(
        [sys.executable, "-m", "autotuner", *map(str, args)],
        cwd=cwd or ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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


def assert_no_children_left() -> None:
    """Every process this test started (and theirs) has ended."""
    alive = [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left behind: {[(p.pid, p.cmdline()) for p in alive]}"


@pytest.fixture
def no_orphans():
    yield
    assert_no_children_left()
