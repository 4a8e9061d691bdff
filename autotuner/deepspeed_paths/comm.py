"""`autotuner.comm`, DeepSpeed's `deepspeed.comm` import path (`from autotuner import comm as dist`)."""

from autotuner.runtime.comm import *  # noqa: F401,F403 (the module's __all__ is the API)
from autotuner.runtime.comm import __all__  # noqa: F401
