"""`autotuner.moe` (DeepSpeed's `deepspeed.moe`): importing it is refused with one line."""

from autotuner.unsupported import refuse

raise refuse("moe")
