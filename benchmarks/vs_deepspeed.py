"""The real DeepSpeed autotuner against ours: same machine, workload, search space and engine.

    python benchmarks/vs_deepspeed.py [--max_micro 64] [--rounds 2] [--grid_micro 8,16,32,64]
                                      [--start_step 3 --end_step 5] [--venv output/ds_venv]
                                      [--width 1024 --depth 4] [--max_train_batch_size N]
                                      [--our_engines deepspeed[,autotuner]] [--harness auto|deepspeed|autotuner]

1. Setup: DeepSpeed's autotuner runs from its own virtualenv (`--venv`, created here if missing:
   torch==2.13.0, wheel, tabulate, then deepspeed==0.19.8 with DS_BUILD_OPS=0 DS_ACCELERATOR=cpu
   --no-build-isolation). If that fails the benchmark stops with a message and exit status 0.
   pdsh is never installed (its clean-up would run `pkill -f` over ssh). Our tuner on DeepSpeed's
   engine needs the same DeepSpeed in this Python (the `autotuner[deepspeed]` extra).
2. Both autotuners tune benchmarks/workloads/dual_engine.py (the minimal example's residual MLP,
   same synthetic data, Adam lr 1e-3) over the same space: ZeRO stages 0-3, micro-batch "auto"
   up to --max_micro, gradient_accumulation_steps fixed at 1 (or, with --max_train_batch_size,
   tuned by both as that global batch / (micro x 2)), fast mode, the same profile steps,
   2 CPU ranks with OMP_NUM_THREADS=1 each, no memory cap (every stage fits on this machine).
   DeepSpeed: `deepspeed --autotuning tune --num_gpus 2 dual_engine.py --engine deepspeed
   --deepspeed --deepspeed_config ds.json` with DS_ACCELERATOR=cpu, LOCAL_SIZE=2, the venv's bin
   first on PATH; its config adds `"torch_adam": true` (its fused Adam is GPU-only) and gives the
   stages as [0, 1, 2, 3]. Ours, once per --our_tuner_types entry and --our_engines entry:
   `python -m autotuner --autotuning tune --nproc_per_node 2 --engine E dual_engine.py --engine E
   ...` with stage "all"; with E = deepspeed (the default; rows ours_<type>_on_deepspeed) it
   drives the very script and engine DeepSpeed's autotuner drives, unchanged. Both run under a
   whole-run timeout, because DeepSpeed has no per-experiment one (its #4100). DeepSpeed exits 0
   even when every experiment failed, so its result is read from autotuning_results/
   (summary.txt, ds_config_optimal.json and each experiment's own metrics.json / stderr.log), not
   from its exit status.
3. The picks (and the best of an optional small exhaustive grid, stages 0-3 x --grid_micro) are
   re-measured by ONE neutral harness, interleaved A B [C] A B [C] for --rounds rounds and scored
   by the median: the workload on --harness's engine (auto: DeepSpeed's whenever a tuner ran on
   it), launched by our launcher and timed inside the ranks the same way for every pick -- samples/s
   over the profile steps, boundary to boundary, data loading included (on DeepSpeed's engine by
   the hook around DeepSpeedEngine, never by DeepSpeed's own timers). The tuners' own metrics use
   different timers (DeepSpeed's covers fwd+bwd+step of the last step only), so only the
   re-measured numbers are compared.
Results: benchmarks/results/vs_deepspeed.csv and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from autotuner.app.measure import Experiment, ExperimentSettings, TrialState, journaled_result, measurement_settings
from tuning_quality import measure_rounds, median_value, merge_csv, spread

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "benchmarks" / "workloads" / "dual_engine.py"
DS_VERSION = "0.19.8"
TORCH_VERSION = "2.13.0"


def log(message: str) -> None:
    print(f"[vs_deepspeed {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------- setup

def ensure_venv(venv: Path) -> str | None:
    """Create the DeepSpeed virtualenv if needed; None when ready, else why not."""
    python, deepspeed = venv / "bin" / "python", venv / "bin" / "deepspeed"
    if python.exists() and deepspeed.exists():
        check = subprocess.run([str(python), "-c", "import deepspeed, tabulate; print(deepspeed.__version__)"],
                               capture_output=True, text=True, env=ds_env(venv))
        if check.returncode == 0:
            log(f"using {venv} (deepspeed {check.stdout.strip().splitlines()[-1]})")
            return None
        log(f"{venv} exists but `import deepspeed` fails; reinstalling into it")
    steps = [
        ([sys.executable, "-m", "venv", str(venv)], {}),
        ([str(venv / "bin" / "pip"), "install", f"torch=={TORCH_VERSION}", "wheel", "tabulate"], {}),
        ([str(venv / "bin" / "pip"), "install", "--no-build-isolation", f"deepspeed=={DS_VERSION}"],
         {"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}),
    ]
    venv.parent.mkdir(parents=True, exist_ok=True)
    install_log = venv.parent / "ds_venv_install.log"
    with open(install_log, "a") as handle:
        for command, extra in steps:
            log("setup: " + shlex.join(command))
            done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=dict(os.environ, **extra))
            if done.returncode != 0:
                return f"`{shlex.join(command)}` failed with status {done.returncode}; see {install_log}"
    return None


def prebuild_shm_comm(python: str, env: dict) -> None:
    """DeepSpeed JIT-builds its CPU shared-memory comm op in the first rank that needs it (about
    30 s here), then loads it from TORCH_EXTENSIONS_DIR. Build it before any tuner is timed, once
    per Python: each virtualenv keeps its own cache, as a build for one venv's include paths is
    rebuilt by the other's."""
    started = time.monotonic()
    code = ("from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()")
    done = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True)
    state = "ready" if done.returncode == 0 else f"failed ({done.stderr.strip().splitlines()[-1:]})"
    log(f"DeepSpeed shm comm op for {python}: {state} in {time.monotonic() - started:.1f} s "
        f"(cache {env.get('TORCH_EXTENSIONS_DIR')})")


