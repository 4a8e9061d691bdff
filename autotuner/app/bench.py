"""`launcher --bench`: the Bluefog/Horovod synthetic benchmark over several world sizes.

Weak scaling: every world size keeps the config's per-rank micro-batch and gradient
accumulation, so train_batch_size = micro × gas × N grows with N. Each size is one trial
through the tuner's runner (warm unless autotuning.warm_start is false), in its own directory
under bench_results/, whose measurement request times steps W+1..W+N and exits. Per timed step i, samples/s is
train_batch_size / step_wall_s[i]; a size reports the mean over steps and 1.96 × the
population std, as Bluefog's `pytorch_benchmark.py` does (a spread, not a standard error).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from autotuner.config import DeepSpeedConfig, load_config
from autotuner.config.loader import config_label
from autotuner.config.batch import data_parallel_size
from autotuner.core.errors import ConfigError, UsageError
from autotuner.launch import LaunchOptions, build_plan
from autotuner.launch.options import RankFlags
from autotuner.launch.plan import default_nproc_per_node
from autotuner.launch.script_args import config_path
from autotuner.tuning.space.config_space import base_config
from autotuner.launch.stopping import Stopped
from autotuner.app.settle import check_arg_mappings
from autotuner.config.autotuning import AutotuningConfig
from autotuner.tuning.trials.trial import ExperimentSettings, Trial
from autotuner.tuning.trials.runner import Runner
from autotuner.execution.warm import make_runner
from autotuner.tuning.space.records import Objective, TrialState
from autotuner.tuning.space.experiment import Experiment

RESULTS_DIR = Path("bench_results")
CSV_FILE = "bench.csv"
CSV_COLUMNS = ("world_size", "samples_per_s", "ci95", "efficiency", "iterations", "error")
Z_95 = 1.96  # Bluefog's and Horovod's multiplier


@dataclass(frozen=True)
class ThroughputStats:
    """Whole-job samples/s over the timed steps: mean and 1.96 × population std."""

    samples_per_s: float
    ci95: float
    iterations: int

    @classmethod
    def of(cls, train_batch_size: int, step_wall_s: list[float]) -> "ThroughputStats":
        rates = [train_batch_size / wall for wall in step_wall_s if wall > 0]
        if not rates:
            raise ValueError("no positive step times to turn into samples/s")
        return cls(statistics.fmean(rates), Z_95 * statistics.pstdev(rates), len(rates))


@dataclass(frozen=True)
class BenchResult:
    """One world size: stats when its launch succeeded, else the reason it did not."""

    world_size: int
    stats: ThroughputStats | None = None
    error: str | None = None


@dataclass(frozen=True)
class Baseline:
    """What efficiency compares against: samples/s per rank at `world_size` ranks."""

    world_size: int
    per_rank_samples_per_s: float

    @property
    def label(self) -> str:
        return "1 rank" if self.world_size == 1 else f"{self.world_size} ranks, per rank"

    def efficiency(self, result: BenchResult) -> float:
        """Fraction of perfect linear scaling: X_N / (N × per-rank baseline)."""
        return result.stats.samples_per_s / (result.world_size * self.per_rank_samples_per_s)


def baseline_of(results: list[BenchResult]) -> Baseline | None:
    """The 1-rank result, else the smallest successful size normalised per rank; None if all failed."""
    ok = sorted((r for r in results if r.stats is not None), key=lambda r: r.world_size)
    if not ok:
        return None
    first = ok[0]
    return Baseline(first.world_size, first.stats.samples_per_s / first.world_size)


def total_line(result: BenchResult) -> str:
    stats = result.stats
    return f"Total samples/sec on {result.world_size} rank(s): {stats.samples_per_s:.1f} +- {stats.ci95:.1f}"


def efficiency_line(result: BenchResult, baseline: Baseline) -> str:
    return (f"Scaling efficiency on {result.world_size} rank(s): {100 * baseline.efficiency(result):.1f}% "
            f"(baseline: {baseline.label})")


def write_csv(path: Path, results: list[BenchResult]) -> None:
    """One row per size; efficiency is a fraction (1.0 = linear); failed sizes keep their error."""
    baseline = baseline_of(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for r in results:
            if r.stats is None:
                writer.writerow([r.world_size, "", "", "", 0, r.error])
            else:
                writer.writerow([r.world_size, f"{r.stats.samples_per_s:.3f}", f"{r.stats.ci95:.3f}",
                                 f"{baseline.efficiency(r):.4f}", r.stats.iterations, ""])


@dataclass(frozen=True)
class BenchSetup:
    """The validated request: what every world size runs."""

    experiment: Experiment  # stage, per-rank micro-batch and gas from the user's config
    world_sizes: tuple[int, ...]
    warmup: int
    iters: int
    settings: ExperimentSettings  # for world size 1; `for_world_size` adapts it
    tuning: AutotuningConfig  # how to launch (warm_start, warm_preload)


def _fixed_int(value, key: str, source: str, why: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        shown = "missing" if value is None else f"got {value!r}"
        raise ConfigError(f"{source}: {key}: {shown}; {why}")
    return value


def _batch_of(config: DeepSpeedConfig, source: str) -> tuple[int, int]:
    micro = _fixed_int(config.train_micro_batch_size_per_gpu, "train_micro_batch_size_per_gpu", source,
                       "--bench measures weak scaling at a fixed per-rank micro-batch: set "
                       "train_micro_batch_size_per_gpu to a positive integer")
    gas = config.gradient_accumulation_steps
    return micro, gas if isinstance(gas, int) else 1


def setup(args: argparse.Namespace) -> BenchSetup:
    """Check everything that can be checked before a launch (UsageError/ConfigError: exit 2)."""
    if args.autotuning:
        raise UsageError("--bench and --autotuning are separate modes; give one of them")
    if (args.num_nodes or 1) > 1 or args.rdzv_endpoint:
        raise UsageError("--bench runs on one node; drop --num_nodes/--rdzv_endpoint")
    if args.bench_warmup < 1:
        raise UsageError(f"--bench_warmup: got {args.bench_warmup}; expected at least 1 (the first step "
                         "has no previous step to time from)")
    if args.bench_iters < 2:
        raise UsageError(f"--bench_iters: got {args.bench_iters}; expected at least 2 timed steps")
    script_args = tuple(args.script_args)
    source = config_path(script_args)
    if source is None:
        raise UsageError("--bench needs the script's config: add --deepspeed ds.json after the script")
    world_sizes = tuple(sorted(set(args.nproc_per_node or (default_nproc_per_node(),))))
    for size in world_sizes:  # checks the script and each size before anything starts
        build_plan(LaunchOptions(script=args.script, script_args=script_args, nproc_per_node=size), sys.executable)
    config = load_config(source)
    source = config_label(source)  # what messages call it: its path, or that it came base64-encoded
    check_arg_mappings(config, source)
    micro, gas = _batch_of(config, source)
    tensor_parallel = config.tensor_parallel.size  # each rank count splits the model so: dp = ranks / it
    indivisible = [size for size in world_sizes if size % tensor_parallel]
    if indivisible:
        raise ConfigError(f"{source}: tensor_parallel.autotp_size {tensor_parallel}: does not divide --nproc_per_node "
                          f"{','.join(map(str, indivisible))}; bench rank counts that are multiples of it")
    stage = config.zero_optimization.stage
    if not isinstance(stage, int):
        raise ConfigError(f"{source}: zero_optimization.stage: got {stage!r}; --bench runs one stage: give 0, 1, 2 "
                          "or 3")
    settings = ExperimentSettings(
        script=args.script,
        script_args=script_args,
        base_config=base_config(config),
        nproc_per_node=1,
        data_parallel_size=1,
        objective=Objective("throughput"),
        timeout_s=config.autotuning.exp_timeout_s,
        start_profile_step=args.bench_warmup + 1,
        end_profile_step=args.bench_warmup + args.bench_iters,
        arg_mappings=dict(config.autotuning.arg_mappings),
        rank_flags=RankFlags(master_port=args.master_port or None),
    )
    if isinstance(config.train_batch_size, int):
        _say(f"note: {source} sets train_batch_size {config.train_batch_size}; --bench uses micro-batch x gas x "
             "world size instead (weak scaling)")
    experiment = Experiment(stage, micro, gas, tensor_parallel=tensor_parallel if tensor_parallel > 1 else 0)
    return BenchSetup(experiment, world_sizes, args.bench_warmup, args.bench_iters, settings, config.autotuning)


def for_world_size(settings: ExperimentSettings, world_size: int, tensor_parallel: int = 1) -> ExperimentSettings:
    """The settings at `world_size` ranks, data parallel over world / `tensor_parallel` of them."""
    return replace(settings, nproc_per_node=world_size,
                   data_parallel_size=data_parallel_size(world_size, tensor_parallel))


def run_world_size(bench_setup: BenchSetup, world_size: int, results_dir: Path, runner: Runner) -> BenchResult:
    """Launch the script on `world_size` ranks and turn its measurement into samples/s statistics."""
    settings = for_world_size(bench_setup.settings, world_size, max(1, bench_setup.experiment.tensor_parallel))
    exp_dir = results_dir / f"world_size_{world_size}"
    result = runner.run(Trial(bench_setup.experiment, exp_dir, settings))
    where = f" (see {exp_dir}/stderr.log)"
    if result.state is not TrialState.OK:
        return BenchResult(world_size, error=f"{result.error}{where}")
    values = list(result.measurement.step_wall_s_values)
    if not values or not result.measurement.train_batch_size:
        return BenchResult(world_size, error="metrics.json has no step_wall_s_values (per-step times); is the "
                           f"script using this package's engine?{where}")
    try:
        stats = ThroughputStats.of(int(result.measurement.train_batch_size), values)
    except ValueError as err:
        return BenchResult(world_size, error=f"{err}{where}")
    return BenchResult(world_size, stats=stats)


def _say(line: str) -> None:
    print(f"bench: {line}", flush=True)


def bench(args: argparse.Namespace) -> int:
    """Run every world size in ascending order; 0 if all succeeded, 1 if any failed."""
    bench_setup = setup(args)
    experiment = bench_setup.experiment
    _say(f"micro-batch {experiment.micro_batch_size} per rank, gas {experiment.gradient_accumulation_steps}, "
         f"ZeRO stage {experiment.zero_stage}; {bench_setup.warmup} warm-up + {bench_setup.iters} timed steps at "
         f"{','.join(map(str, bench_setup.world_sizes))} rank(s); runs in {RESULTS_DIR}/")
    results: list[BenchResult] = []
    with make_runner(bench_setup.tuning, bench_setup.settings, _say) as runner:
        try:
            for size in bench_setup.world_sizes:
                result = run_world_size(bench_setup, size, RESULTS_DIR, runner)
                results.append(result)
                if result.stats is None:
                    print(f"launcher: error: bench on {size} rank(s) failed: {result.error}", file=sys.stderr,
                          flush=True)
                else:
                    print(total_line(result), flush=True)
        except Stopped as stop:
            print(f"launcher: bench stopped by {stop.name}; running launch ended", file=sys.stderr, flush=True)
            stop.reported = True
            raise
    baseline = baseline_of(results)
    for result in results:
        if result.stats is not None:
            print(efficiency_line(result, baseline), flush=True)
    write_csv(RESULTS_DIR / CSV_FILE, results)
    _say(f"wrote {RESULTS_DIR / CSV_FILE}")
    return 0 if all(r.stats is not None for r in results) else 1
