"""The package's layers (pyproject's [tool.importlinter] contracts): commands on top, nothing
imports upward (inside the tuner too: orchestrator, reports, searches, tuners, trials, models, space, memory;
inside the engine: initialize, engine, its rooms, deepspeed_side, distributed), lazy imports included, and nothing
in the package imports DeepSpeed's import paths (autotuner/deepspeed_paths/). A broken contract names the import and its line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_imports_a_layer_above_its_own():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(lint).exists():
        pytest.fail("import-linter is not installed: it is in the dev extra (pip install -e '.[dev]')")
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "4 kept, 0 broken" in done.stdout
