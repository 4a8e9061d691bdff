"""Online tuning, pure parts: which knobs a run offers and holds, and what rank 0 decides at
each window's end (fed synthetic timings; no processes)."""

from __future__ import annotations

import json

import pytest

from autotuner.config.models import ZeroConfig
from autotuner.config.autotuning import OnlineConfig
from autotuner.core.errors import ConfigError
from autotuner.runtime.online.knobs import plan_knobs, user_fixed
from autotuner.runtime.online.schedule import OnlineSchedule, Phase, ScheduleSettings, point_of


def plan(stage=0, world_size=2, gas=1, units=4, zero=None, online=None):
    return plan_knobs(stage=stage, zero=ZeroConfig(**(zero or {"stage": stage})), online=OnlineConfig(**(online or {})),
                      world_size=world_size, gradient_accumulation_steps=gas, shard_units=units)


# ----- knobs -----

def test_ddp_stages_offer_bucket_size_and_bucket_view():
    for stage in (0, 1):
        knobs = plan(stage).tuned
        assert [k.name for k in knobs] == ["bucket_cap_mb", "gradient_as_bucket_view"]
        bucket = knobs[0]
        assert bucket.start == 25  # torch's default, measured like any other point
        assert set(bucket.choices) == {2**p for p in range(9)} | {25}  # 2^20 .. 2^28 bytes
        assert list(bucket.choices) == sorted(bucket.choices)


def test_fsdp_stages_offer_what_the_stage_has():
    assert plan(2, gas=2).names == ("forward_prefetch", "backward_prefetch", "reshard_after_backward")
    # No micro-steps: resharding between them has no effect. ZeRO-3 keeps its memory promise.
    assert plan(2, gas=1).names == ("forward_prefetch", "backward_prefetch")
    assert plan(3, gas=4).names == ("forward_prefetch", "backward_prefetch")
    # Prefetch needs blocks to prefetch.
    assert plan(3, units=2).names == ("forward_prefetch",)
    assert dict((k.name, k.choices) for k in plan(3, units=2).tuned) == {"forward_prefetch": (0, 1)}
    assert plan(3, units=1).names == ()
    assert dict(plan(3, units=1).not_offered)["forward_prefetch"].startswith("fewer than 2")


def test_one_rank_offers_nothing():
    result = plan(0, world_size=1)
    assert result.tuned == ()
    assert "one rank" in dict(result.not_offered)["bucket_cap_mb"]


def test_deepspeed_keys_fix_their_knobs():
    result = plan(0, zero={"stage": 0, "reduce_bucket_size": 2**20, "contiguous_gradients": True})
    assert result.tuned == ()
    assert result.fixed_values() == {"bucket_cap_mb": 4, "gradient_as_bucket_view": True}
    assert dict((n, k) for n, _, k in result.fixed)["bucket_cap_mb"] == "zero_optimization.reduce_bucket_size"
    result = plan(3, zero={"stage": 3, "overlap_comm": True})
    assert result.names == ("backward_prefetch",)
    assert result.fixed_values() == {"forward_prefetch": 1}


def test_online_knobs_fix_knobs_and_read_a_best_knobs_file(tmp_path):
    result = plan(0, online={"knobs": {"bucket_cap_mb": 64}})
    assert result.names == ("gradient_as_bucket_view",)
    assert result.full({"gradient_as_bucket_view": True}) == {"bucket_cap_mb": 64, "gradient_as_bucket_view": True}
    best = tmp_path / "best_knobs.json"
    best.write_text(json.dumps({"knobs": {"bucket_cap_mb": 8, "gradient_as_bucket_view": False}, "score": 1.0}))
    result = plan(0, online={"knobs": str(best)})
    assert result.tuned == () and result.fixed_values() == {"bucket_cap_mb": 8, "gradient_as_bucket_view": False}


@pytest.mark.parametrize("zero, knobs, words", [
    ({}, {"bucket_cap": 8}, ["autotuning.online.knobs", "'bucket_cap' is not a knob", "bucket_cap_mb"]),
    ({}, {"bucket_cap_mb": 0}, ["autotuning.online.knobs.bucket_cap_mb", "got 0", "MiB > 0"]),
    ({}, {"gradient_as_bucket_view": 1}, ["gradient_as_bucket_view", "got 1", "true or false"]),
    ({}, {"forward_prefetch": 5}, ["forward_prefetch", "got 5", "0, 1 or 2"]),
    ({"contiguous_gradients": False}, {"gradient_as_bucket_view": True},
     ["autotuning.online.knobs.gradient_as_bucket_view", "disagrees with zero_optimization.contiguous_gradients"]),
    ({}, "missing_best_knobs.json", ["autotuning.online.knobs: missing_best_knobs.json", "no such file"]),
], ids=["unknown", "zero-bucket", "not-bool", "prefetch-range", "conflict", "missing-file"])
def test_bad_fixed_knobs_are_refused_with_the_key(zero, knobs, words):
    with pytest.raises(ConfigError) as info:
        user_fixed(ZeroConfig(**zero), OnlineConfig(knobs=knobs))
    assert info.value.exit_code == 2
    for word in words:
        assert word in str(info.value)