def shm_buffers() -> set[Path]:
    return set(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))


def sweep_shm(before: set[Path]) -> float:
    """DeepSpeed's CPU allreduce leaves 66 MiB per rank in /dev/shm (RAM) per run, never unlinked.
    Remove what appeared since `before`, so one tuner's leak cannot starve the next phase of
    memory; return how many MiB that tuner left."""
    new = shm_buffers() - before
    size = sum(path.stat().st_size for path in new if path.exists())
    for path in new:
        path.unlink(missing_ok=True)
    return size / 2**20


def ds_env(venv: Path, extensions: Path | None = None) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONPATH"] = str(ROOT)  # the workload imports examples/ and, under our engine, autotuner/
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    return env


# ---------------------------------------------------------------- configs

def user_config(tuner: str, engine: str, args, results: Path, exps: Path) -> dict:
    """The user's ds.json for `tuner` ("deepspeed" or "autotuner") on `engine` (whose engine trains)."""
    optimizer = {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0}}
    if engine == "deepspeed":
        optimizer["params"]["torch_adam"] = True  # DeepSpeed's FusedAdam is GPU-only; ours ignores the key
    if not args.max_train_batch_size:
        batch = {"gradient_accumulation_steps": 1}
    elif tuner == "deepspeed":
        batch = {}  # DeepSpeed derives gas from max_train_batch_size itself
    else:
        batch = {"gradient_accumulation_steps": "auto"}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        **batch,
        "steps_per_print": 1000,
        "optimizer": optimizer,
        "zero_optimization": {"stage": [0, 1, 2, 3] if tuner == "deepspeed" else "all"},
        "autotuning": {
            "enabled": True,
            "fast": True,
            "overwrite": True,
            "results_dir": str(results),
            "exps_dir": str(exps),
            "metric": "throughput",
            "start_profile_step": args.start_step,
            "end_profile_step": args.end_step,
            "max_train_micro_batch_size_per_gpu": args.max_micro,
            **({"max_train_batch_size": args.max_train_batch_size} if args.max_train_batch_size else {}),
            **({"exp_timeout_s": 300} if tuner == "autotuner" else {}),
        },
    }


def workload_args(engine: str, config_path: str, args) -> list[str]:
    return [str(SCRIPT), "--engine", engine, "--width", str(args.width), "--depth", str(args.depth),
            "--steps", "50", "--deepspeed", "--deepspeed_config", config_path]


# ---------------------------------------------------------------- running a tuner

