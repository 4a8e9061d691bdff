"""DeepSpeed's `deepspeed.runtime.*` paths that are not our engine (runtime.zero, runtime.pipe,
runtime.data_pipeline, runtime.domino, runtime.utils, runtime.config), reached as
`autotuner.runtime.<name>` through aliases.py. The engine itself is autotuner.runtime."""