def test_a_knob_of_the_other_engine_is_refused():
    with pytest.raises(ConfigError, match="ZeRO stage 3 has no bucket_cap_mb"):
        plan(3, online={"knobs": {"bucket_cap_mb": 8}})


# ----- the schedule -----

class ScriptedOptimizer:
    """Asks the given points in order (then repeats the last); records what it was told."""

    def __init__(self, points):
        self.points, self.told = list(points), []

    def ask(self):
        return self.points.pop(0) if len(self.points) > 1 else self.points[0]

    def tell(self, point, score):
        self.told.append((point, score))


A, B, C = {"bucket_cap_mb": 25}, {"bucket_cap_mb": 4}, {"bucket_cap_mb": 64}
SETTINGS = ScheduleSettings(warmup_samples=2, steps_per_sample=5, max_samples=3, sampling_confidence_time=0.0,
                            remeasure_top=2, remeasure_windows=3)


def run(schedule: OnlineSchedule, seconds_of) -> tuple[list, list]:
    """Drive the schedule to its end: `seconds_of(knobs, phase, n)` is a window's duration."""
    decision = schedule.first()
    decisions, rows, step, count = [decision], [], 1, 0
    while decision.phase is not None:
        step += decision.steps
        decision, new_rows = schedule.window_ended(step, decision.steps, seconds_of(dict(decision.knobs),
                                                                                       decision.phase, count))
        count += 1
        decisions.append(decision)
        rows.extend(new_rows)
    return decisions, rows


def test_phases_in_order_and_the_pick_is_by_median_of_interleaved_remeasurements():
    # C has one lucky sample (the best single score) but is slower when re-measured; B is steady.
    optimizer = ScriptedOptimizer([A, C, B])

    def seconds(knobs, phase, n):
        if knobs == C:
            return 0.5 if phase is Phase.SAMPLE else 1.3
        return {25: 1.0, 4: 0.8}[knobs["bucket_cap_mb"]]

    schedule = OnlineSchedule(SETTINGS, point_of(A), optimizer, window_samples=100)
    decisions, rows = run(schedule, seconds)
    phases = [r.phase for r in rows]
    assert phases == [Phase.WARMUP] * 2 + [Phase.SAMPLE] * 3 + [Phase.REMEASURE] * 9 + [Phase.FINAL]
    assert [dict(r.knobs) for r in rows[:5]] == [A, A, A, C, B]  # warmup at the start, then as asked
    assert len(optimizer.told) == 3  # only samples are told; warmup is discarded
    remeasured = [dict(r.knobs) for r in rows if r.phase is Phase.REMEASURE]
    # Top 2 by sample score (C, B) plus the starting knobs, round-robin, rotated each round.
    assert remeasured[:3] == [C, B, A] and remeasured[3:6] == [B, A, C] and remeasured[6:] == [A, C, B]
    final = rows[-1]
    assert dict(final.knobs) == B and final.score == pytest.approx(100 * 5 / 0.8)
    assert dict(decisions[-1].knobs) == B and decisions[-1].phase is None
    assert schedule.pick.knobs == point_of(B)
    assert [dict(r.knobs) for r in schedule.pick.ranking] == [B, A, C]
    # Scores are samples/s: global batch x steps / seconds.
    assert rows[0].score == pytest.approx(100 * 5 / 1.0)


def test_short_windows_are_extended_to_the_confidence_time():
    settings = ScheduleSettings(0, 4, 1, sampling_confidence_time=2.0, remeasure_top=1, remeasure_windows=1)
    schedule = OnlineSchedule(settings, point_of(A), ScriptedOptimizer([A]), window_samples=8)
    first = schedule.first()
    assert first.phase is Phase.SAMPLE and first.steps == 4
    extend, rows = schedule.window_ended(5, 4, 0.5)  # 0.125 s a step: 12 more steps reach 2 s
    assert extend.extend and extend.steps == 12 and rows == []
    decision, rows = schedule.window_ended(17, 16, 2.0)
    assert not decision.extend and [r.phase for r in rows] == [Phase.SAMPLE, Phase.FINAL]
    assert rows[0].score == pytest.approx(8 * 16 / 2.0)


def test_one_point_only_needs_no_remeasurement():
    settings = ScheduleSettings(1, 2, 3, 0.0, 3, 3)
    schedule = OnlineSchedule(settings, point_of(A), ScriptedOptimizer([A]), window_samples=1)
    _, rows = run(schedule, lambda knobs, phase, n: 1.0 + 0.1 * n)
    assert [r.phase for r in rows] == [Phase.WARMUP] + [Phase.SAMPLE] * 3 + [Phase.FINAL]
    assert dict(rows[-1].knobs) == A
