"""Imported once by each warm forkserver, the tuner's or a Slurm node server's (multiprocessing's
preload): torch, our rank-side modules, and what the user's script imports, so that every warm
rank forked later starts with them loaded.

The modules come from AUTOTUNER_WARM_PRELOAD (a JSON list of "module" or "module:attribute";
an attribute is fetched too, since libraries such as transformers load lazily on attribute
access). Each failure is caught and listed in the AUTOTUNER_WARM_PRELOAD_REPORT file, with
whether CUDA was initialised: ranks forked from a process that initialised CUDA cannot use it.
Only the forkserver imports this module: importing it preloads.
"""

from __future__ import annotations

import importlib
import json
import os
import time

from autotuner.core.boundary import WARM_PRELOAD_ENV as PRELOAD_ENV
from autotuner.core.boundary import WARM_PRELOAD_REPORT_ENV as REPORT_ENV
from autotuner.core.parent_death import die_with_parent

die_with_parent()  # before the preload: a tuner killed outright takes the forkserver (and so its ranks) along

# Ours, and what our engine imports lazily in every measured launch (the FLOP counter pulls in dynamo).
ALWAYS = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.utils.flop_counter", "torch._dynamo",
          "autotuner", "autotuner.runtime.engine", "autotuner.runtime.initialize", "autotuner.launch.run_script",
          "autotuner.launch.warm_rank")


def _load(name: str) -> None:
    module_name, _, attribute = name.partition(":")
    module = importlib.import_module(module_name)
    if attribute:
        getattr(module, attribute)


def preload(names: list[str]) -> dict:
    started = time.monotonic()
    failed = {}
    loaded = []
    for name in [*ALWAYS, *names]:
        try:
            _load(name)
            loaded.append(name)
        except BaseException as err:  # noqa: BLE001 - a preload failure must not kill the forkserver
            failed[name] = f"{type(err).__name__}: {err}"[:300]
    import torch

    return {"loaded": loaded, "failed": failed, "cuda_initialized": bool(torch.cuda.is_initialized()),
            "seconds": round(time.monotonic() - started, 3), "pid": os.getpid()}


def _run() -> None:
    names = json.loads(os.environ.get(PRELOAD_ENV, "[]"))
    report = preload(names)
    path = os.environ.get(REPORT_ENV)
    if path:
        from autotuner.core.atomic import write_json_atomic

        write_json_atomic(path, report)


_run()
