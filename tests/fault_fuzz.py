"""Fault fuzzing of every stop path: a real launcher run, a fault at a random instant, then checks.

Each case starts one of the launcher's modes on the toy workload, waits a random delay drawn from
[0, the mode's clean run length], and then does one of:
- SIGINT, SIGTERM or SIGKILL to the launcher alone;
- Ctrl-C as a terminal sends it: SIGINT to the launcher's whole process group;
- Ctrl-C twice, 0.1-1 s apart;
- SIGKILL to one rank of whatever runs at that instant.

Afterwards it checks:
1. the launcher exited within the bound, with the status the fault calls for;
2. no process of the run is left: every pid seen under the launcher while it ran (by parentage,
   polled with psutil), and every process carrying the run's marker in its environment;
3. no temporary file (the run has a TMPDIR of its own) and no new /dev/shm segment is left, nor a
   half-written record in the results;
4. every experiment record in the journal is complete;
5. the same command, run again with no fault, finishes and reuses every complete record.

Cases are drawn from a seed and printed with it, so any failure replays:
    python benchmarks/fault_fuzz.py --seed S --only INDEX
The test module tests/integration/test_fault_fuzz.py runs a bounded count in CI.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "tests" / "workers" / "toy_train.py"
FAKE_SSH = ROOT / "tests" / "workers" / "fake_ssh.py"
MARKER_ENV = "AUTOTUNER_FAULT_FUZZ_RUN"
STOP_BOUND_S = 15.0  # what a user waits at most after Ctrl-C or SIGTERM
SCENARIOS = ("tune", "tune_cold", "plain", "hostfile", "run")
FAULTS = ("SIGINT", "SIGTERM", "SIGKILL", "ctrl_c_group", "ctrl_c_twice", "kill_rank")
MAPPINGS = {"train_micro_batch_size_per_gpu": "--micro_batch_size",
            "gradient_accumulation_steps": "--gradient_accumulation_steps"}


@dataclass(frozen=True)
class FaultCase:
    index: int
    scenario: str
    fault: str
    delay_s: float

    def describe(self, seed: int) -> str:
        return f"case {self.index} (seed {seed}): {self.scenario}, {self.fault} at {self.delay_s:.2f} s"


@dataclass(frozen=True)
class FaultOutcome:
    case: FaultCase
    exit_status: int | None  # None: still running at the bound (a hang)
    seconds_to_exit: float  # from the fault to the launcher's exit
    fault_landed: bool  # False when the run had already finished before the fault came
    problems: tuple[str, ...] = ()
    records_complete: int = 0
    records_reused: int = 0

    @property
    def hung(self) -> bool:
        return self.exit_status is None

    @property
    def ok(self) -> bool:
        return not self.problems


# ----- the scenarios -----
def _write_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def scenario_command(scenario: str, workdir: Path) -> list[str]:
    """The launcher command line of one scenario, with its inputs written into `workdir`."""
    launcher = [sys.executable, "-m", "autotuner"]
    pids = ["--pid_dir", str(workdir / "pids")]
    tuning = {"enabled": True, "arg_mappings": MAPPINGS, "start_profile_step": 2, "end_profile_step": 4,
              "exp_timeout_s": 60, "tuner_type": "gridsearch"}
    if scenario in ("tune", "tune_cold", "run"):
        micro, stages = ([2, 4], [0, 1]) if scenario == "tune" else ([2, 4], [0])
        if scenario == "tune_cold":
            micro = [2]
        if scenario == "tune_cold":  # cold launches cost seconds each: no re-measurement round
            tuning.update(warm_start=False, remeasure_rounds=0)
        config = _write_json(workdir / "ds.json", {
            "train_micro_batch_size_per_gpu": micro, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stages}, "autotuning": tuning})
        mode = "run" if scenario == "run" else "tune"
        steps = ["--steps", "40", "--ms_per_step", "20"] if scenario == "run" else []
        return [*launcher, "--autotuning", mode, "--nproc_per_node", "2", str(TOY), *pids, *steps,
                "--deepspeed", str(config)]
    config = _write_json(workdir / "ds.json", {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                               "zero_optimization": {"stage": 0}})
    train = [str(TOY), *pids, "--steps", "60", "--ms_per_step", "30", "--deepspeed", str(config)]
    if scenario == "plain":
        return [*launcher, "--nproc_per_node", "2", *train]
    if scenario == "hostfile":
        hostfile = workdir / "hostfile"
        hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
        return [*launcher, "--hostfile", str(hostfile), "--master_port", str(_free_port()), *train]
    raise ValueError(f"unknown scenario {scenario!r}")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environment(workdir: Path, marker: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONWARNINGS", "ignore")
    tmp = workdir / "tmp"
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    env[MARKER_ENV] = marker
    bin_dir = workdir / "bin"  # `ssh` for the hostfile scenario: runs the "remote" command here
    bin_dir.mkdir(exist_ok=True)
    ssh = bin_dir / "ssh"
    ssh.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE_SSH} \"$@\"\n")
    ssh.chmod(0o755)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


# ----- watching a run -----
class TreeWatch:
    """Every process seen under the launcher while it runs, by parentage, polled."""

    def __init__(self, pid: int, period_s: float = 0.05):
        self._pid = pid
        self._period_s = period_s
        self.seen: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                for child in psutil.Process(self._pid).children(recursive=True):
                    self.seen.setdefault(child.pid, child)
            except psutil.Error:
                pass
            self._stop.wait(self._period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _alive(process: psutil.Process) -> bool:
    try:  # is_running compares the create time too, so a reused pid is not mistaken for ours
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(MARKER_ENV) == marker and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            continue
    return found


def leftovers(watch: TreeWatch, marker: str, wait_s: float = 3.0) -> list[str]:
    """Processes of the run still alive `wait_s` after the launcher exited (each may still be
    on its way out: dying with its parent takes the kernel a moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = {p.pid: p for p in watch.seen.values() if _alive(p)}
        alive.update({p.pid: p for p in marked_processes(marker)})
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    described = []
    for process in alive.values():
        try:
            described.append(f"pid {process.pid} ({' '.join(process.cmdline())[:160]})")
        except psutil.Error:
            continue
    return described


def kill_leftovers(watch: TreeWatch, marker: str) -> None:
    for process in [*watch.seen.values(), *marked_processes(marker)]:
        try:
            if process.is_running():
                process.kill()
        except psutil.Error:
            pass


def rank_pids(workdir: Path) -> list[int]:
    """Ranks that are running now: the toy writes its pid when it starts training."""
    pids = []
    for file in (workdir / "pids").glob("*.pid") if (workdir / "pids").exists() else []:
        try:
            if psutil.pid_exists(int(file.stem)):
                pids.append(int(file.stem))
        except ValueError:
            continue
    return pids


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


# ----- the checks on what a run left -----
def journal_records(workdir: Path) -> tuple[list[str], list[str]]:
    """(names of complete experiment records, problems found in the journal)."""
    complete, problems = [], []
    exps = workdir / "autotuning_exps"
    for record in sorted(exps.glob("*/exp.json")) if exps.exists() else []:
        try:
            data = json.loads(record.read_text())
            state = data["result"]["state"]
            name = data["result"]["experiment"] if isinstance(data["result"].get("experiment"), str) else record.parent.name
        except (OSError, ValueError, KeyError, TypeError) as err:
            problems.append(f"journal record {record} is not complete ({type(err).__name__})")
            continue
        if state not in ("ok", "failed", "oom", "timeout"):
            problems.append(f"journal record {record} has state {state!r}")
        complete.append(record.parent.name if name is None else record.parent.name)
    return complete, problems


def _partial_rounds(workdir: Path, complete_before: list[str]) -> list[str]:
    """Records complete before the resume that belong to a re-measurement round some other
    contender of which was not complete then (the resumed run's directory names the round's
    contenders)."""
    import re

    rounds: dict[str, set[str]] = {}
    for record in (workdir / "autotuning_exps").glob("*_remeasure*"):
        match = re.fullmatch(r".+_(remeasure\d+)", record.name)
        if match:
            rounds.setdefault(match.group(1), set()).add(record.name)
    partial = []
    for names in rounds.values():
        if not names <= set(complete_before):
            partial += [name for name in names if name in complete_before]
    return partial


def profile_failures(workdir: Path, tuner_output: str) -> list[str]:
    """Records of profile launches (named in the tuner's "profile: ZeRO S, micro-batch M" lines)
    that did not profile the model."""
    import re

    profiled = set(re.findall(r"profile: ZeRO (\d+), micro-batch (\d+)", tuner_output))
    failed = []
    for record in sorted((workdir / "autotuning_exps").glob("*/exp.json")):
        try:
            result = json.loads(record.read_text())["result"]
        except (OSError, ValueError, KeyError):
            continue
        match = re.fullmatch(r"z(\d+)_gas\d+_mbs(\d+)", record.parent.name)
        if match and match.groups() in profiled and result.get("model_info") is None:
            failed.append(record.parent.name)
    return failed


def half_written(workdir: Path) -> list[str]:
    found = []
    for directory in (workdir / "autotuning_exps", workdir / "autotuning_results"):
        if directory.exists():
            found += [str(p) for p in directory.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".tmp")]
    return found