def run_bounded(command: list[str], cwd: Path, env: dict, timeout_s: float, log_name: str) -> tuple[int | None, float]:
    """Run in its own session; on timeout end that session's process group (ours, by id)."""
    started = time.monotonic()
    with open(cwd / f"{log_name}.stdout.log", "w") as out, open(cwd / f"{log_name}.stderr.log", "w") as err:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log(f"{log_name}: over {timeout_s:.0f} s, ending its process group {process.pid}")
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            code = None
    return code, time.monotonic() - started


def parse_ds_name(name: str) -> Experiment | None:
    found = re.match(r"z(\d)_gas(\d+)_tmbspg(\d+)$", name)
    return Experiment(int(found[1]), int(found[3]), int(found[2])) if found else None


def first_error_line(text: str) -> str | None:
    for line in text.splitlines():
        if re.search(r"(Error|Exception)\b", line) and "Warning" not in line:
            return line.strip()[:300]
    return None


def run_deepspeed(args, work: Path, venv: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    results, exps = work / "autotuning_results", work / "autotuning_exps"
    (work / "ds.json").write_text(json.dumps(user_config("deepspeed", "deepspeed", args, results, exps), indent=2))
    command = [str(venv / "bin" / "deepspeed"), "--autotuning", "tune", "--num_gpus", "2",
               *workload_args("deepspeed", "ds.json", args)]
    log("DeepSpeed: " + shlex.join(command))
    env = ds_env(venv, ROOT / "output" / "torch_extensions")
    code, wall = run_bounded(command, work, env, args.tuner_timeout_s, "deepspeed_tune")
    return deepspeed_outcome(work, command, code, wall)


def deepspeed_outcome(work: Path, command: list[str], code: int | None, wall: float) -> dict:
    """What DeepSpeed's autotuner did in `work`, read from its results folder and logs (its exit
    status says nothing: it exits 0 even when every experiment failed)."""
    results = work / "autotuning_results"
    stdout = (work / "deepspeed_tune.stdout.log").read_text(errors="replace")
    stderr = (work / "deepspeed_tune.stderr.log").read_text(errors="replace")
    experiments, problems = [], []
    for exp_dir in sorted(p for p in results.glob("*") if p.is_dir()) if results.exists() else []:
        metrics_file = exp_dir / ("model_info.json" if exp_dir.name == "profile_model_info" else "metrics.json")
        err_file = exp_dir / "stderr.log"
        err_text = err_file.read_text(errors="replace") if err_file.exists() else ""
        value = None
        if metrics_file.exists() and exp_dir.name != "profile_model_info":
            value = json.loads(metrics_file.read_text()).get("throughput")
        error = first_error_line(err_text)
        experiments.append({"name": exp_dir.name, "throughput": value, "has_metrics": metrics_file.exists(),
                            "stderr_error": error})
        if error:
            problems.append(f"{exp_dir.name}: {error}")
    optimal_file = results / "ds_config_optimal.json"
    chosen = None
    best_name = None
    summary = (results / "summary.txt").read_text() if (results / "summary.txt").exists() else ""
    found = re.search(r"^\|\s*global\s*\|\s*\d+\s*\|\s*([\d.]+)\s*\|\s*(\S+)\s*\|", summary, re.M)
    reported = float(found[1]) if found else None
    if found:
        best_name = found[2]
    if optimal_file.exists():
        optimal = json.loads(optimal_file.read_text())
        chosen = Experiment(int(optimal["zero_optimization"]["stage"]), int(optimal["train_micro_batch_size_per_gpu"]),
                            int(optimal.get("gradient_accumulation_steps", 1)))
    elif best_name:
        chosen = parse_ds_name(best_name)
    elif code is None:
        # Stopped at its cap before it wrote a pick: its best experiment so far, by its own metric.
        measured = [e for e in experiments if e["throughput"] and parse_ds_name(e["name"])]
        if measured:
            best = max(measured, key=lambda e: e["throughput"])
            chosen, reported = parse_ds_name(best["name"]), best["throughput"]
            problems.append(f"stopped at its time cap: its best experiment so far, {best['name']}, stands for its pick")
    # every DeepSpeed experiment the log says it launched, including the stale-metric refinement probes
    logged = re.findall(r"(?:metric_val|throughput)[^\n]*", stdout)
    no_metrics = [e["name"] for e in experiments if not e["has_metrics"]]
    if no_metrics:
        problems.append(f"no metrics file: {', '.join(no_metrics)}")
    if code == 0 and chosen is None:
        problems.append("exit status 0 but no optimal config was found")
    for pattern in ("KeyError", "Traceback", "Tuner Error", "No optimal DeepSpeed configuration",
                    "pdsh", "not found"):
        hits = [line.strip() for line in (stdout + stderr).splitlines() if pattern in line]
        if hits:
            problems.append(f"log has {len(hits)} line(s) with '{pattern}', e.g. {hits[0][:200]}")
    return {"tuner": "deepspeed", "command": shlex.join(command), "returncode": code, "wall_s": wall,
            "experiments": len(experiments), "failed": sum(1 for e in experiments
                                                          if not e["has_metrics"] or e["stderr_error"]),
            "chosen": chosen, "reported_metric": reported, "per_experiment": experiments,
            "problems": problems, "logged_lines": len(logged)}


def our_tuner_name(tuner_type: str, engine: str) -> str:
    return f"ours_{tuner_type}" + ("_on_deepspeed" if engine == "deepspeed" else "")


def run_ours(args, work: Path, tuner_type: str, engine: str) -> dict:
    """Our autotuner on `engine`: "autotuner" (the workload on our engine) or "deepspeed" (the same
    unchanged DeepSpeed script DeepSpeed's autotuner drives, on DeepSpeed's engine)."""
    work.mkdir(parents=True, exist_ok=True)
    results, exps = work / "autotuning_results", work / "autotuning_exps"
    config = user_config("autotuner", engine, args, results, exps)
    config["autotuning"]["tuner_type"] = tuner_type
    (work / "ds.json").write_text(json.dumps(config, indent=2))
    command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", "2",
               "--engine", engine, *workload_args(engine, "ds.json", args)]
    name = our_tuner_name(tuner_type, engine)
    log(f"{name}: " + shlex.join(command))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu")
    code, wall = run_bounded(command, work, env, args.tuner_timeout_s, "ours_tune")
    return our_outcome(work, name, command, code, wall, engine)


