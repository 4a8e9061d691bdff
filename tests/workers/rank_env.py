"""Writes what this rank was given: its rank variables, whether a module in the launcher's working
directory is importable (it must not be: `python train.py` does not put the working directory on
sys.path), and sys.path's head. One JSON file per rank, in the directory given."""

import json
import os
import sys
from pathlib import Path

try:
    import module_in_the_working_directory  # noqa: F401
    shadowed = True
except ImportError:
    shadowed = False
names = ("RANK", "LOCAL_RANK", "GROUP_RANK", "CROSS_RANK", "CROSS_SIZE", "WORLD_SIZE")
record = {name: os.environ.get(name) for name in names}
record.update(shadowed=shadowed, path_head=sys.path[:2])
out = Path(sys.argv[sys.argv.index("--out") + 1])
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))
