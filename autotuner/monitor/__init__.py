"""deepspeed.monitor: TensorBoard, CSV and Weights & Biases monitors, written by rank 0 (monitor.py)."""