def temporary_files(workdir: Path) -> list[str]:
    """What the run left in its TMPDIR, torch's compile caches aside (kept across runs on purpose)."""
    tmp = workdir / "tmp"
    return sorted(str(p) for p in tmp.iterdir() if not p.name.startswith("torchinductor_")) if tmp.exists() else []


def _leftover_files(workdir: Path) -> list[str]:
    problems = []
    if temporary_files(workdir):
        problems.append(f"temporary files left: {temporary_files(workdir)}")
    if half_written(workdir):
        problems.append(f"half-written files: {half_written(workdir)}")
    return problems


# ----- one case -----
def expected_statuses(case: FaultCase, landed: bool) -> set[int]:
    """What the launcher's exit status may be. A fault that came after the run ended leaves it 0."""
    if not landed:
        return {0}
    if case.fault in ("SIGINT", "ctrl_c_group", "ctrl_c_twice"):
        return {130, -signal.SIGINT}  # -2 only before Python's own handler is replaced (start-up)
    if case.fault == "SIGTERM":
        return {143, -signal.SIGTERM}
    if case.fault == "SIGKILL":
        return {-signal.SIGKILL}
    # A rank killed: a tune records the experiment as failed and goes on; a training run fails
    # with the rank's status, unless the rank had finished its work when it died.
    # A rank killed in the profile launch is the model failing to run at all: the tuner stops, status 1.
    if case.scenario in ("tune", "tune_cold"):
        return {0, 1}
    return {0, 1, 128 + signal.SIGKILL}


