"""`accelerate launch`'s part, for a script that trains through accelerate.

Hugging Face's accelerate scripts (`run_clm_no_trainer.py` and the rest) build a bare
`Accelerator()` and take no DeepSpeed flag of their own: `accelerate launch`, given a DeepSpeed
config (`distributed_type: DEEPSPEED`, `deepspeed_config_file`), hands it to the script through
the environment (accelerate's utils/launch.py: `ACCELERATE_USE_DEEPSPEED=true`,
`ACCELERATE_DEEPSPEED_CONFIG_FILE=PATH`), and never passes `--local_rank`. Our launcher takes
`--deepspeed PATH` as for any script; for such a script each rank moves it into those variables
before the script runs, and leaves out the `--local_rank` the script does not declare. A tune's
experiments, and the training its pick runs, reach the ranks the same way.

On CPU, accelerate 1.x sees one process under DeepSpeed whatever the launch: its PartialState finds
a backend only for an accelerator (or with `cpu=True`, which turns DeepSpeed off), so it counts
a world of 1 while DeepSpeed's comm runs on every rank. `cpu_world_for_accelerate` gives its state
the gloo group DeepSpeed then runs on, so it shards the data and gathers metrics over the launch's
ranks as on GPUs.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

from autotuner.core.import_hooks import when_loaded
from autotuner.core.script_imports import import_sites
from autotuner.launch.script_args import CONFIG_FLAGS, config_path, without_flag

# Scripts whose DeepSpeed config comes by their own flag (the Trainer's --deepspeed, a DeepSpeedPlugin
# the script builds from its arguments): not accelerate-launched.
_OWN_CONFIG_CLASSES = frozenset({"transformers:Trainer", "transformers:Seq2SeqTrainer", "transformers:TrainingArguments",
                                 "transformers:Seq2SeqTrainingArguments"})


def string_constants(script: str) -> set[str]:
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return set()
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def trains_through_accelerate(script: str) -> bool:
    """The script imports accelerate, neither deepspeed nor autotuner nor the Trainer, and names no
    DeepSpeed config flag of its own: accelerate's launcher would pass it its config."""
    sites = import_sites(script)
    tops = {site.top_level for site in sites}
    if "accelerate" not in tops or {"deepspeed", "autotuner"} & tops:
        return False
    if any(site.name in _OWN_CONFIG_CLASSES for site in sites):
        return False
    return not set(CONFIG_FLAGS) & string_constants(script)


def accelerate_rank_args(script: str, args: tuple[str, ...], environ: dict[str, str]) -> tuple[str, ...]:
    """The script's arguments as `accelerate launch` would give them, and its config moved into
    accelerate's variables in `environ` (a rank's own environment, before the script runs)."""
    if "--local_rank" not in string_constants(script):
        args = without_flag(args, "--local_rank")
    path = config_path(args)
    if path is None:
        return args  # no DeepSpeed config given: accelerate's own default (DDP)
    for flag in CONFIG_FLAGS:
        args = without_flag(args, flag)
    environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = os.path.abspath(path)
    return args


def cpu_world_for_accelerate() -> None:
    """On CPU under DeepSpeed, accelerate's state is given the gloo backend it finds no accelerator
    for (module docstring); where it finds one, or DeepSpeed is off, it decides as it would. Where
    its world still differs from the launch's, the rank stops in one line (refuse_another_world)."""

    def patch() -> None:
        state = sys.modules["accelerate.state"]
        chosen = state.PartialState._prepare_backend
        if getattr(chosen, "autotuner_cpu_world", False):
            return

        def prepare_backend(self, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
            name, kind = chosen(self, cpu, sagemaker_dp, backend)
            import torch

            if (name is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1
                    and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
                    and not torch.cuda.is_available()):
                return "gloo", kind  # DeepSpeed's comm then starts on gloo, and the state counts its world
            return name, kind

        prepare_backend.autotuner_cpu_world = True  # type: ignore[attr-defined]
        state.PartialState._prepare_backend = prepare_backend
        started = state.PartialState.__init__

        def checked_init(self, *args, **kwargs) -> None:
            started(self, *args, **kwargs)
            refuse_another_world(getattr(self, "num_processes", None))

        state.PartialState.__init__ = checked_init

    when_loaded("accelerate.state", patch)


def refuse_another_world(processes: int | None) -> None:
    """accelerate's state must count the launch's ranks: with fewer, every rank reads the same
    batches (and a tune would count them as distinct samples). Refused in one line, in the rank."""
    import torch.distributed as dist

    if processes is None or not dist.is_available() or not dist.is_initialized():
        return
    world = dist.get_world_size()
    if processes != world:
        from autotuner.core.errors import UnsupportedError

        raise UnsupportedError(f"accelerate counts {processes} process(es) while the launch runs {world} ranks, so "
                               "its data sharding and gathers would not be the ranks' (with fewer, every rank trains "
                               "on the same batches); let accelerate see the launch's process group")
