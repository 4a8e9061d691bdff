"""The records that cross the process boundary between the tuner and the ranks.

Down: a `MeasurementRequest`, in a file named by AUTOTUNER_MEASUREMENT_REQUEST; after a tune, the
pick's `TunedValues`, in the file `launcher --tuned_values` names. Up: a
`Measurement` (the profile window's timings and peaks), `ModelInfo` (the profile, with the
`CollectiveTiming`s of the job's process group), and how the launch ended: one `RankError` per
rank that raised and the launcher's `LaunchReport` (launch_records.py, with this versioning). Every
record is frozen and versioned; a reader refuses a version it does not know rather than guess.
No torch import: the tuner and `import autotuner` in every rank read these.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from autotuner.core.engine_kind import Engine
from autotuner.core.atomic import write_json_atomic

VERSION = 1
REQUEST_ENV = "AUTOTUNER_MEASUREMENT_REQUEST"  # the MeasurementRequest file for this launch
# Seconds a rank waits at most in rendezvous and on the store (a tuner's launch: its time limit).
DIST_TIMEOUT_ENV = "AUTOTUNER_DIST_TIMEOUT_S"
# The warm forkserver's preload (launch/warm_preload.py, which preloads when imported): what to
# import, and where to report.
WARM_PRELOAD_ENV = "AUTOTUNER_WARM_PRELOAD"
WARM_PRELOAD_REPORT_ENV = "AUTOTUNER_WARM_PRELOAD_REPORT"
from autotuner.core.errors import ERROR_DIR_ENV  # noqa: E402,F401 - where each rank records its uncaught exception
from autotuner.core.errors import RecordError  # noqa: E402
from autotuner.core.probe_records import CollectiveTiming, SplitLayerTiming  # noqa: E402
ONLINE_ENV = "AUTOTUNER_ONLINE"  # "1": tune communication knobs online (launcher --autotuning online)

Record = TypeVar("Record")




def _check_version(data: dict[str, Any], kind: str) -> None:
    version = data.get("version", VERSION)
    if version != VERSION:
        raise RecordError(f"{kind} record version {version}; this autotuner reads version {VERSION}")


@dataclass(frozen=True)
class Summary:
    """Statistics of a list of durations, in seconds."""

    mean_s: float
    std_s: float
    median_s: float
    min_s: float
    max_s: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> "Summary":
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        return cls(statistics.fmean(values), std, statistics.median(values), min(values), max(values), len(values))

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "Summary | None":
        return None if data is None else cls(**{f.name: data.get(f.name, 0) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class MeasurementRequest:
    """What the tuner asks of one launch. Steps count optimizer steps from 1.

    `metrics_path`: time steps start..end, write a Measurement there, and exit 0.
    `model_info_path`: after the first step (the second on CUDA) write ModelInfo there; with
    `exit_after_model_info` every rank then exits 0. OOM markers go beside `oom_marker_prefix`."""

    start_profile_step: int
    end_profile_step: int
    metrics_path: str | None = None
    model_info_path: str | None = None
    exit_after_model_info: bool = False
    oom_marker_prefix: str | None = None
    min_window_s: float = 0.0  # the window is extended, a step at a time, until it has lasted this long
    max_steps_per_window: int = 0  # ... or holds this many steps
    # metric "goodput": read the gradient noise's raw figures (ZeRO 0/1, two ranks or more). Off
    # otherwise: the reading costs a pass over the gradients and a scalar all-reduce per step.
    gradient_noise: bool = False
    # The experiment's tuned values, by DeepSpeed config key ("zero_optimization.stage"): our engine
    # trains with them where the script's own config says otherwise, and every engine reports what
    # it built at each (Measurement.built), for the tuner to check.
    tuned: tuple[tuple[str, Any], ...] = ()
    version: int = VERSION

    def tuned_values(self) -> dict[str, Any]:
        return dict(self.tuned)

    def oom_marker(self, rank: int) -> str | None:
        return f"{self.oom_marker_prefix}.oom-rank{rank}" if self.oom_marker_prefix else None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "MeasurementRequest":
        _check_version(data, "measurement request")
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        values["tuned"] = tuple((str(key), value) for key, value in values.get("tuned") or ())
        return cls(**values)


@dataclass(frozen=True)
class TunedValues:
    """The pick's tuned values, by DeepSpeed config key ("zero_optimization.stage"), for the training
    of a script that builds its config in code, where the optimal config file alone would not reach
    it: a tune writes them to a file beside cmd_optimal.txt, and `launcher --tuned_values FILE` has
    our engine lay them over the measured engine's config (config/tuned_values.py)."""

    values: tuple[tuple[str, Any], ...]
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return {"values": dict(self.values), "version": self.version}

    @classmethod
    def from_json(cls, data: Any) -> "TunedValues":
        if not isinstance(data, dict):
            raise RecordError("tuned values record: not a JSON object")
        _check_version(data, "tuned values")
        values = data.get("values")
        if not isinstance(values, dict):
            raise RecordError("tuned values record without a 'values' object of config keys and values")
        return cls(tuple((str(key), value) for key, value in values.items()))


