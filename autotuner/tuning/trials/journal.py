"""The journal of finished launches (exp.json in each experiment's directory) and the fingerprint
that decides whether a record may be reused.

A record is reused only when its fingerprint equals the current run's: the same script (path and
content), the same arguments apart from the flags the tuner sets, the same config apart from its
autotuning section (as settled and as written, so keys only DeepSpeed's engine reads count), the
same profile window and readings, the same ranks and launcher flags, the same torch and engine
libraries, the same device and usable CPUs, the same environment variables that change a
measurement. Records
from a different run are moved aside into `exps_dir/earlier/<time>/`, never deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autotuner.core.atomic import write_json_atomic
from autotuner.launch.plan import usable_cpus
from autotuner.launch.script_args import CONFIG_FLAGS, find_flag
from autotuner.tuning.space.records import TrialResult

RECORD_FILE = "exp.json"
EARLIER_DIR = "earlier"
JOURNAL_VERSION = 3
# Variables of the tuner's environment that reach every rank and change what it measures: thread
# counts, the allocators, the collectives' transports, DeepSpeed's accelerator choice.
MEASURED_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "PYTORCH_", "CUDA_VISIBLE_DEVICES", "MALLOC_", "GLIBC_TUNABLES",
                         "NCCL_", "TORCH_NCCL_", "GLOO_", "DS_ACCELERATOR")
ENGINE_LIBRARIES = ("deepspeed", "transformers", "accelerate")


@dataclass(frozen=True)
class Fingerprint:
    """What makes two tuning runs measure the same thing."""

    script: str  # resolved path
    script_sha256: str
    script_args: tuple[str, ...]  # without the mapped flags and the config flag
    config_sha256: str  # the base config without its autotuning section
    nproc_per_node: int
    num_nodes: int
    launcher_args: tuple[str, ...]
    torch_version: str
    device: str  # type and name, e.g. "cuda NVIDIA H100 80GB HBM3" or "cpu x86_64 ..."
    measured_as: str = ""  # the profile window and what each launch reads beside it
    libraries: str = ""  # the engine libraries' versions, e.g. "deepspeed 0.19.8, transformers none"
    environment: tuple[tuple[str, str], ...] = ()  # MEASURED_ENV_PREFIXES' variables, sorted

    # What a changed field means, in the words of the one-line notice.
    REASONS = {
        "script": "script path changed", "script_sha256": "script changed", "script_args": "script arguments changed",
        "config_sha256": "config changed", "nproc_per_node": "ranks per node changed",
        "num_nodes": "number of nodes changed", "launcher_args": "launcher flags changed",
        "torch_version": "torch version changed", "device": "device changed",
        "measured_as": "profile window or readings changed", "libraries": "engine library versions changed",
        "environment": "environment variables of the ranks changed",
    }

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["script_args"] = list(self.script_args)
        data["launcher_args"] = list(self.launcher_args)
        data["environment"] = [list(pair) for pair in self.environment]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Fingerprint":
        values = dict(data)
        values["script_args"] = tuple(values["script_args"])
        values["launcher_args"] = tuple(values["launcher_args"])
        values["environment"] = tuple(tuple(pair) for pair in values.get("environment", ()))
        return cls(**values)

    def differences(self, other: "Fingerprint") -> list[str]:
        return [reason for name, reason in self.REASONS.items() if getattr(self, name) != getattr(other, name)]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unmapped_args(script_args: tuple[str, ...], flags: tuple[str, ...],
                  bool_flags: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The arguments without the given flags (either form) and their values (a bool flag's only
    where it is a bool word: `--gradient_checkpointing data.txt` keeps the script's data.txt)."""
    args = list(script_args)
    for flag in flags:
        while (found := find_flag(tuple(args), flag, boolean=flag in bool_flags)) is not None:
            index, value = found
            separate = args[index] == flag and value is not None
            del args[index:index + (2 if separate else 1)]
    return tuple(args)


