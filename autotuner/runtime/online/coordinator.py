"""Online tuning inside the engine: at optimizer-step boundaries rank 0 decides, one broadcast
over the job's own process group carries the decision, and every rank switches at the same step.

No service, no extra process: a rank that dies takes the job down through the launcher, as any
training failure does, and nobody waits on an HTTP server (Bagua's hangs, PRs #200 and #265)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from autotuner.config.autotuning import OnlineConfig
from autotuner.runtime.online.knobs import KnobPlan
from autotuner.runtime.online.log import CsvLog, OnlinePaths, RankRecord, write_best_knobs
from autotuner.runtime.online.schedule import Decision, OnlineSchedule, Phase, ScheduleSettings, point_of

_PHASES = (Phase.WARMUP, Phase.SAMPLE, Phase.REMEASURE)


class KnobTarget(Protocol):
    def apply_knobs(self, knobs: dict[str, Any]) -> None: ...

    def applied_knobs(self) -> dict[str, Any]: ...


def schedule_settings(online: OnlineConfig) -> ScheduleSettings:
    return ScheduleSettings(online.warmup_samples, online.steps_per_sample, online.max_samples,
                            online.sampling_confidence_time, online.remeasure_top, online.remeasure_windows)


class OnlineTuning:
    """Constructed by every rank together (it broadcasts the first decision); then
    `after_step(step, now)` at the end of every optimizer step, on every rank."""

    def __init__(self, plan: KnobPlan, online: OnlineConfig, *, rank: int, world_size: int, device: torch.device,
                 global_batch: int, zero_stage: int, paths: OnlinePaths, target: KnobTarget):
        self.plan, self.rank, self.device, self.target = plan, rank, device, target
        self.paths, self.zero_stage, self.world_size = paths, zero_stage, world_size
        self.record = RankRecord(paths.rank_record(rank))
        self.current = plan.start()
        target.apply_knobs(plan.full(self.current))
        self.record.write(0, "start", target.applied_knobs())
        self.active = bool(plan.tuned)
        self.open_at = self.close_at = 0
        self.opened_time = 0.0
        self.schedule: OnlineSchedule | None = None
        self.log: CsvLog | None = None
        if rank == 0:
            self._say_plan()
        if not self.active:
            return
        first = None
        if rank == 0:
            from autotuner.core.bayes import BayesianOptimizer

            optimizer = BayesianOptimizer(plan.dimensions(), seed=online.seed, sampler=online.sampler,
                                          startup_trials=max(2, min(10, online.max_samples // 4)))
            optimizer.enqueue(plan.start())
            self.schedule = OnlineSchedule(schedule_settings(online), point_of(plan.start()), optimizer, global_batch)
            self.log = CsvLog(paths.log_file, plan, world_size)
            first = self.schedule.first()
        self._adopt(self._broadcast(first), step=0, now=0.0)

    def _say_plan(self) -> None:
        fixed = ", ".join(f"{n}={v!r} ({k})" for n, v, k in self.plan.fixed)
        if not self.plan.tuned:
            skipped = "; ".join(f"{n}: {why}" for n, why in self.plan.not_offered)
            print(f"autotuner: online tuning: nothing to tune at ZeRO stage {self.zero_stage}"
                  f"{'; fixed ' + fixed if fixed else ''}{'; ' + skipped if skipped else ''}", flush=True)
            return
        print(f"autotuner: online tuning {', '.join(self.plan.names)} ({self.plan.engine.upper()}, "
              f"{self.world_size} ranks){'; fixed ' + fixed if fixed else ''}; log {self.paths.log_file}", flush=True)

    # ----- the one collective -----
    def _encode(self, decision: Decision | None) -> torch.Tensor:
        size = 3 + len(self.plan.tuned)
        values = torch.zeros(size, dtype=torch.float64)
        if decision is not None:
            knobs = dict(decision.knobs)
            values[0] = float(decision.extend)
            values[1] = -1.0 if decision.phase is None else float(_PHASES.index(decision.phase))
            values[2] = float(decision.steps)
            for index, knob in enumerate(self.plan.tuned):
                values[3 + index] = float(knob.choices.index(knobs[knob.name]))
        return values.to(self.device)

    def _broadcast(self, decision: Decision | None) -> Decision:
        values = self._encode(decision)
        if self.world_size > 1:
            dist.broadcast(values, src=0)
        extend, phase, steps, *indices = values.cpu().tolist()
        knobs = {knob.name: knob.choices[int(i)] for knob, i in zip(self.plan.tuned, indices)}
        return Decision(point_of(knobs), None if phase < 0 else _PHASES[int(phase)], int(steps), bool(extend))

    # ----- steps -----
    def after_step(self, step: int, now: float) -> None:
        if not self.active:
            return
        if step == self.open_at:
            self.opened_time = now
        if step != self.close_at:
            return
        decision = None
        if self.rank == 0:
            decision, rows = self.schedule.window_ended(step, self.close_at - self.open_at, now - self.opened_time)
            self.log.write(rows)
        self._adopt(self._broadcast(decision), step, now)

    def _adopt(self, decision: Decision, step: int, now: float) -> None:
        if decision.extend:
            self.close_at = step + decision.steps
            return
        knobs = dict(decision.knobs)
        changed = knobs != self.current
        if changed:
            self.current = knobs
            self.target.apply_knobs(self.plan.full(knobs))
        phase = decision.phase.value if decision.phase is not None else Phase.FINAL.value
        if changed or decision.phase is None:
            self.record.write(step, phase, self.target.applied_knobs())
        if decision.phase is None:
            self.active = False
            if self.rank == 0:
                self._finish()
            return
        # The first step after a change (DDP rebuilds its buckets) and step 1 are not measured.
        self.open_at = step + 1 if changed or step == 0 else step
        if self.open_at == step:
            self.opened_time = now
        self.close_at = self.open_at + decision.steps

    def _finish(self) -> None:
        pick = self.schedule.pick
        applied = self.target.applied_knobs()
        write_best_knobs(self.paths.best_knobs_file, pick, self.plan, applied, self.zero_stage, self.world_size)
        start = next((r.median for r in pick.ranking if r.knobs == pick.start), None)
        versus = f", starting knobs {start:.2f}" if start is not None else ""
        chosen = ", ".join(f"{k}={v}" for k, v in pick.knobs)
        print(f"autotuner: online tuning done at step {pick.train_iter}: {chosen} "
              f"({pick.score:.2f} samples/s median{versus}); kept for the rest of training; "
              f"written to {self.paths.best_knobs_file}", flush=True)
