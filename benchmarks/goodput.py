"""Goodput against throughput (issues 50 and 70): which tuned global batch reaches a held-out loss
sooner, and whether growing it through training (autotuning.adapt_batch) does better.

    python benchmarks/goodput.py [--label_noise 0.1,0.6] [--seeds 3] [--work_dir DIR] [--no_adaptive]
    python benchmarks/goodput.py --workload gpt2 --target_loss 5.5 [--seeds 3]

--workload gpt2 trains the GPT-2 example (examples/hf_gpt2, tiny) instead, on its own loader (the
engine's, so the ramp may grow the micro-batch), to --target_loss on its held-out blocks; there is no
direct B_noise.

For each label-noise level of benchmarks/workloads/label_noise.py (2 CPU ranks, ZeRO 0):
1. B_noise measured directly: per-sample gradients (torch.func) of the initial model, and of the
   model after a few steps at reference_batch_size, over --direct_samples fresh samples;
   tr(Sigma) and |G|^2 unbiased, B_noise their ratio;
2. `launcher --autotuning tune` twice, as a user runs it: metric "throughput", then metric
   "goodput" (reference_batch_size, lr_scaling, and adapt_batch so that it writes its ramp plan);
   the second prints the tuner's B_noise;
3. each arm trained to --target_loss, --seeds seeds, the arms interleaved (the order rotated
   each seed); the training time to the target (held-out evaluations excluded):
   - throughput: the throughput pick, its learning rate scaled from reference_batch_size by the
     same rule (as a user who chose the lr for reference_batch_size would);
   - goodput: the goodput pick, fixed, at the lr its optimal config gives;
   - adaptive: the goodput pick with the optimal config's batch ramp on (the tune's plan, every
     --adapt_interval steps; its CSV per run), the lr rescaled as the batch grows.
Results: benchmarks/results/goodput.csv and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "benchmarks" / "workloads" / "label_noise.py"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(WORKLOAD.parent))
from label_noise import Task, make_model  # noqa: E402

from autotuner.core.noise_scale import scaled_learning_rate  # noqa: E402

GPT2 = ROOT / "examples" / "hf_gpt2" / "train.py"
MAPPINGS = {"label_noise": {"train_micro_batch_size_per_gpu": "--micro_batch_size",
                            "gradient_accumulation_steps": "--gradient_accumulation_steps"},
            "gpt2": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                     "gradient_accumulation_steps": "--gradient_accumulation_steps"}}


def target_loss(label_noise: float, classes: int, over_floor: float) -> float:
    """The best loss here (the teacher's label kept with 1 - noise, else uniform over the classes),
    plus `over_floor`."""
    keep = 1 - label_noise + label_noise / classes
    floor = -(keep * math.log(keep) + (1 - keep) * math.log((1 - keep) / (classes - 1)))
    return round(floor + over_floor, 3)


def direct_noise_scale(task: Task, args: argparse.Namespace, steps: int) -> float:
    """B_noise of the model after `steps` AdamW steps at reference_batch_size (one process), from
    per-sample gradients over args.direct_samples fresh samples."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(args.seed_for_direct)
    model = make_model(args.features, args.classes, args.hidden)
    generator = torch.Generator().manual_seed(12345)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for _ in range(steps):
        x, y = task.draw(args.reference_batch, generator)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss_of_one(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    per_sample = vmap(grad(loss_of_one), in_dims=(None, 0, 0))
    total, total_sq, n = None, 0.0, 0
    for _ in range(args.direct_samples // 512):
        x, y = task.draw(512, generator)
        g = per_sample(params, x, y)
        flat = torch.cat([t.reshape(512, -1) for t in g.values()], dim=1).double()
        total = flat.sum(0) if total is None else total + flat.sum(0)
        total_sq += float((flat * flat).sum())
        n += 512
    mean = total / n
    trace = (total_sq / n - float(mean @ mean)) * n / (n - 1)  # sum of per-coordinate variances
    gradient_sq = float(mean @ mean) - trace / n  # |mean|^2 is |G|^2 + tr(Sigma)/n
    return trace / gradient_sq


def config(args: argparse.Namespace, metric: str, lr: float, micro: int | None = None,
           gas: int | None = None, plan: Path | None = None) -> dict:
    # No max_train_batch_size: with it, each candidate's gas fills the cap, and every candidate
    # has the same global batch. Without it gas is 1 and the global batch is micro x ranks.
    autotuning = {"enabled": True, "arg_mappings": MAPPINGS[args.workload], "metric": metric, "start_profile_step": 3,
                  "end_profile_step": 10, "max_train_micro_batch_size_per_gpu": args.max_micro,
                  "exp_timeout_s": 300}
    if metric == "goodput":
        autotuning.update(reference_batch_size=args.reference_batch, lr_scaling=args.lr_scaling)
        if args.critical_batch:
            autotuning.update(critical_batch_size=args.critical_batch)
        if args.adaptive and (plan is not None or micro is None):  # the tune writes the plan; the arm reads it
            autotuning.update(adapt_batch=True, adapt_interval=args.adapt_interval)
        if plan is not None:
            autotuning.update(adapt_plan=str(plan))
    return {"train_micro_batch_size_per_gpu": micro or "auto", "gradient_accumulation_steps": gas or "auto",
            "steps_per_print": 100000, "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "zero_optimization": {"stage": 0}, "autotuning": autotuning}


def workload_args(args: argparse.Namespace, label_noise: float) -> list[str]:
    if args.workload == "gpt2":
        return ["--model_size", "tiny", "--output_dir", str(Path(args.work_dir) / "gpt2_out")]  # one corpus cache
    return ["--features", str(args.features), "--classes", str(args.classes), "--hidden", str(args.hidden),
            "--label_noise", str(label_noise)]


def script(args: argparse.Namespace) -> Path:
    return GPT2 if args.workload == "gpt2" else WORKLOAD


def step_args(args: argparse.Namespace, steps: int) -> list[str]:
    return ["--max_steps" if args.workload == "gpt2" else "--steps", str(steps)]


def environment() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def tune(work: Path, args: argparse.Namespace, label_noise: float, metric: str) -> dict:
    """One tune as a user runs it; its pick (micro, gas, global batch, lr) and the B_noise line."""
    work.mkdir(parents=True, exist_ok=True)
    ds = work / "ds.json"
    ds.write_text(json.dumps(config(args, metric, args.lr)))
    command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", str(args.nproc),
               str(script(args)), *workload_args(args, label_noise), *step_args(args, 40), "--deepspeed", str(ds)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=work, env=environment(), capture_output=True, text=True)
    took = time.perf_counter() - started
    (work / "tune.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"tune ({metric}) failed, see {work / 'tune.log'}")
    optimal = json.loads((work / "autotuning_results" / "ds_config_optimal.json").read_text())
    micro, gas = optimal["train_micro_batch_size_per_gpu"], optimal["gradient_accumulation_steps"]
    batch = micro * gas * args.nproc
    lr = optimal["optimizer"]["params"]["lr"] if metric == "goodput" else \
        scaled_learning_rate(args.lr, batch, args.reference_batch, args.lr_scaling)
    found = re.search(r"B_noise(?: =)? ([\d.]+) \+/- ([\d.]+)", done.stdout)
    import pandas as pd
    table = pd.read_csv(work / "autotuning_results" / "experiments.csv")
    plan = work / "autotuning_results" / "batch_ramp.json"
    return {"metric": metric, "arm": metric, "micro": micro, "gas": gas, "global_batch": batch, "lr": lr, "tune_s": took,
            "plan": plan if plan.exists() else None,
            "launches": int(len(table)),
            "b_noise": float(found.group(1)) if found else None, "b_noise_spread": float(found.group(2)) if found else None}


def run_plan(work: Path, pick: dict, seed: int) -> Path | None:
    """The adaptive arm's copy of the tune's plan, its CSV in this run's own file."""
    if pick["arm"] != "adaptive":
        return None
    plan = json.loads(Path(pick["plan"]).read_text())
    plan["csv_path"] = str((work / f"batch_ramp_seed{seed}.csv").resolve())
    Path(plan["csv_path"]).unlink(missing_ok=True)
    path = work / f"batch_ramp_seed{seed}.json"
    path.write_text(json.dumps(plan))
    return path


def train_to_target(work: Path, args: argparse.Namespace, label_noise: float, pick: dict, seed: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    ds = work / f"ds_{pick['arm']}.json"
    plan = run_plan(work, pick, seed)
    ds.write_text(json.dumps(config(args, pick["metric"], pick["lr"], pick["micro"], pick["gas"], plan)))
    out = work / f"{pick['arm']}_seed{seed}.json"
    mappings = MAPPINGS[args.workload]
    command = [sys.executable, "-m", "autotuner", "--nproc_per_node", str(args.nproc), str(script(args)),
               *workload_args(args, label_noise), mappings["train_micro_batch_size_per_gpu"], str(pick["micro"]),
               "--gradient_accumulation_steps", str(pick["gas"]), *step_args(args, args.max_steps),
               "--target_loss", str(args.target_loss), "--eval_every", str(args.eval_every), "--seed", str(seed),
               "--result_out", str(out), "--deepspeed", str(ds)]
    done = subprocess.run(command, cwd=work, env=environment(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training {pick['arm']} seed {seed} failed:\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if plan is not None:
        rows = (work / f"batch_ramp_seed{seed}.csv").read_text().splitlines()[1:]
        result["ramp"] = [row.split(",")[:3] for row in rows]  # step, B_noise, global batch
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("label_noise", "gpt2"), default="label_noise")
    parser.add_argument("--label_noise", default="0.1")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3, help="the lr chosen for --reference_batch")
    parser.add_argument("--reference_batch", type=int, default=32)
    parser.add_argument("--lr_scaling", default="sqrt", choices=("linear", "sqrt", "none"))
    parser.add_argument("--critical_batch", type=int, default=None,
                        help="the goodput tune's autotuning.critical_batch_size (default: the profile's B_noise)")
    parser.add_argument("--max_micro", type=int, default=1024)
    parser.add_argument("--target_loss", type=float, default=None,
                        help="held-out loss to reach (default: per noise level, --target_over_floor above its floor)")
    parser.add_argument("--target_over_floor", type=float, default=0.25)
    parser.add_argument("--max_steps", type=int, default=100000)
    parser.add_argument("--eval_every", type=int, default=None,
                        help="samples between held-out evaluations (label_noise, default 4096), or optimizer steps "
                             "(gpt2, default 10)")
    parser.add_argument("--direct_samples", type=int, default=4096)
    parser.add_argument("--direct_steps", type=int, default=3)
    parser.add_argument("--seed_for_direct", type=int, default=1)
    parser.add_argument("--work_dir", default="/tmp/goodput_bench")
    parser.add_argument("--csv", default=str(RESULTS / "goodput.csv"))
    parser.add_argument("--no_adaptive", dest="adaptive", action="store_false",
                        help="leave out the adaptive arm (the goodput pick with its batch ramp)")
    parser.add_argument("--adapt_interval", type=int, default=50, help="the adaptive arm's autotuning.adapt_interval")
    parser.add_argument("--only", choices=("direct", "all"), default="all")
    args = parser.parse_args()
    if args.eval_every is None:
        args.eval_every = 10 if args.workload == "gpt2" else 4096
    rows = []
    for label_noise in [float(v) for v in args.label_noise.split(",")]:
        direct0 = direct = float("nan")
        if args.workload == "label_noise":
            task = Task(args.features, args.classes, label_noise, 0)
            direct0 = direct_noise_scale(task, args, 0)
            direct = direct_noise_scale(task, args, args.direct_steps)
            print(f"label noise {label_noise}: direct B_noise {direct0:.1f} at initialisation, {direct:.1f} after "
                  f"{args.direct_steps} steps", flush=True)
        elif args.target_loss is None:
            raise SystemExit("--workload gpt2: give --target_loss (the held-out loss to reach)")
        if args.only == "direct":
            continue
        target = args.target_loss
        if target is None:
            target = target_loss(label_noise, args.classes, args.target_over_floor)
        args.target_loss = target
        work = Path(args.work_dir) / f"noise{label_noise}"
        picks = [tune(work / metric, args, label_noise, metric) for metric in ("throughput", "goodput")]
        if args.adaptive:
            if picks[1]["plan"] is None:
                raise SystemExit(f"the goodput tune wrote no batch ramp plan, see {work / 'goodput' / 'tune.log'}")
            picks.append({**picks[1], "arm": "adaptive"})
        for pick in picks[:2]:
            print(f"  {pick['metric']} tune: micro {pick['micro']} gas {pick['gas']} global batch "
                  f"{pick['global_batch']} lr {pick['lr']:.4g} ({pick['launches']} launches, {pick['tune_s']:.0f} s)"
                  + (f"; tuner's B_noise {pick['b_noise']} +/- {pick['b_noise_spread']}" if pick["b_noise"] else ""),
                  flush=True)
        times: dict[str, list[dict]] = {p["arm"]: [] for p in picks}
        for seed in range(1, args.seeds + 1):
            shift = (seed - 1) % len(picks)
            for pick in picks[shift:] + picks[:shift]:  # interleaved, the order rotated each seed
                run = train_to_target(work / "train", args, label_noise, pick, seed)
                times[pick["arm"]].append(run)
                reached = run["reached"]
                batch = (f", global batch {run['first_global_batch']} -> {run['global_batch']}"
                         if run.get("first_global_batch", run["global_batch"]) != run["global_batch"] else "")
                print(f"  seed {seed} {pick['arm']}: " + (f"{reached['training_s']:.2f} s, {reached['samples']} "
                      f"samples, {reached['steps']} steps" if reached else "target not reached") + batch, flush=True)
        b_noise = picks[1]["b_noise"]
        for pick in picks:
            runs = times[pick["arm"]]
            seconds = [r["reached"]["training_s"] for r in runs if r["reached"]]
            samples = [r["reached"]["samples"] for r in runs if r["reached"]]
            rows.append({"label_noise": label_noise, "target_loss": target, "direct_b_noise_init": round(direct0, 2),
                         "direct_b_noise": round(direct, 2), "tuner_b_noise": b_noise,
                         "tuner_b_noise_spread": picks[1]["b_noise_spread"], "metric": pick["metric"], "arm": pick["arm"],
                         "micro": pick["micro"], "gas": pick["gas"], "global_batch": pick["global_batch"],
                         "lr": round(pick["lr"], 6), "tune_s": round(pick["tune_s"], 1), "launches": pick["launches"],
                         "reached": f"{len(seconds)}/{len(runs)}",
                         "median_s": round(statistics.median(seconds), 2) if seconds else None,
                         "min_s": round(min(seconds), 2) if seconds else None,
                         "max_s": round(max(seconds), 2) if seconds else None,
                         "median_samples": statistics.median(samples) if samples else None,
                         "seconds": " ".join(f"{s:.2f}" for s in seconds),
                         "final_batches": " ".join(str(r["global_batch"]) for r in runs),
                         "ramp": " | ".join(";".join(f"{row[0]}:{row[2]}" for row in r.get("ramp", [])[1:]) or "-"
                                            for r in runs) if pick["arm"] == "adaptive" else ""})
    if rows:
        import pandas as pd
        table = pd.DataFrame(rows)
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.csv, index=False)
        print(table.to_markdown(index=False))


if __name__ == "__main__":
    main()
