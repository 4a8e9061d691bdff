"""deepspeed.monitor: the TensorBoard, CSV and Weights & Biases monitors rank 0 writes
(autotuner/runtime/progress/monitor.py, the engine's)."""
