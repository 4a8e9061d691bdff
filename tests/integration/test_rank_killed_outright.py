"""A rank killed outright (the OOM killer, a segfault) leaves its own children behind: reparented,
they are no longer under the launcher, and torch elastic signals only ranks still running. The
launcher ends them through the rank's process group, cold (elastic) and warm (forkserver) alike."""

from __future__ import annotations

import pytest

from autotuner.app.measure import TrialState
from conftest import TOY, launcher_env, measure_toy_marked, orphans_marked, run_launcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KILLED_WITH_A_CHILD = ("--child_process", "--kill_rank", "0", "--fail_at_step", "2")


def test_a_plain_launch_ends_what_a_killed_rank_started(tmp_path, no_orphans):
    marker = f"plain-{tmp_path.name}"
    env = {**launcher_env(), "AUTOTUNER_TEST_MARK": marker}
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}')
    result = run_launcher("--nproc_per_node", "2", TOY, *KILLED_WITH_A_CHILD, "--deepspeed", config, env=env)
    left = orphans_marked(marker)
    assert result.returncode == 128 + 9, result.stderr[-2000:]  # SIGKILL, as a shell reports it
    assert "rank 0 exited with status 137" in result.stderr
    assert not left, f"what the killed rank (or its peer) started outlived the launch: {left}"


def test_what_the_ranks_of_a_launch_that_succeeded_left_running_is_theirs_as_under_torchrun(tmp_path):
    import psutil

    marker = f"kept-{tmp_path.name}"  # not the test's own marker: these are meant to outlive the launch
    env = {**launcher_env(), "AUTOTUNER_TEST_MARK": marker}
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}')
    result = run_launcher("--nproc_per_node", "2", TOY, "--child_process", "--steps", "2", "--deepspeed", config, env=env)
    left = orphans_marked(marker)
    try:
        assert result.returncode == 0, result.stderr[-2000:]
        assert len(left) == 2, left  # one per rank: an upload a rank starts at its end, say
    finally:
        for pid, _, _ in left:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


@pytest.mark.parametrize("runner_kind", ["cold", "warm"])
def test_a_measured_launch_ends_what_a_killed_rank_started(tmp_path, monkeypatch, no_orphans, runner_kind):
    result, left = measure_toy_marked(tmp_path, monkeypatch, runner_kind, *KILLED_WITH_A_CHILD)
    assert result.state is TrialState.FAILED, result
    assert not left, f"what the killed rank (or its peer) started outlived the launch: {left}"