def _mib(value) -> float | None:
    return round(value / 2**20, 1) if value else None


def _experiment_records(exps: Path) -> list:
    """Each finished launch's journaled result under `exps` (re-measurements' folders included), by folder."""
    return [(path.parent.name, journaled_result(path.parent)) for path in sorted(exps.glob("*/exp.json"))]


def our_outcome(work: Path, name: str, command: list[str], code: int | None, wall: float, engine: str) -> dict:
    """What our tuner did in `work`, read from its experiments.csv."""
    results = work / "autotuning_results"
    problems, chosen, reported, launched_count, failed = [], None, None, 0, 0
    csv_path = results / "experiments.csv"
    per_experiment = []
    if csv_path.exists():
        table = pd.read_csv(csv_path)
        # Every launch counts: profile launches (phase "profile") and final-pick re-measurements too.
        launched = table[table.state != "pruned"]
        launched_count, failed = len(launched), int((launched.state != "ok").sum())
        picked = table[table.chosen]
        if len(picked):
            best = picked.iloc[0]
            chosen = Experiment(int(best.zero_stage), int(best.micro_batch_size), int(best.gradient_accumulation_steps))
            reported = float(best.metric_value)
        columns = [c for c in ("name", "phase", "state", "metric_value", "predicted_memory_mib",
                               "measured_memory_mib") if c in launched.columns]
        per_experiment = launched[columns].to_dict("records")
        engines = set(launched.get("engine", pd.Series(dtype=str)).dropna())
        if engines and engines != {engine}:
            problems.append(f"launches ran on {sorted(engines)}, expected {engine}")
    elif records := _experiment_records(work / "autotuning_exps"):
        # Stopped before its summary (a time cap): each finished launch left its record, and the best
        # so far stands for its pick, as for DeepSpeed's autotuner stopped at its cap.
        problems.append(f"no {csv_path}: read {len(records)} experiment record(s); its best so far stands for its pick")
        launched_count, failed = len(records), sum(r.state is not TrialState.OK for _, r in records)
        ok = [r for _, r in records if r.state is TrialState.OK and r.value is not None]
        if ok:
            best = max(ok, key=lambda r: r.value)
            chosen, reported = best.experiment, float(best.value)
        per_experiment = [{"name": folder, "state": r.state.value, "metric_value": r.value,
                           "predicted_memory_mib": _mib(r.predicted_memory_bytes),
                           "measured_memory_mib": _mib(r.measured_memory_bytes)} for folder, r in records]
    else:
        problems.append(f"no {csv_path}")
    if code != 0:
        problems.append(f"exit status {code}")
    return {"tuner": name, "command": shlex.join(command), "returncode": code, "wall_s": wall,
            "experiments": launched_count, "failed": failed, "chosen": chosen, "reported_metric": reported,
            "per_experiment": per_experiment, "problems": problems}


