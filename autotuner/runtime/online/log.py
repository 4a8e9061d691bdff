"""Files of an online run: the CSV log (rank 0, from the first sample), the pick as
best_knobs.json (rank 0), and each rank's own record of the knobs it applied."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotuner.core.atomic import write_json_atomic
from autotuner.runtime.online.knobs import KNOB_UNITS, KnobPlan
from autotuner.runtime.online.schedule import LogRow, Pick

SCORE_UNIT = "samples/s"
BEST_KNOBS_VERSION = 1


@dataclass(frozen=True)
class OnlinePaths:
    log_file: Path
    best_knobs_file: Path
    ranks_dir: Path

    def rank_record(self, rank: int) -> Path:
        return self.ranks_dir / f"rank{rank}.jsonl"


def paths_for(results_dir: str, log_file: str | None, best_knobs_file: str | None) -> OnlinePaths:
    log = Path(log_file) if log_file else Path(results_dir) / "online_log.csv"
    best = Path(best_knobs_file) if best_knobs_file else Path(results_dir) / "best_knobs.json"
    return OnlinePaths(log, best, log.parent / "online_ranks")


class CsvLog:
    """One row per window: the knobs, then score, train_iter and phase. A comment line above
    the header gives the units (Horovod users asked what its score meant, #1745)."""

    def __init__(self, path: Path, plan: KnobPlan, world_size: int):
        self.path = path
        self.names = plan.names
        path.parent.mkdir(parents=True, exist_ok=True)
        units = "; ".join(f"{name}: {KNOB_UNITS[name]}" for name in self.names)
        fixed = ", ".join(f"{name}={value!r} ({key})" for name, value, key in plan.fixed) or "none"
        with path.open("w", newline="") as handle:
            handle.write(f"# online autotuning, {plan.engine.upper()} on {world_size} ranks. score: {SCORE_UNIT} "
                         f"(global batch x steps / seconds of the window; higher is better). {units}. "
                         f"fixed: {fixed}. phases: warmup, sample, remeasure, final\n")
            csv.writer(handle).writerow([*self.names, "score", "train_iter", "phase"])

    def write(self, rows: list[LogRow]) -> None:
        with self.path.open("a", newline="") as handle:
            writer = csv.writer(handle)
            for row in rows:
                knobs = dict(row.knobs)
                writer.writerow([*(knobs[n] for n in self.names), f"{row.score:.4f}", row.train_iter, row.phase.value])
            handle.flush()


def write_best_knobs(path: Path, pick: Pick, plan: KnobPlan, applied: dict[str, Any], zero_stage: int,
                     world_size: int) -> None:
    """The pick, in a form `autotuning.online.knobs` reads back as fixed knobs."""
    ranking = [{"knobs": dict(r.knobs), "median": round(r.median, 4), "low": round(r.low, 4),
                "high": round(r.high, 4), "windows": r.windows} for r in pick.ranking]
    start = next((r for r in pick.ranking if r.knobs == pick.start), None)
    body = {
        "version": BEST_KNOBS_VERSION,
        "knobs": applied,
        "score": round(pick.score, 4),
        "score_unit": SCORE_UNIT,
        "train_iter": pick.train_iter,
        "start_knobs": dict(pick.start),
        "start_score": round(start.median, 4) if start else None,
        "ranking": ranking,
        "fixed": {name: {"value": value, "by": key} for name, value, key in plan.fixed},
        "zero_stage": zero_stage,
        "world_size": world_size,
        "use": "set \"autotuning\": {\"online\": {\"knobs\": \"<this file>\"}} in the config to train with these",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, body)


class RankRecord:
    """This rank's own account of the knobs in effect, read back from the wrapper at each change."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def write(self, train_iter: int, phase: str, applied: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({"train_iter": train_iter, "phase": phase, "knobs": applied}) + "\n")