def run_case(case: FaultCase, workdir: Path, clean_length_s: float, resume: bool = True) -> FaultOutcome:
    """Run `case` in `workdir` (created), check what it left, clean up whatever it leaked."""
    workdir.mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    env = _environment(workdir, marker)
    command = scenario_command(case.scenario, workdir)
    shm_before = shm_entries()
    log_out, log_err = open(workdir / "launcher.out", "w"), open(workdir / "launcher.err", "w")
    launcher = subprocess.Popen(command, cwd=workdir, env=env, stdout=log_out, stderr=log_err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    watch = TreeWatch(launcher.pid)
    problems: list[str] = []
    landed = True
    time.sleep(case.delay_s)
    fault_at = time.monotonic()
    if launcher.poll() is not None:
        landed = False
    elif case.fault == "kill_rank":
        ranks = rank_pids(workdir)
        if ranks:
            try:
                os.kill(random.Random(case.index).choice(ranks), signal.SIGKILL)
            except ProcessLookupError:
                landed = False
        else:
            landed = False
    else:
        sig = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}.get(case.fault,
                                                                                                   signal.SIGINT)
        try:
            if case.fault in ("ctrl_c_group", "ctrl_c_twice"):
                os.killpg(launcher.pid, signal.SIGINT)
                if case.fault == "ctrl_c_twice":
                    time.sleep(random.Random(case.index).uniform(0.1, 1.0))
                    os.killpg(launcher.pid, signal.SIGINT)
            else:
                launcher.send_signal(sig)
        except ProcessLookupError:
            landed = False
    bound = STOP_BOUND_S if case.fault != "kill_rank" else clean_length_s + 60.0
    try:
        status = launcher.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        status = None
        problems.append(f"hang: the launcher had not exited {bound:.0f} s after the fault")
    seconds = time.monotonic() - fault_at
    watch.stop()
    log_out.close()
    log_err.close()
    if status is None:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    allowed = expected_statuses(case, landed)
    if case.scenario in ("plain", "hostfile") and "done: " in (workdir / "launcher.out").read_text():
        allowed = allowed | {0}  # the fault came as the launcher was leaving: the ranks had finished
    err_text = (workdir / "launcher.err").read_text()
    if status == 1 and case.scenario in ("tune", "tune_cold") and "did not run in the profile launch" not in err_text:
        allowed = allowed - {1}
    if status is not None and status not in allowed:
        err = (workdir / "launcher.err").read_text()[-600:]
        problems.append(f"exit status {status}, expected one of {sorted(allowed)}; stderr tail: {err!r}")
    left = leftovers(watch, marker)
    if left:
        problems.append(f"orphans: {left}")
    kill_leftovers(watch, marker)
    new_shm = shm_entries() - shm_before
    if new_shm:
        problems.append(f"shared memory left: {sorted(new_shm)}")
    complete, journal_problems = journal_records(workdir)
    problems += journal_problems
    # Killed outright (SIGKILL, or a second Ctrl-C), a launcher can remove nothing: its temporary
    # directories and unfinished writes must be gone once the next launcher has started.
    outright = case.fault in ("SIGKILL", "ctrl_c_twice")
    if not outright:
        problems += _leftover_files(workdir)
    reused = 0
    # With no complete record there is nothing to reuse, and the run itself is a clean run...
    # After an outright kill the same command is the next start that must clean up, records or not.
    if resume and case.scenario in ("tune", "tune_cold", "run") and (complete or outright) and not journal_problems:
        # A failed profile launch is launched again by design (its model profile is what tuning needs).
        retried = len(profile_failures(workdir, (workdir / "launcher.out").read_text()))
        again = subprocess.run(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, timeout=300, start_new_session=True)
        reused = again.stdout.count("(from an earlier run)")
        # A re-measurement round reuses its records only when every contender has one (final_pick.py:
        # a fresh launch beside another run's records would not be interleaved with them), so a kill
        # between two re-measurements of a round leaves that round's finished ones to be launched again.
        partial = _partial_rounds(workdir, complete)
        if again.returncode != 0:
            problems.append(f"resume exited {again.returncode}: {again.stderr[-600:]!r}")
        elif reused < len(complete) - retried - len(partial):
            problems.append(f"resume reused {reused} of {len(complete)} complete records ({retried} failed "
                            "profile launches retried)")
        if marked_processes(marker):
            problems.append("resume left processes behind")
            for process in marked_processes(marker):
                process.kill()
    elif outright:
        subprocess.run([sys.executable, "-m", "autotuner", "--help"], cwd=workdir, env=env, capture_output=True,
                       timeout=120)
    if outright:
        problems += _leftover_files(workdir)
    return FaultOutcome(case, status, seconds, landed, tuple(problems), len(complete), reused)


