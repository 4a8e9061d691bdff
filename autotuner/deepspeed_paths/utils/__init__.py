"""`autotuner.utils`: what scripts take from `deepspeed.utils` (RepeatingLoader, logger, log_dist, and
the `groups` module, imported when first reached)."""

from __future__ import annotations

import logging
import sys


from autotuner.core.repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader", "log_dist", "logger"]


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is when a record is emitted (a test's capture, a rank's redirect)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _script_logger() -> logging.Logger:
    # DeepSpeed's logger: its own stdout handler, not propagated, WARNING by default (since 0.17.6).
    log = logging.getLogger("autotuner.script")
    if not log.handlers:
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                               "%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.WARNING)
        log.propagate = False
    return log


logger = _script_logger()


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log on the listed ranks ([-1]: all). As in DeepSpeed, with a process group and no ranks
    nothing is logged; without a process group every process logs as rank -1."""
    import torch.distributed as dist

    if not dist.is_initialized():
        rank = -1
    else:
        rank = dist.get_rank()
        if not ranks or (-1 not in ranks and rank not in ranks):
            return
    logger.log(level, f"[Rank {rank}] {message}")


def __getattr__(name: str):
    # `deepspeed.utils.groups` after a bare `import deepspeed`, without importing torch for every script.
    if name == "groups":
        import importlib

        return importlib.import_module(f"{__name__}.groups")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
