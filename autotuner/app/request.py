"""`launcher --autotuning tune|run` as a typed record: built once from the parsed command line, so
the settle pass and the tune read fields, never argparse's Namespace."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from autotuner.app.backend_options import backend_options
from autotuner.execution.backends import BackendOptions
from autotuner.launch import LaunchOptions


@dataclass(frozen=True)
class TuneRequest:
    mode: str  # "tune", "run" (tune, then train with the pick) or "plan" (profile, then cost every candidate)
    launch: LaunchOptions  # the launcher's options as given: the script, its arguments, the rank flags
    backend: BackendOptions  # --backend and its flags
    engine: str = "auto"  # --engine: "auto" (the script's imports say), "deepspeed" or "autotuner"
    debug: bool = False

    @classmethod
    def of(cls, args: argparse.Namespace) -> "TuneRequest":
        return cls(args.autotuning, LaunchOptions.from_args(args, rdzv_endpoint=None, rdzv_id=None),
                   backend_options(args), getattr(args, "engine", "auto"), bool(getattr(args, "debug", False)))

    @property
    def script(self) -> str:
        return self.launch.script

    @property
    def script_args(self) -> tuple[str, ...]:
        return self.launch.script_args
