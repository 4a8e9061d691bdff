"""toy_train.py, slower at toy_knob.level "low" (a toy dimension's config key, tests/plugins/
toy_dimension.py), and checking that the engine in each rank was built with the level the
experiment's config gave: each rank writes it beside the config (toy_knob_seen.RANK)."""

import json
import os
import sys
from pathlib import Path

import autotuner

sys.path.insert(0, str(Path(__file__).parent))
import toy_train  # noqa: E402

config_path = sys.argv[sys.argv.index("--deepspeed") + 1]
given = json.loads(Path(config_path).read_text())["toy_knob"]["level"]
sys.argv += ["--ms_per_step", "60" if given == "low" else "0"]
_initialize = autotuner.initialize


def initialize(*args, **kwargs):
    built = _initialize(*args, **kwargs)
    level = built[0].config.section("toy_knob").level
    assert level == given, (level, given)
    Path(config_path).with_name(f"toy_knob_seen.{os.environ['RANK']}").write_text(level)
    return built


autotuner.initialize = initialize
toy_train.main()
