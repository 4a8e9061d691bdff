"""The documentation site builds with mkdocs --strict (a broken link or a page left out of the
nav fails it), and the README stays short enough to read."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_site_builds_strictly(tmp_path):
    if shutil.which("mkdocs") is None and subprocess.run([sys.executable, "-c", "import mkdocs"]).returncode:
        pytest.fail("mkdocs is not installed: it is in the dev extra (pip install -e '.[dev]')")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "autotuning" / "index.html").exists()


def test_the_readme_is_at_most_250_lines_and_links_only_to_files_that_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    import re
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        assert (ROOT / target).exists(), target


def test_the_config_reference_page_is_what_the_models_generate():
    from autotuner.config.reference import reference_markdown

    committed = (ROOT / "docs" / "config_reference.md").read_text()
    assert committed == reference_markdown(), (
        "docs/config_reference.md differs from the models: python -m autotuner.config.reference > "
        "docs/config_reference.md")
    # Every section of the config, nested ones included, has its table.
    for section in ("`zero_optimization.offload_param`", "`autotuning.online`", "`timers.throughput`"):
        assert f"## {section}" in committed
