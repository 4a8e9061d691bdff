"""`python -m autotuner.runtime.measure.census_run SCRIPT ARGS...`: the script run once as rank 0 of a fake
world of AUTOTUNER_CENSUS_WORLD ranks, torch's default device the meta device, its step counted by
the census engine `initialize` returns there (census.py). An error the engine raises is one line,
its exit status the error's (2 for a script the plan cannot count)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from autotuner.core.errors import AutotunerError
from autotuner.runtime.measure.census import WORLD_ENV


def main() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = int(os.environ[WORLD_ENV])
    script, *args = sys.argv[1:]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world)})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    torch.set_default_device("meta")
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except AutotunerError as err:
        print(f"autotuner: error: {err}", file=sys.stderr)
        raise SystemExit(err.exit_code) from None
    raise SystemExit(f"autotuner: error: {script} ended without a step: the plan counts one forward, backward "
                     "and engine.step()")


if __name__ == "__main__":
    main()
