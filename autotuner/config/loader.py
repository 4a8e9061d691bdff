"""Read a config from a JSON/hjson file or a dict, check its keys, validate it."""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping, Union

import hjson
from pydantic import ValidationError

from autotuner.core.frozen import freeze
from autotuner.config.keys import UNUSED_KEY_NOTES, check_keys
from autotuner.config.models import DeepSpeedConfig, ZeroConfig
from autotuner.config.sections import SECTIONS
from autotuner.core.errors import ConfigError
from autotuner.core.plugins import plugins_loaded

logger = logging.getLogger(__name__)

ConfigSource = Union[str, os.PathLike, Mapping[str, Any], DeepSpeedConfig]


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a JSON or hjson file (comments and trailing commas allowed) into a plain dict; a string
    that names no file but is a URL-safe base64 encoding of a config object is read as one, as
    DeepSpeed and Hugging Face's Trainer read `--deepspeed` (a job scheduler may pass it so)."""
    encoded = _base64_config(path)
    if encoded is not None:
        return _parse(encoded, BASE64_LABEL)
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; expected a JSON or hjson config file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read config file: {err}") from err
    return _parse(text, path)


BASE64_LABEL = "the base64-encoded config"
_BASE64 = re.compile(r"[A-Za-z0-9_-]+={0,2}")


def _base64_config(source: str | os.PathLike) -> str | None:
    """The decoded text, where `source` names no file and decodes (URL-safe base64) to text that
    opens an object; None otherwise, so a mistyped path is still reported as a missing file."""
    text = os.fspath(source)
    if not isinstance(text, str) or len(text) < 8 or not _BASE64.fullmatch(text) or os.path.exists(text):
        return None
    try:
        decoded = base64.urlsafe_b64decode(text).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


def config_label(source: str | os.PathLike) -> str:
    """How messages name a config: its path, or BASE64_LABEL."""
    return BASE64_LABEL if _base64_config(source) is not None else os.fspath(source)