@dataclass(frozen=True)
class Measurement:
    """What a launch measured over its profile window. Key names `throughput`, `latency` and
    `FLOPS_per_gpu` are DeepSpeed's, so a DeepSpeed metrics file reads as one too (the rest
    then stays empty). Throughput is samples/s from end-to-end step time, data loading included."""

    throughput: float
    latency: float  # s per optimizer step
    throughput_std: float | None = None
    step_wall_s: Summary | None = None
    step_wall_s_values: tuple[float, ...] = ()  # per profiled step, in order (--bench)
    forward: Summary | None = None
    backward: Summary | None = None
    step: Summary | None = None
    peak_memory_bytes: int | None = None
    peak_memory_bytes_per_rank: tuple[int, ...] = ()
    peak_reserved_bytes: int | None = None
    world_size: int | None = None
    train_batch_size: int | None = None
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    zero_stage: int | None = None
    precision: str | None = None
    device_type: str | None = None
    start_profile_step: int | None = None
    end_profile_step: int | None = None
    FLOPS_per_gpu: float | None = None
    engine: Engine = Engine.OURS  # whose engine ran the launch
    # The machine during the window: the largest share of a node's CPU time that processes other
    # than our ranks took, and the 1-minute load average at its end.
    cpu_taken_by_others: float | None = None
    load_average: float | None = None
    # Optimizer steps before the window and their wall time from the first forward (rank 0's).
    warmup_steps: int = 0
    warmup_s: float = 0.0
    # Per rank, per step from step 1 to the window's end: (the step's longest input, dim 1 of the
    # first tensor input; the memory peak so far after it). Empty when the inputs are no sequences.
    step_peaks: tuple[tuple[tuple[int, int], ...], ...] = ()
    bytes_before_first_step: int | None = None  # the largest rank's peak as its first forward began
    # Per step from step 2 (ZeRO 0/1, two ranks or more): (mean over ranks of each rank's gradient's
    # squared norm before the all-reduce, the all-reduced gradient's), and the samples each
    # averages (micro-batch x gas, that x ranks): the gradient noise scale's raw figures.
    gradient_norms: tuple[tuple[float, float], ...] = ()
    gradient_noise_batches: tuple[int, ...] = ()
    # What the ranks built at each tuned key the request named that this engine can read back
    # (DeepSpeed config keys; the stage and batch triad are the fields above).
    built: tuple[tuple[str, Any], ...] = ()
    # Tuned keys where the script's own config said otherwise and our engine trained with the tuned
    # value (a script that builds its config in code): its pick's training needs them too.
    tuned_over_script: tuple[str, ...] = ()
    version: int = VERSION

    def one_off_s(self) -> float:
        """What the steps before the window took beyond as many steady steps: compiling, lazy
        initialisation; never negative."""
        return max(0.0, self.warmup_s - self.warmup_steps * self.latency)

    def value(self, key: str) -> float | None:
        """The objective's metric by its DeepSpeed name."""
        return getattr(self, key, None)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["step_wall_s_values"] = list(self.step_wall_s_values)
        data["peak_memory_bytes_per_rank"] = list(self.peak_memory_bytes_per_rank)
        data["step_peaks"] = [[list(pair) for pair in rank] for rank in self.step_peaks]
        data["gradient_norms"] = [list(pair) for pair in self.gradient_norms]
        data["gradient_noise_batches"] = list(self.gradient_noise_batches)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Measurement":
        _check_version(data, "measurement")
        if not isinstance(data.get("throughput"), (int, float)) or not isinstance(data.get("latency"), (int, float)):
            raise RecordError("measurement record without numeric 'throughput' and 'latency'")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("step_wall_s", "forward", "backward", "step"):
            values[key] = Summary.from_json(values.get(key))
        values["step_wall_s_values"] = tuple(float(v) for v in values.get("step_wall_s_values") or ())
        values["peak_memory_bytes_per_rank"] = tuple(int(v) for v in values.get("peak_memory_bytes_per_rank") or ())
        values["gradient_norms"] = tuple((float(a), float(b)) for a, b in values.get("gradient_norms") or ())
        values["gradient_noise_batches"] = tuple(int(v) for v in values.get("gradient_noise_batches") or ())
        values["step_peaks"] = tuple(tuple((int(length), int(peak)) for length, peak in rank)
                                     for rank in values.get("step_peaks") or ())
        values["built"] = tuple((str(key), value) for key, value in values.get("built") or ())
        values["tuned_over_script"] = tuple(str(key) for key in values.get("tuned_over_script") or ())
        values["engine"] = _engine(values.get("engine", Engine.OURS), "measurement")
        return cls(**values)