def relative_command(command: str) -> str:
    """A results row's command as run from the repository root on any machine: this checkout's
    path and the interpreters' absolute paths are dropped."""
    words = shlex.split(command)
    if words and words[0] == sys.executable:
        words[0] = "python"
    words = [w.replace(str(ROOT) + os.sep, "") for w in words]
    return shlex.join(words)


# ---------------------------------------------------------------- neutral re-measurement

def neutral_settings(args, harness: str) -> ExperimentSettings:
    """One launch per (pick, round) on `harness`'s engine, timed by our in-rank measurement: on our
    engine its own timers, on DeepSpeed's the hook around DeepSpeedEngine (runtime/measure/deepspeed_measure.py).
    Either way samples/s over the same profile steps, boundary to boundary, data loading included."""
    return measurement_settings(SCRIPT, tuple(workload_args(harness, "unused.json", args)[1:]),
                                user_config("autotuner", harness, args, Path("r"), Path("e")),
                                start_profile_step=args.start_step, end_profile_step=args.end_step, engine=harness)


def grid_gas(micro: int, args) -> int:
    return max(1, args.max_train_batch_size // (micro * 2)) if args.max_train_batch_size else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", default=str(ROOT / "output" / "ds_venv"))
    parser.add_argument("--work_dir", default=str(ROOT / "output" / "vs_deepspeed"))
    parser.add_argument("--max_micro", type=int, default=64)
    parser.add_argument("--start_step", type=int, default=3)
    parser.add_argument("--end_step", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--max_train_batch_size", type=int, default=0,
                        help="global batch cap: both tuners then tune gas (default: gas fixed at 1)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--grid_micro", default="", help="comma list: also re-measure the best of stages 0-3 x these")
    parser.add_argument("--tuner_timeout_s", type=float, default=1500)
    parser.add_argument("--tuners", default="deepspeed,ours", help="which tuners to run (both for ratios)")
    parser.add_argument("--our_tuner_types", default="gridsearch,predictive",
                        help="our autotuner's tuner_type(s), each run as its own tuner (ours_<type>)")
    parser.add_argument("--our_engines", default="deepspeed",
                        help="comma list of engines our tuner drives the workload on: deepspeed (the same "
                             "engine as DeepSpeed's autotuner: rows ours_<type>_on_deepspeed), autotuner (ours)")
    parser.add_argument("--harness", choices=("auto", "deepspeed", "autotuner"), default="auto",
                        help="whose engine re-measures every pick; auto: DeepSpeed's when any tuner ran on it")
    args = parser.parse_args()
    our_engines = args.our_engines.split(",")
    harness = args.harness
    if harness == "auto":
        harness = "deepspeed" if "deepspeed" in args.tuners.split(",") or "deepspeed" in our_engines else "autotuner"
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # Our tuner and the harness run DeepSpeed from this Python, with a build cache of their own.
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ROOT / "output" / "torch_extensions_main")
    venv, work = Path(args.venv).resolve(), Path(args.work_dir).resolve()
    if shm_buffers():
        log(f"note: /dev/shm already holds {len(shm_buffers())} DeepSpeed buffers from earlier runs (RAM in use)")
    load = os.getloadavg()
    log(f"load average at start {load[0]:.2f} on {os.cpu_count()} cores (other processes add noise)")

    runs = {}
    if "deepspeed" in args.tuners:
        why = ensure_venv(venv)
        if why:
            log(f"SKIPPED DeepSpeed: setup failed: {why}")
        else:
            prebuild_shm_comm(str(venv / "bin" / "python"), ds_env(venv, ROOT / "output" / "torch_extensions"))
            before = shm_buffers()
            runs["deepspeed"] = run_deepspeed(args, work / "deepspeed", venv)
            runs["deepspeed"]["shm_left_mib"] = sweep_shm(before)
            log(f"DeepSpeed done: {json.dumps({k: str(v) for k, v in runs['deepspeed'].items() if k != 'per_experiment'})}")
    if "ours" in args.tuners and "deepspeed" in our_engines or harness == "deepspeed":
        prebuild_shm_comm(sys.executable, dict(os.environ))
    if "ours" in args.tuners:
        for engine in our_engines:
            for tuner_type in args.our_tuner_types.split(","):
                before = shm_buffers()
                run = run_ours(args, work / our_tuner_name(tuner_type, engine), tuner_type, engine)
                run["shm_left_mib"] = sweep_shm(before)
                runs[run["tuner"]] = run
                log(f"{run['tuner']} done: {json.dumps({k: str(v) for k, v in run.items() if k != 'per_experiment'})}")

    settings = neutral_settings(args, harness)
    log(f"neutral harness: {harness}'s engine")
    grid_best, grid_scores = None, {}
    if args.grid_micro:
        space = [Experiment(stage, int(m), grid_gas(int(m), args)) for stage in (0, 1, 2, 3)
                 for m in args.grid_micro.split(",")]
        log(f"grid: {len(space)} experiments x {args.rounds} rounds")
        before = shm_buffers()
        grid_runs = measure_rounds(space, settings, args.rounds, work / "grid")
        log(f"grid left {sweep_shm(before):.0f} MiB in /dev/shm")
        grid_scores = {e: median_value(r) for e, r in grid_runs.items()}
        feasible = {e: s for e, s in grid_scores.items() if s is not None}
        grid_best = max(feasible, key=feasible.get) if feasible else None
        log("grid medians: " + ", ".join(f"{e.name}={s}" for e, s in grid_scores.items()))

    picks = [r["chosen"] for r in runs.values() if r["chosen"] is not None] + ([grid_best] if grid_best else [])
    unique = list(dict.fromkeys(picks))
    remeasured = {}
    if unique:
        log(f"re-measuring on {harness}'s engine, interleaved: " + " ".join(e.name for e in unique))
        before = shm_buffers()
        again = measure_rounds(unique, settings, args.rounds, work / "remeasure")
        log(f"re-measurement left {sweep_shm(before):.0f} MiB in /dev/shm")
        remeasured = {e: (median_value(r), spread(r), [round(x.value, 1) if x.value else None for x in r])
                      for e, r in again.items()}

    rows = []
    for name, run in runs.items():
        chosen = run["chosen"]
        score, half_range, values = remeasured.get(chosen, (None, None, None))
        rows.append({
            "tuner": name, "exit_status": run["returncode"], "wall_s": round(run["wall_s"], 1),
            "experiments_launched": run["experiments"], "experiments_failed": run["failed"],
            "chosen": chosen.name if chosen else None,
            "stage": chosen.zero_stage if chosen else None, "micro": chosen.micro_batch_size if chosen else None,
            "gas": chosen.gradient_accumulation_steps if chosen else None,
            "own_metric": round(run["reported_metric"], 1) if run["reported_metric"] else None,
            "remeasured_samples_per_s": round(score, 1) if score else None,
            "remeasured_values": values, "remeasure_spread_pct": round(100 * half_range / score, 1) if score else None,
            "shm_left_mib": round(run.get("shm_left_mib", 0.0)),
        })
    if grid_best is not None:
        score, half_range, values = remeasured[grid_best]
        rows.append({"tuner": "grid_best", "wall_s": None, "experiments_launched": len(grid_scores),
                     "chosen": grid_best.name, "stage": grid_best.zero_stage, "micro": grid_best.micro_batch_size,
                     "gas": grid_best.gradient_accumulation_steps, "own_metric": round(grid_scores[grid_best], 1),
                     "remeasured_samples_per_s": round(score, 1) if score else None, "remeasured_values": values,
                     "remeasure_spread_pct": round(100 * half_range / score, 1) if score else None})
    by = {r["tuner"]: r for r in rows}
    ours_names = [name for name in by if name.startswith("ours_")]
    ds = by.get("deepspeed")
    for r in rows:
        # Each of our tuners against DeepSpeed's, on that row; empty on the others.
        r["wall_ours_over_ds"] = r["pick_ours_over_ds"] = None
        if ds is None or r["tuner"] not in ours_names:
            continue
        if ds["wall_s"]:
            r["wall_ours_over_ds"] = round(r["wall_s"] / ds["wall_s"], 3)
        if r["remeasured_samples_per_s"] and ds["remeasured_samples_per_s"]:
            r["pick_ours_over_ds"] = round(r["remeasured_samples_per_s"] / ds["remeasured_samples_per_s"], 3)
    if grid_best is not None:
        best_score = by["grid_best"]["remeasured_samples_per_s"]
        for r in rows:
            r["pick_over_grid_best"] = (round(r["remeasured_samples_per_s"] / best_score, 3)
                                        if r.get("remeasured_samples_per_s") and best_score else None)
    load_end = os.getloadavg()
    for r in rows:
        r["load_avg_start_end"] = f"{load[0]:.1f}/{load_end[0]:.1f}"
        r["problems"] = "; ".join(runs[r["tuner"]]["problems"]) if r["tuner"] in runs else ""
        r["command"] = (relative_command(runs[r["tuner"]]["command"]) if r["tuner"] in runs
                        else "grid: stages 0-3 x " + args.grid_micro)

    workload = f"mlp w{args.width} d{args.depth}, " + (
        f"global batch {args.max_train_batch_size}" if args.max_train_batch_size else "gas 1")
    for r in rows:
        r.update(date=time.strftime("%Y-%m-%d"), workload=workload, harness=harness)
    csv_path = RESULTS / "vs_deepspeed.csv"
    if csv_path.exists() and "harness" not in pd.read_csv(csv_path, nrows=0).columns:
        # Rows from before the DeepSpeed-engine harness were all re-measured on our engine.
        old = pd.read_csv(csv_path)
        old.insert(2, "harness", "autotuner")
        old.to_csv(csv_path, index=False)
    merge_csv(csv_path, rows, ["workload", "harness", "tuner"])
    table = pd.DataFrame(rows)
    (work / "runs.json").write_text(json.dumps(runs, default=str, indent=1))
    print(table.drop(columns=["command", "problems", "remeasured_values"]).to_markdown(index=False))
    for name, run in runs.items():
        for problem in run["problems"]:
            print(f"- {name}: {problem}")
    for name in ours_names if ds is not None else []:
        ours = by[name]
        print(f"\n{name}: wall time over DeepSpeed's {ours['wall_ours_over_ds']}; "
              f"re-measured pick over DeepSpeed's {ours['pick_ours_over_ds']}")
        losses = []
        if ours["pick_ours_over_ds"] and ours["pick_ours_over_ds"] < 1:
            losses.append(f"its pick is {100 * (1 - ours['pick_ours_over_ds']):.1f}% slower than DeepSpeed's "
                          f"when both are re-measured (spread {ours['remeasure_spread_pct']}%, "
                          f"DeepSpeed {ds['remeasure_spread_pct']}%)")
        if ours["wall_ours_over_ds"] and ours["wall_ours_over_ds"] > 1:
            losses.append(f"its tuning took {ours['wall_ours_over_ds']:.2f}x DeepSpeed's wall time")
        if (ours["experiments_launched"] or 0) > (ds["experiments_launched"] or 0):
            losses.append(f"it launched more experiments ({ours['experiments_launched']} vs "
                          f"{ds['experiments_launched']})")
        print("where it loses: " + ("; ".join(losses) if losses else "nowhere in this run"))
        noise = ((ours["remeasure_spread_pct"] or 0) + (ds["remeasure_spread_pct"] or 0)) / 100
        wall_ok = ours["wall_ours_over_ds"] is not None and ours["wall_ours_over_ds"] <= 0.25
        pick_ok = ours["pick_ours_over_ds"] is not None and ours["pick_ours_over_ds"] >= 1 - noise
        print(f"goals: wall <= 0.25x DeepSpeed's: {'met' if wall_ok else 'NOT met'}; pick at least as good "
              f"within noise (>= {1 - noise:.3f}x): {'met' if pick_ok else 'NOT met'}")

if __name__ == "__main__":
    main()
