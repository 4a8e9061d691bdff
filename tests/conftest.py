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


def assert_no_children_left() -> None:
    """Every process this test started (and theirs) has ended."""
    alive = [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left behind: {[(p.pid, p.cmdline()) for p in alive]}"


@pytest.fixture
def no_orphans():
    yield
    assert_no_children_left()
