"""The public measuring API (autotuner/app/measure.py) the benchmarks use: one real launch of the
toy script measured as the tuner measures, its result kept, and read back rather than launched
again."""

from __future__ import annotations

import pytest

from autotuner.app.measure import Experiment, TrialState, measure_once, measurement_settings
from conftest import TOY, TOY_MAPPINGS, measure_toy_marked

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_an_experiment_is_measured_once_and_its_kept_result_is_read_back(tmp_path, no_orphans):
    config = {"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "autotuning": {"enabled": True, "fast": False}}  # the autotuning section is not used
    settings = measurement_settings(TOY, ("--ms_per_sample", "5"), config, start_profile_step=2, end_profile_step=4,
                                    arg_mappings=TOY_MAPPINGS)
    assert settings.script_args[-2:] == ("--deepspeed", "ds.json")  # the config flag each trial points
    experiment = Experiment(1, 4, 2)
    first = measure_once(experiment, settings, tmp_path / "exp")
    assert first.state is TrialState.OK and first.value > 0
    assert first.measurement.zero_stage == 1 and first.measurement.gradient_accumulation_steps == 2
    assert first.measurement.train_batch_size == 4 * 2 * 2

    (tmp_path / "exp" / "stdout.log").unlink()  # a launch would write it again
    again = measure_once(experiment, settings, tmp_path / "exp")
    assert again == first and not (tmp_path / "exp" / "stdout.log").exists()
    other = measure_once(Experiment(0, 4, 2), settings, tmp_path / "exp")  # another experiment: launched
    assert other.state is TrialState.OK and other.experiment == Experiment(0, 4, 2)


@pytest.mark.parametrize("runner_kind", ["cold", "warm"])
def test_a_measured_rank_ends_its_dataloader_workers_before_the_result_is_returned(
        tmp_path, monkeypatch, no_orphans, runner_kind):
    # A measurement rank leaves with os._exit, which skips the finalizer that stops DataLoader
    # workers. Orphaned, they held the rank's CUDA memory for seconds, and on an H200 the next
    # experiment failed for want of it. They must be gone when the result comes back.
    temp = tmp_path / "tmp"  # the ranks' temporary directory: they leave nothing in it
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    result, left = measure_toy_marked(tmp_path, monkeypatch, runner_kind, "--loader_workers", "2")
    assert result.state is TrialState.OK, result.error
    assert not left, f"processes of the launch still alive after its result: {left}"
    assert not list(temp.glob("pymp-*")), "a rank left multiprocessing's temporary directory behind"
