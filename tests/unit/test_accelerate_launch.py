"""accelerate launch's part for a script that trains through accelerate (launch/accelerate_launch.py):
which scripts it is for, what their ranks are given, and the refusal of another world. No processes."""

from __future__ import annotations

import pytest

from autotuner.core.errors import UnsupportedError
from autotuner.launch import accelerate_launch
from autotuner.launch.accelerate_launch import accelerate_rank_args, refuse_another_world, trains_through_accelerate

BARE = "from accelerate import Accelerator\nimport argparse\np = argparse.ArgumentParser()\np.add_argument('--lr')\n"


@pytest.mark.parametrize("source, through", [
    (BARE, True),
    ("import accelerate\n", True),
    (BARE + "p.add_argument('--deepspeed')\n", False),  # takes its own config flag (a DeepSpeedPlugin it builds)
    (BARE + "from transformers import Trainer\n", False),  # the Trainer takes --deepspeed
    (BARE + "import deepspeed\n", False),
    (BARE + "import autotuner as deepspeed\n", False),
    ("import torch\n", False),
])
def test_which_scripts_train_through_accelerate(tmp_path, source, through):
    script = tmp_path / "train.py"
    script.write_text(source)
    assert trains_through_accelerate(str(script)) is through


def test_the_config_goes_by_accelerates_variables_and_no_local_rank_the_script_does_not_declare(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(BARE)
    environ: dict[str, str] = {}
    args = accelerate_rank_args(str(script), ("--local_rank=1", "--lr", "3", "--deepspeed", "ds.json"), environ)
    assert args == ("--lr", "3")
    assert environ["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"].endswith("/ds.json")
    script.write_text(BARE + "p.add_argument('--local_rank', type=int)\n")
    assert accelerate_rank_args(str(script), ("--local_rank=1", "--deepspeed=ds.json"), {}) == ("--local_rank=1",)
    untouched: dict[str, str] = {}  # no DeepSpeed config: accelerate's own default (DDP), nothing set
    assert accelerate_rank_args(str(script), ("--local_rank=0",), untouched) == ("--local_rank=0",) and not untouched


def test_accelerate_counting_another_world_than_the_launchs_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(accelerate_launch, "refuse_another_world", refuse_another_world)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    refuse_another_world(2)
    refuse_another_world(None)  # accelerate not set up yet
    with pytest.raises(UnsupportedError) as refused:
        refuse_another_world(1)
    assert str(refused.value).startswith("accelerate counts 1 process(es) while the launch runs 2 ranks")
    assert "\n" not in str(refused.value)
