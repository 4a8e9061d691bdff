"""The tuner's measurement inside a rank, for our engine and DeepSpeed's: timers, memory, FLOPs and
activations, the model's family, the collective probe, the gradient noise, the window's load, the
metrics, the rank's exit."""
