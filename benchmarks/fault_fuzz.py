"""Fault fuzzing of the launcher's stop paths, at scale (the CI tier is tests/integration/test_fault_fuzz.py).

    python benchmarks/fault_fuzz.py [--count 300] [--seed 1] [--only INDEX ...]
                                    [--scenarios tune,tune_cold,plain,hostfile,run]
                                    [--faults SIGINT,SIGTERM,SIGKILL,ctrl_c_group,ctrl_c_twice,kill_rank]
                                    [--workdir output/fault_fuzz] [--keep] [--no_resume]

Each case runs a real launcher on the toy workload (2 ranks), sends its fault at an instant drawn
uniformly over the scenario's clean run length, then checks the exit bound and status, orphans
(by parentage and by an environment marker, never by name), temporary files and shared memory,
the journal, and that resuming reuses every complete record (tests/fault_fuzz.py says how).
Every case prints its seed and index, so `--seed S --only I` replays it. A CSV of every outcome
goes to WORKDIR/outcomes.csv. Run it alone: it loads both cores.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fault_fuzz import (FAULTS, RAY_FAULTS, SCENARIOS, Tally, clean_length, draw_cases, ray_tune_command,  # noqa: E402
                        run_case, run_ray_case)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", type=int, nargs="*", default=None, help="replay these case indices")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--workdir", default="output/fault_fuzz")
    parser.add_argument("--keep", action="store_true", help="keep every case's directory, not only failed ones")
    parser.add_argument("--no_resume", action="store_true", help="skip check 5 (resume) to go faster")
    parser.add_argument("--ray", type=int, default=0, metavar="N",
                        help="instead: N faults on the Ray backend (a node lost, or SIGINT/SIGTERM to the tuner) on "
                             "a simulated 2-node cluster (ray.cluster_utils.Cluster)")
    args = parser.parse_args()
    if args.ray:
        return ray_campaign(args)
    scenarios, faults = tuple(args.scenarios.split(",")), tuple(args.faults.split(","))
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    print(f"fault fuzz: seed {args.seed}, {args.count} cases, load average {load:.2f} at the start", flush=True)
    lengths = {scenario: clean_length(scenario, workdir) for scenario in scenarios}
    print("clean run lengths: " + ", ".join(f"{s} {t:.1f} s" for s, t in lengths.items()), flush=True)
    cases = draw_cases(args.seed, args.count, lengths, scenarios, faults)
    if args.only is not None:
        cases = [case for case in cases if case.index in set(args.only)]
    tally = Tally()
    started = time.monotonic()
    with open(workdir / "outcomes.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["index", "scenario", "fault", "delay_s", "landed", "exit_status", "seconds_to_exit",
                         "records_complete", "records_reused", "problems"])
        for case in cases:
            case_dir = workdir / f"case_{args.seed}_{case.index}"
            shutil.rmtree(case_dir, ignore_errors=True)
            outcome = run_case(case, case_dir, lengths[case.scenario], resume=not args.no_resume)
            tally.outcomes.append(outcome)
            writer.writerow([case.index, case.scenario, case.fault, case.delay_s, outcome.fault_landed,
                             outcome.exit_status, round(outcome.seconds_to_exit, 2), outcome.records_complete,
                             outcome.records_reused, " | ".join(outcome.problems)])
            handle.flush()
            report(outcome, args.seed, case_dir, args.keep)
    print(tally.summary())
    print(f"wall time {time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at the end")
    return 0 if all(o.ok for o in tally.outcomes) else 1


def report(outcome, seed: int, case_dir: Path, keep: bool) -> None:
    """One line per case; a passing case's directory goes unless --keep."""
    verdict = "ok" if outcome.ok else "PROBLEM: " + " | ".join(outcome.problems)
    print(f"{outcome.case.describe(seed)}: exit {outcome.exit_status} after {outcome.seconds_to_exit:.1f} s"
          f"{'' if outcome.fault_landed else ' (run had ended)'}; {verdict}", flush=True)
    if outcome.ok and not keep:
        shutil.rmtree(case_dir, ignore_errors=True)


def ray_campaign(args: argparse.Namespace) -> int:
    import subprocess

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.cluster_utils import Cluster

    store = 100 * 2**20
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": store,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, object_store_memory=store)
    cluster.wait_for_nodes()
    workdir = Path(args.workdir).resolve()
    try:
        clean = workdir / "ray_clean"
        shutil.rmtree(clean, ignore_errors=True)
        clean.mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        started = time.monotonic()
        subprocess.run(ray_tune_command(clean, cluster.address), cwd=clean, env=env, check=True, capture_output=True,
                       timeout=600)
        length = time.monotonic() - started
        print(f"ray: clean tune {length:.1f} s on a 2-node simulated cluster", flush=True)
        tally = Tally()
        for case in draw_cases(args.seed, args.ray, {"ray": length}, ("ray",), RAY_FAULTS):
            def lose_node():
                cluster.remove_node(next(n for n in cluster.list_all_nodes() if n is not cluster.head_node))

            case_dir = workdir / f"ray_case_{args.seed}_{case.index}"
            shutil.rmtree(case_dir, ignore_errors=True)
            outcome = run_ray_case(case, case_dir, cluster.address, lose_node, length)
            if len(cluster.list_all_nodes()) < 2:
                cluster.add_node(num_cpus=1, object_store_memory=store)
                cluster.wait_for_nodes()
            tally.outcomes.append(outcome)
            report(outcome, args.seed, case_dir, args.keep)
        print(tally.summary())
        return 0 if all(o.ok for o in tally.outcomes) else 1
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
