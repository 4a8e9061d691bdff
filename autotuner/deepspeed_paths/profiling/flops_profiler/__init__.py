"""deepspeed.profiling.flops_profiler: FlopsProfiler and get_model_profile, on torch's FlopCounterMode."""

from autotuner.deepspeed_paths.profiling.flops_profiler.profiler import FlopsProfiler, get_model_profile  # noqa: F401