def _engine(value: Any, record: str) -> Engine:
    try:
        return Engine(value)
    except ValueError:
        allowed = ", ".join(repr(e.value) for e in Engine)
        raise RecordError(f"{record} record: engine {value!r}; expected one of {allowed}") from None


@dataclass(frozen=True)
class ModelInfo:
    """The profile one launch took after its first optimizer step (its second on CUDA).

    Peaks are per rank, in bytes. `forward_backward_peak_bytes` and `optimizer_step_peak_bytes`
    are the CUDA allocator's peaks of each phase in the steady state; None on CPU, whose resident
    set cannot be split by phase."""

    num_params: int
    trainable_num_params: int
    activation_bytes: int  # saved for backward, the largest over ranks
    optimizer_state_bytes_per_param: float
    micro_batch_size: int
    peak_memory_bytes: int
    zero_stage: int
    precision: str
    world_size: int
    activation_bytes_per_rank: tuple[int, ...] = ()
    peak_memory_bytes_per_rank: tuple[int, ...] = ()
    peak_reserved_bytes: int | None = None
    forward_backward_peak_bytes: int | None = None
    optimizer_step_peak_bytes: int | None = None
    num_shard_units: int = 0
    device_memory_bytes: int | None = None
    engines_in_process: int = 1
    backend: str | None = None  # the process group's: "gloo", "nccl"
    # Taken after the profile window when the launch times one (so the window never measures
    # the probe); empty with one rank, or in a file from before the probe.
    collective_timings: tuple[CollectiveTiming, ...] = ()
    engine: Engine = Engine.OURS  # whose engine ran the launch
    # What each activation checkpointing policy would hold at its peak, the largest over ranks,
    # from the first micro-step run without checkpointing (runtime/measure/profile.py); empty when the
    # model has no repeated blocks, ran checkpointed, or on DeepSpeed's engine.
    activation_bytes_by_policy: tuple[tuple[str, int], ...] = ()
    # The workload signature's model family and device (tuning/models/transfer.py): a hash of the model's
    # module types and block structure, sizes left out, and the device's name.
    model_family: str = ""
    device_name: str = ""
    sequence_length: int = 0  # of the model's first input, 0 where it has none (runtime/measure/profile.py)
    # Tensor parallelism the launch ran with (tensor_parallel.autotp_size), and the parameters its
    # plan split (whole counts): each rank holds split / tensor_parallel of them and the rest whole.
    tensor_parallel: int = 1
    split_num_params: int = 0
    # At degree 1, what a degree would split: the parameters the plan splits (whole counts) and the
    # bytes the first micro-batch saved inside its split regions (the largest over the ranks).
    splittable_num_params: int = 0
    split_activation_bytes: int = 0
    split_flop_share: float = 0.0  # of the first forward's FLOPs, those inside the split regions (rank 0's)
    # The row-wise layers that forward ran and their outputs' bytes (rank 0's): at degree k each
    # output is all-reduced over the k ranks, and its column-wise input's gradient in the backward.
    split_row_layers: int = 0
    split_row_output_bytes: int = 0
    # The column-wise layers that forward ran (each all-reduces its input's gradient at degree k),
    # and each split layer style timed on each degree's groups (the probe's, at degree 1).
    split_col_layers: int = 0
    split_layer_timings: tuple[SplitLayerTiming, ...] = ()
    # The measured engine's model class: where a script builds several engines, the one the tuned
    # values are for (our engine: the first built with an optimizer; DeepSpeed's: the first built).
    measured_model: str = ""
    # A pipeline's launch (its stages 1 without one): per stage, the parameters its ranks hold (a
    # tied weight on each stage that holds it) and the bytes its first micro-batch saved for
    # backward (the largest over the stage's replicas); each rank's stage, in rank order; the
    # schedule that ran, and the virtual stages each rank ran under it (a stage's figures then
    # cover all of its rank's chunks). The memory model costs each stage apart: the heaviest decides.
    pipeline_stages: int = 1
    pipeline_schedule: str = ""
    pipeline_stages_per_rank: int = 1
    stage_num_params: tuple[int, ...] = ()
    stage_split_num_params: tuple[int, ...] = ()  # of those, the ones tensor parallelism split (whole counts)
    stage_activation_bytes: tuple[int, ...] = ()
    stage_of_rank: tuple[int, ...] = ()
    pipeline_micro_batches: int = 0  # the launch's gas: the micro-batches a step runs through the stages
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in _PER_RANK_LISTS:
            data[key] = list(data[key])
        data["activation_bytes_by_policy"] = dict(self.activation_bytes_by_policy)
        data["collective_timings"] = [timing.to_json() for timing in self.collective_timings]
        data["split_layer_timings"] = [timing.to_json() for timing in self.split_layer_timings]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelInfo":
        _check_version(data, "model info")
        try:
            values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
            for key in _PER_RANK_LISTS:
                values[key] = tuple(int(v) for v in values.get(key) or ())
            values["collective_timings"] = tuple(
                CollectiveTiming.from_json(item) for item in values.get("collective_timings") or ())
            values["split_layer_timings"] = tuple(
                SplitLayerTiming.from_json(item) for item in values.get("split_layer_timings") or ())
            values["activation_bytes_by_policy"] = tuple(
                (str(policy), int(size)) for policy, size in sorted((values.get("activation_bytes_by_policy") or {}).items()))
            values["engine"] = _engine(values.get("engine", Engine.OURS), "model info")
            return cls(**values)
        except (TypeError, KeyError, ValueError) as err:
            raise RecordError(f"model info record: {err}") from None


_PER_RANK_LISTS = ("activation_bytes_per_rank", "peak_memory_bytes_per_rank", "stage_num_params",
                   "stage_split_num_params", "stage_activation_bytes", "stage_of_rank")

def write_record(path: str | os.PathLike, record: Any) -> None:
    write_json_atomic(path, record.to_json())


def read_record(path: str | os.PathLike, kind: type[Record]) -> Record | None:
    """The record in `path`, or None when there is no file. A damaged file raises RecordError."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    try:
        return kind.from_json(json.loads(text))  # type: ignore[attr-defined]
    except (ValueError, KeyError, TypeError) as err:
        raise RecordError(f"{path}: {err}") from None


def request_from_env(environ: dict[str, str] | None = None) -> MeasurementRequest | None:
    """The request the launcher named for this process, if any."""
    path = (os.environ if environ is None else environ).get(REQUEST_ENV)
    return read_record(path, MeasurementRequest) if path else None