def _parse(text: str, path: Path | str) -> dict[str, Any]:
    try:
        data = hjson.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except DuplicateKeyError as err:
        raise ConfigError(f"{path}: {err.key!r} is given twice in one object; give each key once (DeepSpeed "
                          "refuses duplicate keys too)") from None
    except hjson.HjsonDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}:{err.colno}: malformed JSON/hjson: {err.msg}") from err
    except OverflowError:  # hjson turns 1e400 into inf, then fails converting it to int
        raise ConfigError(_overflow_message(path, text)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be an object {{...}}, got {type(data).__name__}")
    # hjson returns OrderedDicts; a round trip through json gives plain types.
    return json.loads(json.dumps(data))


class DuplicateKeyError(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A key given twice: json and hjson keep the last silently; DeepSpeed refuses the file."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKeyError(key)
        seen[key] = value
    return seen


_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _overflow_message(path: Path, text: str) -> str:
    for lineno, line in enumerate(text.splitlines(), start=1):
        for match in _NUMBER.finditer(line):
            if math.isinf(float(match.group())):
                return (f"{path}:{lineno}:{match.start() + 1}: the number {match.group()} is too large "
                        "(beyond a 64-bit float, about 1.8e308); give a finite value")
    return f"{path}: a number is too large (beyond a 64-bit float, about 1.8e308); give finite values"


def _describe(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None), list, dict)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _format_validation_error(err: ValidationError, source: str, section: str | None = None) -> str:
    """One line: source, dotted path, the bad value, what is allowed. `section`: the registered
    section whose own model raised it (its locations are inside it)."""
    first = err.errors(include_url=False)[0]
    # Union members add their type name to loc ("int", "literal['auto']"); drop those.
    parts = [str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    parts = [section, *parts] if section else parts
    dotted = ".".join(parts) or "(top level)"
    if first["type"] == "value_error":
        allowed = first["msg"].removeprefix("Value error, ")
    elif parts[:2] == ["autotuning", "arg_mappings"]:
        # The mapped key's own name must not pick that key's hint: these values are flags.
        allowed = 'expected a flag of the script, e.g. "--per_device_train_batch_size"'
    else:
        allowed = _ALLOWED.get(dotted) or _ALLOWED.get(parts[-1] if parts else "", first["msg"])
    value = first.get("input")
    if isinstance(value, dict):  # a cross-field check: the message names the keys
        return f"{source}: {dotted}: {allowed}"
    return f"{source}: {dotted}: got {_describe(value)}; {allowed}"


_TYPE_TAGS = {"int", "bool", "float", "str", "list", "dict", "none", "constrained-int", "constrained-float",
              "function-after"}

_ALLOWED = {
    "train_batch_size": 'expected a positive integer or "auto"',
    "train_micro_batch_size_per_gpu": 'expected a positive integer, "auto", or a list of positive integers',
    "gradient_accumulation_steps": 'expected a positive integer or "auto" (a tune derives gas from the micro-batch and the global batch; list the micro-batches instead)',
    "stage": 'expected a ZeRO stage 0, 1, 2 or 3, a list of them, or "all"',
    "optimizer.type": 'expected "Adam", "AdamW" or "SGD"',
    "scheduler.type": 'expected "WarmupLR", "WarmupDecayLR" or "WarmupCosineLR"',
    "gradient_clipping": 'expected a number >= 0 (0 disables clipping) or "auto" (the Trainer fills it)',
    "fp16.enabled": 'expected true, false or "auto" (Hugging Face\'s Trainer fills it)',
    "reduce_bucket_size": 'expected a positive integer, a list of them, or "auto" (the Trainer fills it)',
    "stage3_prefetch_bucket_size": 'expected an integer >= 0, a list of them, or "auto" (the Trainer fills it)',
    "stage3_param_persistence_threshold": 'expected an integer >= 0, a list of them, or "auto" (the Trainer fills it)',
    "device": 'expected "none", "cpu" or "auto" (tuned, on a GPU)',
    "metric": 'expected "throughput", "latency" or "FLOPS"',
    "sampler": 'expected "gp" (optuna\'s GPSampler) or "tpe" (TPESampler)',
}


def _deprecated_zero_switch(raw: dict[str, Any], label: str) -> dict[str, Any]:
    """DeepSpeed's oldest form, `"zero_optimization": true` (stage 1, its bucket from a top-level
    allgather_size) or false (stage 0), read as DeepSpeed reads it."""
    switch = raw.get("zero_optimization")
    if not isinstance(switch, bool):
        return raw
    logger.warning("%s: \"zero_optimization\": %s is DeepSpeed's deprecated form; read as {\"stage\": %d}",
                   label, "true" if switch else "false", int(switch))
    zero: dict[str, Any] = {"stage": int(switch)}
    rest = {key: value for key, value in raw.items() if key != "allgather_size"}
    if switch and "allgather_size" in raw:
        zero["allgather_bucket_size"] = raw["allgather_size"]
    return {**rest, "zero_optimization": zero}


def _deprecated_offload_flags(raw: dict[str, Any], label: str) -> dict[str, Any]:
    """DeepSpeed's deprecated `zero_optimization.cpu_offload` / `cpu_offload_param`, read as it reads
    them: true is the offload section with device "cpu", false none; with the section too, refused."""
    if not isinstance(raw.get("zero_optimization"), dict):
        return raw
    zero = dict(raw["zero_optimization"])
    for section, olds in ZeroConfig.other_spellings.items():
        for old in olds:
            if old not in zero:
                continue
            value = zero.pop(old)
            if section in zero:
                raise ConfigError(f"{label}: zero_optimization.{old}: DeepSpeed's deprecated spelling of {section}, "
                                  f"which is set too; DeepSpeed refuses both, so keep only {section}")
            if not isinstance(value, bool) and value is not None:
                raise ConfigError(f"{label}: zero_optimization.{old}: got {_describe(value)}; expected true or false "
                                  f"(deprecated: {section}.device \"cpu\" says it)")
            if value:
                zero[section] = {"device": "cpu"}
    return {**raw, "zero_optimization": zero}


def load_config(source: ConfigSource, *, name: str | None = None) -> DeepSpeedConfig:
    """Load and validate a config from a path, a dict, or an existing DeepSpeedConfig.

    Known DeepSpeed keys we do not act on are dropped with one warning that lists them.
    """
    if isinstance(source, DeepSpeedConfig):
        return source
    plugins_loaded()  # a plugin's dimension may bring a section of its own (config/sections.py)
    if isinstance(source, Mapping):
        # Paths and other scalars become strings, as they would in a file.
        raw, label = json.loads(json.dumps(dict(source), default=str)), name or "config"
    else:
        raw, label = read_config_file(source), name or config_label(source)
    for name, olds in DeepSpeedConfig.other_spellings.items():  # DeepSpeed's older names of a section
        for old in olds:
            if old in raw and name not in raw:
                raw = {(name if key == old else key): value for key, value in raw.items()}
    raw = _deprecated_zero_switch(raw, label)
    raw = _deprecated_offload_flags(raw, label)
    kept, ignored = check_keys(raw, DeepSpeedConfig, label, sections={k: s.model for k, s in SECTIONS.items()})
    if ignored:
        notes = "".join(f" ({UNUSED_KEY_NOTES[key]})" for key in ignored if key in UNUSED_KEY_NOTES)
        logger.warning("%s: accepted but not used by autotuner: %s%s", label, ", ".join(ignored), notes)
    own = {key: value for key, value in kept.items() if key not in SECTIONS}
    try:
        config = DeepSpeedConfig.model_validate(own)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, label)) from err
    config._set_aside = freeze({key: raw[key] for key in ignored if key in raw})
    config._sections = {key: _validated_section(key, kept[key], label) for key in SECTIONS if key in kept}
    return config


def _validated_section(key: str, value: Any, label: str) -> Any:
    """A registered section's value through its own model; refused in one line naming the key."""
    try:
        return SECTIONS[key].model.model_validate(value)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, label, key)) from err
