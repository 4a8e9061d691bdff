"""DeepSpeed's monitors on rank 0: TensorBoard event files, CSV files and Weights & Biases runs.

An event is DeepSpeed's tuple (name, value, step), for example ("Train/Samples/lr", 1e-3, 64);
the step is the count of samples trained. The folders are DeepSpeed's: output_path/job_name, with
"" meaning the launch directory, and one CSV per event name with a "step,<last name part>" header.
"""

from __future__ import annotations

import atexit
import csv
from pathlib import Path
from typing import Any, Iterable

from autotuner.config.reporting import CSVConfig, TensorBoardConfig, WandbConfig
from autotuner.core.errors import UnsupportedError

Event = tuple[str, float, int]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _missing(section: str, package: str, extra: str) -> UnsupportedError:
    return UnsupportedError(f"{section}.enabled is true, but the {package!r} package is not installed; "
                            f"pip install 'autotuner[{extra}]', or set {section}.enabled to false")


class TensorBoardMonitor:
    def __init__(self, config: TensorBoardConfig):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package
            raise _missing("tensorboard", "tensorboard", "monitor") from None
        self.log_dir = Path(config.output_path) / config.job_name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.summary_writer = SummaryWriter(log_dir=str(self.log_dir))

    def write_events(self, events: Iterable[Event], flush: bool = True) -> None:
        for name, value, step in events:
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            self.summary_writer.flush()

    def close(self) -> None:
        self.summary_writer.close()


class csvMonitor:  # noqa: N801 (DeepSpeed's class name)
    def __init__(self, config: CSVConfig):
        self.log_dir = Path(config.output_path) / config.job_name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.filenames: set[str] = set()

    def write_events(self, events: Iterable[Event]) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            path = self.log_dir / f"{filename}.csv"
            with open(path, "a", newline="") as handle:
                writer = csv.writer(handle)
                if filename not in self.filenames:  # DeepSpeed appends, writing a header once per run
                    self.filenames.add(filename)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


class WandbMonitor:
    def __init__(self, config: WandbConfig):
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb", "monitor") from None
        self._wandb = wandb
        self.run = wandb.init(project=config.project, group=config.group, entity=config.team)
        atexit.register(self.close)  # wandb's service process must end with the rank

    def write_events(self, events: Iterable[Event]) -> None:
        for name, value, step in events:
            self.run.log({name: value}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MonitorMaster:
    """Every enabled monitor, on rank 0; `enabled` is whether any section is on, as in DeepSpeed."""

    def __init__(self, config: Any, active: bool = True):
        sections = (config.tensorboard, config.wandb, config.csv_monitor)
        self.enabled = active and any(section.enabled for section in sections)
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = None
        if not self.enabled or _rank() != 0:
            return
        if config.tensorboard.enabled:
            self.tb_monitor = TensorBoardMonitor(config.tensorboard)
        if config.wandb.enabled:
            self.wandb_monitor = WandbMonitor(config.wandb)
        if config.csv_monitor.enabled:
            self.csv_monitor = csvMonitor(config.csv_monitor)

    def _monitors(self) -> list[Any]:
        return [m for m in (self.tb_monitor, self.wandb_monitor, self.csv_monitor) if m is not None]

    def write_events(self, events: Iterable[Event]) -> None:
        events = [(str(name), float(value), int(step)) for name, value, step in events]
        for monitor in self._monitors():
            monitor.write_events(events)

    def close(self) -> None:
        for monitor in self._monitors():
            monitor.close()
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = None
