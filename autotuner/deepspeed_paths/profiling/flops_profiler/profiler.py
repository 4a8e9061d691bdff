"""`deepspeed.profiling.flops_profiler.profiler`: the flops profiler the engine runs
(autotuner/runtime/progress/flops_profiler.py), with DeepSpeed's number formatters."""

from autotuner.runtime.progress.flops_profiler import (FlopsProfiler, duration_to_string, flops_to_string,
                                                       get_model_profile, macs_to_string, number_to_string,
                                                       params_to_string)

__all__ = ["FlopsProfiler", "duration_to_string", "flops_to_string", "get_model_profile", "macs_to_string",
           "number_to_string", "params_to_string"]
