"""`--hardware SPEC.json`: the accelerator and links a plan costs a layout on, for hardware that is
not on this machine (issue 80, part 3). SI units: FLOP/s, bytes, bytes/s, seconds.

    {"name": "A100 SXM 80GB", "peak_bf16_flops": 312e12, "memory_bytes": 85899345920,
     "memory_bandwidth": 2.039e12, "accelerators_per_node": 8,
     "intra_node": {"bandwidth": 300e9, "latency": 5e-6},
     "inter_node": {"bandwidth": 25e9, "latency": 10e-6}}

A link's bandwidth is what one accelerator sends one way (NVLink's per-direction figure inside a
node; its own network card's between nodes). Further fields are allowed and kept (a datasheet's
other figures); these are required, each positive. A file that is not JSON, a field missing or not
a positive number is refused in one line naming the file and the field (exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from autotuner.core.errors import ConfigError


def _a_number(value: Any) -> Any:
    # JSON true is not a bandwidth; pydantic's lax mode would read it as 1.
    if isinstance(value, (bool, str)):
        raise ValueError("expected a number")
    return value


Positive = Annotated[float, BeforeValidator(_a_number), Field(gt=0)]
PositiveCount = Annotated[int, BeforeValidator(_a_number), Field(gt=0)]


class Link(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    bandwidth: Positive  # bytes/s, one accelerator, one way
    latency: Positive  # seconds a message pays before its first byte


class HardwareSpec(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1)
    peak_bf16_flops: Positive
    memory_bytes: Positive
    memory_bandwidth: Positive
    accelerators_per_node: PositiveCount
    intra_node: Link
    inter_node: Link


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
        if first["type"] == "missing":
            raise ConfigError(f"{source}: {field}: missing; a hardware spec needs {', '.join(REQUIRED)} "
                              "(SI units: FLOP/s, bytes, bytes/s, seconds)") from None
        got = json.dumps(_at(data, first["loc"]))
        raise ConfigError(f"{source}: {field}: got {got}; expected "
                          f"{'a non-empty name' if field == 'name' else 'a positive number'}") from None


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
