"""Where the test suite's CPU time goes: every Python process the tests start, with its own CPU
seconds, whether it imported torch, and the test that started it.

    python benchmarks/suite_cpu.py [pytest arguments, default: tests/integration]

A `sitecustomize` put first on PYTHONPATH records, at each process's exit, its own user+system
CPU seconds and PYTEST_CURRENT_TEST (inherited from the test that started it). Processes that
leave without running atexit handlers are not seen: ranks forked from a warm forkserver, the
forkserver itself (killed at the end of a tune), Slurm's and Ray's daemons. Their share is the
suite's whole CPU time (pytest's own plus its reaped children, from `os.times`) less what the
records hold. Per test file: processes, how many imported torch, CPU seconds; per kind of
process (the launcher, a script, `python -c`): count and CPU seconds. Run it alone: its
figures are CPU seconds, but the suite's wall time is printed too.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SITECUSTOMIZE = '''
import atexit, json, os, sys, time
_started = time.time()
def _record():
    try:
        times = os.times()
        record = {"argv": sys.argv[:6], "cpu_s": times.user + times.system, "wall_s": time.time() - _started,
                  "torch": "torch" in sys.modules, "test": os.environ.get("PYTEST_CURRENT_TEST", "")}
        with open(os.path.join(os.environ["SUITE_CPU_RECORDS"], f"{os.getpid()}-{_started}.json"), "w") as out:
            json.dump(record, out)
    except Exception:
        pass
atexit.register(_record)
'''


def kind_of(argv: list[str]) -> str:
    if argv[:2] == ["-m", "autotuner"] or (argv and argv[0].endswith("autotuner/__main__.py")):
        return "launcher (python -m autotuner)"
    if argv and argv[0] == "-c":
        return "python -c"
    return "script " + (Path(argv[0]).name if argv else "?")


def main() -> int:
    pytest_args = sys.argv[1:] or ["tests/integration"]
    with tempfile.TemporaryDirectory(prefix="suite_cpu_") as scratch:
        site, records = Path(scratch, "site"), Path(scratch, "records")
        site.mkdir()
        records.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = {**os.environ, "SUITE_CPU_RECORDS": str(records),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
        before, started = os.times(), time.monotonic()
        status = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                                cwd=ROOT, env=env).returncode
        wall_s, after = time.monotonic() - started, os.times()
        rows = [json.loads(p.read_text()) for p in records.glob("*.json")]
    rows = [r for r in rows if "pytest" not in " ".join(r["argv"])]  # pytest itself: in the total below
    total_s = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    recorded_s = sum(r["cpu_s"] for r in rows)
    print(f"pytest exit {status}; wall {wall_s:.0f} s; CPU {total_s:.0f} s ({total_s / wall_s:.2f} cores busy on "
          f"average); {len(rows)} processes recorded, {sum(r['torch'] for r in rows)} of them with torch, "
          f"{recorded_s:.0f} CPU s; not recorded (forked ranks, forkservers, daemons, pytest): "
          f"{total_s - recorded_s:.0f} CPU s")
    by_file: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0.0])
    by_kind: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        name = r["test"].split("::")[0].rsplit("/", 1)[-1] or "(no test)"
        by_file[name][0] += 1
        by_file[name][1] += r["torch"]
        by_file[name][2] += r["cpu_s"]
        by_kind[kind_of(r["argv"])][0] += 1
        by_kind[kind_of(r["argv"])][1] += r["cpu_s"]
    print("\n| test file | processes | with torch | CPU s |\n|---|---:|---:|---:|")
    for name, (count, torch_count, cpu_s) in sorted(by_file.items(), key=lambda item: -item[1][2]):
        print(f"| {name} | {count} | {torch_count} | {cpu_s:.1f} |")
    print("\n| process | count | CPU s | CPU s each |\n|---|---:|---:|---:|")
    for name, (count, cpu_s) in sorted(by_kind.items(), key=lambda item: -item[1][1])[:15]:
        print(f"| {name} | {count} | {cpu_s:.1f} | {cpu_s / count:.2f} |")
    return status


if __name__ == "__main__":
    sys.exit(main())
