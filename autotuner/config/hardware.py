"""`--hardware SPEC.json`: the accelerator and links a plan costs a layout on, for hardware that is
not on this machine (issue 80, part 3). SI units: FLOP/s, bytes, bytes/s, seconds.

    {"name": "A100 SXM 80GB", "peak_bf16_flops": 312e12, "memory_bytes": 85899345920,
     "memory_bandwidth": 2.039e12, "accelerators_per_node": 8,
     "intra_node": {"bandwidth": 300e9, "latency": 5e-6},
     "inter_node": {"bandwidth": 25e9, "latency": 10e-6}}

A link's bandwidth is what one accelerator sends one way (NVLink's per-direction figure inside a
node; its own network card's between nodes). These are required, each positive. Optional, typed:

- `device`: "cuda" (default) or "cpu". On "cpu" an accelerator is a core: ranks may outnumber
  them and share them, a rank's memory is its resident set (the script's own, measured when the
  plan runs it, plus `process_overhead_bytes`), bf16 "auto" settles off as it does on our CPU
  launches, and compute is costed at `peak_fp32_flops`;
- `peak_fp32_flops`: needed to plan fp32 compute;
- `compute_efficiency` (0-1]: the share of the peak a matmul reaches, stated or fitted (the plan's
  default is torchtitan's fitted 0.6495 on "cuda", 1 on "cpu");
- `process_overhead_bytes`: what a rank holds besides the model (the CUDA context and allocator
  reserve; on "cpu" the engine's and gloo's share of the resident set);
- `op_overhead_s`: each operator's fixed cost (dispatch, kernel launch), 0 by default;
- `intra_node.collectives` / `inter_node.collectives`: {"all_gather": {"bus_bandwidth": B,
  "latency": L}, ...}, a collective's own figures where it runs at another speed;
- `calibrate`: {"layout": NAME, "step_s": S}, one layout measured: the plan fits
  compute_efficiency so that layout's predicted step is S (instead of stating it);
- `overlap_communication`: true (default, NCCL beside the kernels) or false (gloo's threads
  share the cores the compute runs on, so a step waits on its collectives).
`python -m autotuner.app.host_spec` measures a spec of the machine it runs on.
Further fields are allowed and kept (a datasheet's other figures). A file that is not JSON, a field missing or not
a positive number is refused in one line naming the file and the field (exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, model_validator

from autotuner.core.errors import ConfigError


def _a_number(value: Any) -> Any:
    # JSON true is not a bandwidth; pydantic's lax mode would read it as 1.
    if isinstance(value, (bool, str)):
        raise ValueError("expected a number")
    return value


Positive = Annotated[float, BeforeValidator(_a_number), Field(gt=0)]
PositiveCount = Annotated[int, BeforeValidator(_a_number), Field(gt=0)]
NonNegative = Annotated[float, BeforeValidator(_a_number), Field(ge=0)]
Share = Annotated[float, BeforeValidator(_a_number), Field(gt=0, le=1)]


class Measured(BaseModel):
    """One collective's own figures on a link, as nccl-tests reports them: the bus bandwidth (the
    algorithm's bytes over the time) and the latency a hop."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bus_bandwidth: Positive
    latency: Positive


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