def fingerprint_of(*, script: str, script_args: tuple[str, ...], mapped_flags: tuple[str, ...],
                   base_config: dict[str, Any], nproc_per_node: int, num_nodes: int,
                   launcher_args: tuple[str, ...], torch_version: str, device: str,
                   user_config: dict[str, Any] | None = None, measured_as: str = "",
                   environ: dict[str, str] | None = None, own_modules: tuple[Path, ...] = (),
                   bool_flags: frozenset[str] = frozenset()) -> Fingerprint:
    # Settled, and as written: keys only DeepSpeed's engine reads are dropped from the settled one.
    config = {"settled": {key: value for key, value in base_config.items() if key != "autotuning"},
              "written": {key: value for key, value in (user_config or {}).items() if key != "autotuning"}}
    return Fingerprint(
        script=str(Path(script).resolve()),
        script_sha256=script_sha256(script, own_modules),
        script_args=unmapped_args(script_args, (*mapped_flags, *CONFIG_FLAGS), bool_flags),
        config_sha256=_sha256(json.dumps(config, sort_keys=True, default=str).encode()),
        nproc_per_node=nproc_per_node,
        num_nodes=num_nodes,
        launcher_args=tuple(launcher_args),
        torch_version=torch_version,
        device=device,
        measured_as=measured_as,
        libraries=library_versions(),
        environment=tuple(sorted((name, value) for name, value in (os.environ if environ is None else environ).items()
                                 if name.startswith(MEASURED_ENV_PREFIXES))),
    )


def script_sha256(script: str, own_modules: tuple[Path, ...] = ()) -> str:
    """The script's content and that of its own modules beside it that it imports (a model.py
    edited next to train.py changes what is measured as much as train.py would)."""
    digest = hashlib.sha256(Path(script).read_bytes())
    for module in own_modules:
        digest.update(module.name.encode() + b"\0" + module.read_bytes())
    return digest.hexdigest()


def library_versions() -> str:
    """The engine libraries' versions, read from their metadata (nothing is imported)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "none"

    return ", ".join(f"{name} {version(name)}" for name in ENGINE_LIBRARIES)


def this_device() -> str:
    """The device the ranks will use, named without making a CUDA context in the tuner."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"cuda {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    except ImportError:
        pass
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "")
    return f"cpu {platform.machine()} {model} x{usable_cpus()}".strip()


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return "none"


def write_entry(directory: Path, result: TrialResult, fingerprint: Fingerprint) -> None:
    write_json_atomic(directory / RECORD_FILE, {"version": JOURNAL_VERSION, "fingerprint": fingerprint.to_json(),
                                                "result": result.to_json()})


@dataclass(frozen=True)
class Journal:
    """Finished records of this run, by experiment directory name, and what was set aside."""

    reusable: dict[str, TrialResult]
    set_aside: int
    reasons: tuple[str, ...]
    moved_to: Path | None

    @property
    def notice(self) -> str | None:
        if not self.set_aside:
            return None
        why = ", ".join(self.reasons) or "unknown format"
        return (f"{self.set_aside} earlier records are from a different run ({why}): not reused; "
                f"kept in {self.moved_to}")


def _read_entry(path: Path) -> tuple[Fingerprint | None, TrialResult | None]:
    try:
        data = json.loads(path.read_text())
        if data.get("version") != JOURNAL_VERSION:
            return None, None
        return Fingerprint.from_json(data["fingerprint"]), TrialResult.from_json(data["result"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def load_journal(exps_dir: Path, fingerprint: Fingerprint) -> Journal:
    """Read every experiment directory's record. Those of another run (or of an unreadable format)
    are moved, with their whole directory, into exps_dir/earlier/<time>/; the rest are reusable."""
    reusable: dict[str, TrialResult] = {}
    foreign: list[Path] = []
    reasons: list[str] = []
    for record in sorted(exps_dir.glob(f"*/{RECORD_FILE}")):
        theirs, result = _read_entry(record)
        if theirs is None or result is None:
            foreign.append(record.parent)
            continue
        differences = fingerprint.differences(theirs)
        if differences:
            foreign.append(record.parent)
            reasons += [reason for reason in differences if reason not in reasons]
        elif result.state.finished:
            reusable[record.parent.name] = result
    if not foreign:
        return Journal(reusable, 0, (), None)
    aside = exps_dir / EARLIER_DIR / time.strftime("%Y%m%d-%H%M%S")
    suffix = 0
    while aside.exists():
        suffix += 1
        aside = aside.with_name(f"{aside.name.split('.')[0]}.{suffix}")
    aside.mkdir(parents=True)
    for directory in foreign:
        shutil.move(str(directory), str(aside / directory.name))
    return Journal(reusable, len(foreign), tuple(reasons), aside)
