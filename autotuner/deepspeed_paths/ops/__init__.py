"""`autotuner.ops`: DeepSpeed's optimizer classes, as the torch optimizers they compute."""
