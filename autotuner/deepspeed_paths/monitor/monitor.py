"""`deepspeed.monitor.monitor`: the monitors the engine writes (autotuner/runtime/progress/monitor.py)."""

from autotuner.runtime.progress.monitor import MonitorMaster, TensorBoardMonitor, WandbMonitor, csvMonitor

__all__ = ["MonitorMaster", "TensorBoardMonitor", "WandbMonitor", "csvMonitor"]
