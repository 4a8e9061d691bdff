"""Whose engine a script trains on: ours (native torch distributed) or DeepSpeed's own.

A str enum, so the name written in records on disk, in the ranks' reports and in the search
space's per-engine tables stays the plain word, and a value read back compares equal to it."""

from __future__ import annotations

from enum import Enum


class Engine(str, Enum):
    DEEPSPEED = "deepspeed"
    OURS = "autotuner"

    # Printed and formatted as the plain word on every Python we support (3.10's str enums too).
    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def label(self) -> str:
        """In words, as messages say it."""
        return "our engine" if self is Engine.OURS else "DeepSpeed's engine"

    @property
    def other(self) -> "Engine":
        return Engine.DEEPSPEED if self is Engine.OURS else Engine.OURS
