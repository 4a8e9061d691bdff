"""What a profile launch's probes timed, as ModelInfo carries them (core/boundary.py): the
collectives on the job's group and on tensor parallelism's groups (runtime/measure/comm_probe.py),
and a split layer against the same layer unsplit (runtime/measure/split_layer_probe.py).
Frozen records, refused when damaged so that no fit sees a bad point."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from autotuner.core.errors import RecordError

COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective timed on the job's own process group in a profile launch.

    `bytes` is the full, unsharded tensor: all_reduce's input, reduce_scatter's input,
    all_gather's output (so the three ops of one size move comparable data). `seconds` is the
    median over repeats of the slowest rank's wall time for one call. `group_size`: 0 for the job's
    whole group; else the size of the groups of consecutive ranks it ran on, every group at once
    (tensor parallelism's groups at that degree)."""

    op: str
    bytes: int
    seconds: float
    group_size: int = 0

    def __post_init__(self) -> None:
        # Refused here, so a damaged file fails when read and a fit never sees such a point.
        if self.op not in COLLECTIVE_OPS:
            raise RecordError(f"collective timing: unknown op {self.op!r}; known: {', '.join(COLLECTIVE_OPS)}")
        if self.bytes <= 0:
            raise RecordError(f"collective timing of {self.op}: bytes must be > 0, not {self.bytes}")
        if not math.isfinite(self.seconds) or self.seconds <= 0:
            raise RecordError(f"collective timing of {self.op}: seconds must be finite and > 0, not {self.seconds}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CollectiveTiming":
        missing = [key for key in ("op", "bytes", "seconds") if key not in data]
        if missing:
            raise RecordError(f"collective timing without {', '.join(repr(key) for key in missing)}")
        return cls(str(data["op"]), int(data["bytes"]), float(data["seconds"]), int(data.get("group_size", 0)))


SPLIT_LAYER_STYLES = ("colwise", "rowwise")


@dataclass(frozen=True)
class SplitLayerTiming:
    """One tensor-parallel Linear's forward and backward, timed in a profile launch at degree 1 on
    tensor parallelism's groups at `degree` (runtime/measure/split_layer_probe.py): what a split
    layer costs beyond the same layer unsplit, which the launches at degree 1 cannot see (DTensor's
    dispatch per op, the layer's one all-reduce at a small size). `seconds` and `plain_seconds`:
    the median over repeats of the slowest rank's time of a forward and backward, for the split
    layer and for an unsplit one of its local shape; `all_reduce_bytes`: what the split layer's
    all-reduce carried (a column layer's input gradient in the backward, a row layer's output in
    the forward); `step_seconds` and `plain_step_seconds`: their parameters' optimizer step. Those
    are timed back to back, as training runs them; `floor_seconds` and `plain_floor_seconds` are
    the fastest forward and backward of calls each started together after a barrier (with more
    ranks than cores they differ, the floor lower)."""

    style: str
    degree: int
    seconds: float
    plain_seconds: float
    all_reduce_bytes: int
    step_seconds: float
    plain_step_seconds: float
    floor_seconds: float
    plain_floor_seconds: float

    def __post_init__(self) -> None:
        if self.style not in SPLIT_LAYER_STYLES:
            raise RecordError(f"split layer timing: unknown style {self.style!r}; known: {', '.join(SPLIT_LAYER_STYLES)}")
        if self.degree < 2 or self.all_reduce_bytes <= 0:
            raise RecordError(f"split layer timing of {self.style}: degree must be >= 2 and all_reduce_bytes > 0, "
                              f"not {self.degree} and {self.all_reduce_bytes}")
        for name in ("seconds", "plain_seconds", "step_seconds", "plain_step_seconds", "floor_seconds",
                     "plain_floor_seconds"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise RecordError(f"split layer timing of {self.style}: {name} must be finite and > 0, not {value}")

    @property
    def extra_s(self) -> float:
        """What splitting adds to the layer's forward and backward, at the probe's small size (never below 0)."""
        return max(0.0, self.seconds - self.plain_seconds)

    @property
    def floor_extra_s(self) -> float:
        """The least splitting added to the layer's forward and backward in any repeat (never below 0)."""
        return max(0.0, self.floor_seconds - self.plain_floor_seconds)

    @property
    def step_extra_s(self) -> float:
        """What splitting adds to its parameters' optimizer step (never below 0)."""
        return max(0.0, self.step_seconds - self.plain_step_seconds)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SplitLayerTiming":
        keys = ("style", "degree", "seconds", "plain_seconds", "all_reduce_bytes", "step_seconds", "plain_step_seconds",
                "floor_seconds", "plain_floor_seconds")
        missing = [key for key in keys if key not in data]
        if missing:
            raise RecordError(f"split layer timing without {', '.join(repr(key) for key in missing)}")
        return cls(str(data["style"]), int(data["degree"]), *(float(data[key]) for key in keys[2:4]),
                   int(data["all_reduce_bytes"]), *(float(data[key]) for key in keys[5:]))
