"""The tensor-parallel plan on real ranks: two gloo ranks split a model by tp_plan with torch's
parallelize_module and train it four steps beside an unsplit copy; the losses must be equal, and
each rank must hold less than the whole model (tests/workers/tp_plan_ranks.py)."""

from __future__ import annotations

import pytest

from conftest import WORKERS, run_launcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("model", ["net", "llama"])
def test_a_model_split_by_its_plan_trains_as_the_whole_model(tmp_path, model, no_orphans):
    result = run_launcher("--nproc_per_node", "2", WORKERS / "tp_plan_ranks.py", "--model", model,
                          "--out", tmp_path, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [(tmp_path / f"rank{rank}.txt").read_text().split() for rank in (0, 1)]
    for words in lines:
        assert words[:2] == ["ok", model]
        local, total = int(words[2]), int(words[3])
        assert local < total  # each rank holds its share of the split layers, not the whole model
    assert lines[0][4:] == lines[1][4:]  # both ranks saw the same losses