# ----- a campaign -----
def draw_cases(seed: int, count: int, lengths: dict[str, float], scenarios=SCENARIOS, faults=FAULTS) -> list[FaultCase]:
    """`count` cases, instants uniform over each scenario's clean run length (a little past it, so a
    fault during exit comes up too). Case i takes scenario i mod 5 and fault i mod 6 of the two lists
    shuffled: with 5 and 6 coprime, any 6 cases in a row cover every scenario and every fault, and
    any 30 every pair."""
    rng = random.Random(seed)
    scenarios, faults = list(scenarios), list(faults)
    rng.shuffle(scenarios)
    rng.shuffle(faults)
    cases = []
    for index in range(count):
        scenario, fault = scenarios[index % len(scenarios)], faults[index % len(faults)]
        cases.append(FaultCase(index, scenario, fault, round(rng.uniform(0.0, lengths[scenario] * 1.05), 3)))
    return cases


def clean_length(scenario: str, workdir: Path) -> float:
    """How long the scenario runs with no fault (it must also finish cleanly, with no orphans)."""
    outcome_dir = workdir / f"clean_{scenario}"
    outcome_dir.mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    env = _environment(outcome_dir, marker)
    started = time.monotonic()
    result = subprocess.run(scenario_command(scenario, outcome_dir), cwd=outcome_dir, env=env, capture_output=True,
                            text=True, timeout=300, stdin=subprocess.DEVNULL, start_new_session=True)
    length = time.monotonic() - started
    if result.returncode != 0:
        raise RuntimeError(f"scenario {scenario} fails with no fault ({result.returncode}): {result.stderr[-2000:]}")
    if marked_processes(marker):
        raise RuntimeError(f"scenario {scenario} leaves processes with no fault")
    shutil.rmtree(outcome_dir, ignore_errors=True)
    return length


