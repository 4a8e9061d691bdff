"""`autotuner.pipe` (DeepSpeed's `deepspeed.pipe`): importing it is refused with one line."""

from autotuner.unsupported import refuse

raise refuse("pipe")