class Link(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    bandwidth: Positive  # bytes/s, one accelerator, one way
    latency: Positive  # seconds a message pays before its first byte
    # Optional, by collective: where a library runs them at different speeds (gloo's reduce-scatter
    # measured here at a third of its all-reduce's bus bandwidth); a collective not listed runs at
    # the bandwidth and latency above.
    collectives: dict[Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast"], Measured] = Field(
        default_factory=dict)

    def bus(self, op: str) -> tuple[float, float]:
        """(bus bandwidth, latency a hop) for collective `op`."""
        own = self.collectives.get(op)
        return (own.bus_bandwidth, own.latency) if own is not None else (self.bandwidth, self.latency)


class Calibration(BaseModel):
    """One layout the user measured: the plan fits its compute efficiency to it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layout: str = Field(min_length=1)  # a plan row's name, such as z0_gas4_mbs4
    step_s: Positive  # its measured seconds an optimizer step


class HardwareSpec(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1)
    peak_bf16_flops: Positive
    memory_bytes: Positive
    memory_bandwidth: Positive
    accelerators_per_node: PositiveCount
    intra_node: Link
    inter_node: Link
    device: Literal["cuda", "cpu"] = "cuda"
    peak_fp32_flops: Positive | None = None
    compute_efficiency: Share | None = None
    process_overhead_bytes: NonNegative | None = None
    op_overhead_s: NonNegative = 0.0
    overlap_communication: StrictBool = True
    calibrate: Calibration | None = None

    @model_validator(mode="after")
    def _one_efficiency(self) -> "HardwareSpec":
        if self.calibrate is not None and self.compute_efficiency is not None:
            raise ValueError("give compute_efficiency or calibrate, not both (calibrate fits the efficiency)")
        return self

    def peak_flops(self, precision: str) -> float:
        """The peak a rank computes at in `precision` ("bf16", "fp16" or "fp32")."""
        if precision == "fp32":
            if self.peak_fp32_flops is None:
                raise ConfigError(f"hardware spec {self.name!r}: peak_fp32_flops: missing; an fp32 run is costed at "
                                  "the fp32 peak (give it, or enable bf16)")
            return self.peak_fp32_flops
        return self.peak_bf16_flops

    def rank_share(self, ranks_per_node: int) -> float:
        """The share of one accelerator a rank has: 1 on a GPU; on a CPU the cores over the ranks
        where ranks outnumber them (they take turns)."""
        if self.device == "cpu":
            return min(1.0, self.accelerators_per_node / max(1, ranks_per_node))
        return 1.0


REQUIRED = ("name", "peak_bf16_flops", "memory_bytes", "memory_bandwidth", "accelerators_per_node",
            "intra_node.bandwidth", "intra_node.latency", "inter_node.bandwidth", "inter_node.latency")


def parse_hardware(data: Any, source: str) -> HardwareSpec:
    """The spec from `data` (the file's JSON), or one line naming `source`, the field and what it takes."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object with {', '.join(REQUIRED)}")
    try:
        return HardwareSpec.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        if not first["loc"]:  # a rule across fields
            raise ConfigError(f"{source}: {first['msg'].removeprefix('Value error, ')}") from None
        if first["loc"][-1] == "[key]":
            where = ".".join(str(part) for part in first["loc"][:-2])
            raise ConfigError(f"{source}: {where}: {json.dumps(first['input'])} is not a collective; expected "
                              f"{', '.join(COLLECTIVES)}") from None
        if first["type"] == "missing" and field not in REQUIRED:
            raise ConfigError(f"{source}: {field}: missing") from None
        if first["type"] == "missing":
            raise ConfigError(f"{source}: {field}: missing; a hardware spec needs {', '.join(REQUIRED)} "
                              "(SI units: FLOP/s, bytes, bytes/s, seconds)") from None
        got = json.dumps(_at(data, first["loc"]))
        raise ConfigError(f"{source}: {field}: got {got}; expected {_EXPECTED.get(field, 'a positive number')}"
                          ) from None


_EXPECTED = {"name": "a non-empty name", "device": '"cuda" or "cpu"', "compute_efficiency": "a number in (0, 1]",
             "process_overhead_bytes": "a number >= 0", "op_overhead_s": "a number >= 0",
             "overlap_communication": "true or false", "calibrate.layout": "a plan row's name"}


def load_hardware(path: str | Path) -> HardwareSpec:
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"--hardware {source}: cannot read it ({err.strerror or err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--hardware {source}: not JSON (line {err.lineno}: {err.msg})") from None
    return parse_hardware(data, source)


def _at(data: Any, loc: tuple) -> Any:
    for part in loc:
        if isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return None
    return data