@dataclass
class Tally:
    outcomes: list[FaultOutcome] = field(default_factory=list)

    def summary(self) -> str:
        total = len(self.outcomes)
        hangs = sum(o.hung for o in self.outcomes)
        orphans = sum(any(p.startswith("orphans") for p in o.problems) for o in self.outcomes)
        lost = sum(any(p.startswith(("journal", "resume")) for p in o.problems) for o in self.outcomes)
        failed = sum(not o.ok for o in self.outcomes)
        missed = sum(not o.fault_landed for o in self.outcomes)
        slowest = max((o.seconds_to_exit for o in self.outcomes if o.fault_landed and o.case.fault != "kill_rank"),
                      default=0.0)
        return (f"{total} faults ({total - missed} landed while running): {hangs} hangs, {orphans} with orphans, "
                f"{lost} with lost or corrupt records, {failed} with any problem; slowest exit after a signal "
                f"{slowest:.1f} s")


# ----- the Ray backend: a node lost, or the tuner stopped, at a random instant -----
RAY_FAULTS = ("lose_node", "SIGINT", "SIGTERM")


def ray_tune_command(workdir: Path, address: str) -> list[str]:
    config = _write_json(workdir / "ds.json", {
        "train_micro_batch_size_per_gpu": [2, 4, 8], "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0},
        "autotuning": {"enabled": True, "arg_mappings": MAPPINGS, "start_profile_step": 2, "end_profile_step": 4,
                       "exp_timeout_s": 120, "model_info": {"num_params": 1000}, "tuner_type": "gridsearch",
                       "remeasure_rounds": 0}})
    return [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--backend", "ray", "--ray_address", address,
            "--nproc_per_node", "1", str(TOY), "--ms_per_sample", "20", "--steps", "12", "--pid_dir",
            str(workdir / "pids"), "--deepspeed", str(config)]


def run_ray_case(case: FaultCase, workdir: Path, address: str, lose_node, length_s: float) -> FaultOutcome:
    """`case.fault` is "lose_node" (`lose_node()` removes a worker node of the simulated cluster), or
    SIGINT/SIGTERM to the tuner. The cluster's own processes are not the run's: orphans are the
    ranks (their pid files) and whatever carries the run's marker."""
    workdir.mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    env = _environment(workdir, marker)
    command = ray_tune_command(workdir, address)
    tuner = subprocess.Popen(command, cwd=workdir, env=env, stdout=open(workdir / "launcher.out", "w"),
                             stderr=open(workdir / "launcher.err", "w"), stdin=subprocess.DEVNULL,
                             start_new_session=True)
    problems: list[str] = []
    time.sleep(case.delay_s)
    fault_at = time.monotonic()
    landed = tuner.poll() is None
    if landed:
        if case.fault == "lose_node":
            lose_node()
        else:
            tuner.send_signal(signal.SIGINT if case.fault == "SIGINT" else signal.SIGTERM)
    bound = length_s + 120.0 if case.fault == "lose_node" else STOP_BOUND_S
    try:
        status = tuner.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        status = None
        problems.append(f"hang: the tuner had not exited {bound:.0f} s after the fault")
        tuner.kill()
        tuner.wait()
    seconds = time.monotonic() - fault_at
    allowed = {0} if case.fault == "lose_node" else expected_statuses(case, landed)
    if status is not None and status not in allowed:
        problems.append(f"exit status {status}, expected one of {sorted(allowed)}; stderr tail: "
                        f"{(workdir / 'launcher.err').read_text()[-600:]!r}")
    deadline = time.monotonic() + 30  # a rank on a lost node ends when the node's raylet has gone
    while rank_pids(workdir) and time.monotonic() < deadline:
        time.sleep(0.5)
    if rank_pids(workdir) or marked_processes(marker):
        problems.append(f"orphans: ranks {rank_pids(workdir)}, marked {[p.pid for p in marked_processes(marker)]}")
        for pid in rank_pids(workdir):
            os.kill(pid, signal.SIGKILL)
    complete, journal_problems = journal_records(workdir)
    problems += journal_problems + _leftover_files(workdir)
    reused = 0
    if complete and not journal_problems:
        again = subprocess.run(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, timeout=600, start_new_session=True)
        reused = again.stdout.count("(from an earlier run)")
        if again.returncode != 0:
            problems.append(f"resume exited {again.returncode}: {again.stderr[-600:]!r}")
        elif reused < len(complete):
            problems.append(f"resume reused {reused} of {len(complete)} complete records")
    return FaultOutcome(case, status, seconds, landed, tuple(problems), len(complete), reused)
