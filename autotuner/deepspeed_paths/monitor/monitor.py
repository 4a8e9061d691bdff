"""`deepspeed.monitor.monitor`: the monitors the engine writes (autotuner/runtime/monitor.py)."""

from autotuner.runtime.monitor import MonitorMaster, TensorBoardMonitor, WandbMonitor, csvMonitor

__all__ = ["MonitorMaster", "TensorBoardMonitor", "WandbMonitor", "csvMonitor"]
