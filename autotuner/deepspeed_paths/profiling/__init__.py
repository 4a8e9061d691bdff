"""deepspeed.profiling: the flops profiler (flops_profiler.profiler)."""
