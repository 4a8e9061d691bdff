"""What a training run reports as it goes, as DeepSpeed's engine does: monitors, tput_timer,
wall_clock_breakdown, the flops profiler and the progress line."""
