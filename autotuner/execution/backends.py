"""Where a tune's experiments run: the backend registry behind `--backend`.

A backend is a `BackendSpec` in `BACKENDS`: its name, its own flags, its checks, whether the
cluster places each experiment's nodes, and a factory that opens its runner (a Runner:
tuning/trials/runner.py) for the run. The command line's choices and flag groups, the refusal of
another backend's flag, the settle pass and the tune read the registry; a plugin adds one with
`register_backend` (core/plugins.py), with no edit to this package.
"""

from __future__ import annotations

import argparse
import os
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from autotuner.core.errors import UsageError
from autotuner.execution.placement import EXCLUSIVE, PLACEMENT_POLICIES

if TYPE_CHECKING:  # the command line reads this registry before it imports torch: types only here
    from autotuner.config.autotuning import AutotuningConfig
    from autotuner.execution.forkserver import Forkserver
    from autotuner.tuning.trials.runner import Runner
    from autotuner.tuning.trials.trial import ExperimentSettings


@dataclass(frozen=True)
class Flag:
    """One command-line flag of a backend: argparse's keywords, default included."""

    name: str  # "--ray_address"
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        return self.options.get("default")


@dataclass(frozen=True)
class BackendOptions:
    """The command line as a backend reads it (built from the parsed arguments in app/): which
    backend, each registered backend flag's value by its dest, whether --hostfile, --include or
    --exclude chose the hosts, and the --autotuning mode (None: a plain launch)."""

    backend: str = "local"
    values: tuple[tuple[str, Any], ...] = ()
    picks_hosts: bool = False
    autotuning: str | None = None

    def value(self, dest: str) -> Any:
        """A backend flag's value (its default where not given)."""
        found = dict(self.values)
        if dest not in found:
            raise KeyError(f"no backend flag with dest {dest!r} is registered")
        return found[dest]

    @classmethod
    def of(cls, given: Mapping[str, Any], backend: str = "local", picks_hosts: bool = False,
           autotuning: str | None = None) -> "BackendOptions":
        """From the values given by dest: each registered backend flag's, its default where absent."""
        values = tuple((flag.dest, given.get(flag.dest, flag.default))
                       for spec in BACKENDS.values() for flag in spec.flags)
        return cls(backend, values, picks_hosts, autotuning)


@dataclass(frozen=True)
class RunnerRequest:
    """What a backend's factory gets: the command line's backend options (its own flags
    included), the autotuning section, the settled experiment settings, the node count asked for,
    where progress lines go, and the warm path's forkserver if one was started early."""

    options: BackendOptions
    tuning: AutotuningConfig
    settings: ExperimentSettings
    num_nodes: int
    say: Callable[[str], None]
    forkserver: Forkserver | None = None


@dataclass(frozen=True)
class BackendSpec:
    name: str  # --backend NAME
    summary: str  # --backend's help and the docs
    open_runner: Callable[[RunnerRequest], AbstractContextManager[Runner]]
    flags: tuple[Flag, ...] = ()
    check: Callable[[BackendOptions], None] | None = None  # refuses (UsageError) what it cannot run
    # The cluster places each experiment's ranks on nodes (--num_nodes: nodes per experiment); else
    # the experiments run on this node, and --num_nodes above 1 is refused.
    places_nodes: bool = False
    uses_forkserver: bool = False  # warm launches from this process's forkserver (started early)
    # Files of its own beside the optimal config, written after a tune (Slurm's sbatch script):
    # gets the request and the results folder, returns the lines to print.
    write_outputs: Callable[["RunnerRequest", Path], list[str]] | None = None
    # It also starts plain launches (no --autotuning), on this node or a hostfile's (DeepSpeed's
    # default hostfile is read when none is given); else it runs only the experiments of a tune.
    launches_plainly: bool = False


BACKENDS: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> BackendSpec:
    """Add a backend; a name or flag already taken is refused, so a plugin cannot replace one unseen."""
    if spec.name in BACKENDS and BACKENDS[spec.name] is not spec:
        raise ValueError(f"backend {spec.name!r} is registered already")
    taken = {flag.name: other.name for other in BACKENDS.values() if other is not spec for flag in other.flags}
    for flag in spec.flags:
        if flag.name in taken:
            raise ValueError(f"backend {spec.name!r}: flag {flag.name} belongs to backend {taken[flag.name]!r}")
    BACKENDS[spec.name] = spec
    return spec


def backend_spec(name: str) -> BackendSpec:
    return BACKENDS[name]


def add_backend_flags(parser: argparse.ArgumentParser, default: str = "local") -> None:
    """--backend with the registered names, and each backend's flags in a group of its own."""
    choices = ", ".join(f"{spec.name}: {spec.summary}" for spec in BACKENDS.values())
    parser.add_argument("--backend", choices=tuple(BACKENDS), default=default,
                        help=f"where the experiments of --autotuning tune|run run; {choices}")
    for spec in BACKENDS.values():
        if spec.flags:
            group = parser.add_argument_group(f"--backend {spec.name}")
            for flag in spec.flags:
                group.add_argument(flag.name, **dict(flag.options))


def check_backend(options: BackendOptions) -> None:
    """Another backend's flag is refused by name; a backend that does not launch plainly needs
    --autotuning tune|run; then the chosen backend's own checks."""
    chosen = BACKENDS[options.backend]
    for spec in BACKENDS.values():
        if spec is chosen:
            continue
        for flag in spec.flags:
            if options.value(flag.dest) != flag.default:
                raise UsageError(f"{flag.name}: only with --backend {spec.name}")
    if not chosen.launches_plainly and options.autotuning not in ("tune", "run"):
        raise UsageError(f"--backend {chosen.name}: runs the experiments of --autotuning tune|run; add "
                         "--autotuning tune, or drop --backend to launch here")
    if chosen.check is not None:
        chosen.check(options)


# ----- the built-in backends -----

@contextmanager
def _local_runner(request: RunnerRequest) -> Iterator[Runner]:
    from autotuner.execution.warm import make_runner

    with make_runner(request.tuning, request.settings, request.say, request.forkserver) as runner:
        yield runner


@contextmanager
def _ray_runner(request: RunnerRequest) -> Iterator[Runner]:
    from autotuner.execution.ray_runner import RayOptions, RayRunner  # ray is imported only here

    given = request.options.value
    options = RayOptions(address=given("ray_address"), placement=given("ray_placement"),
                         max_concurrent=given("ray_max_concurrent"), cpus_per_rank=given("ray_cpus_per_rank"),
                         gpus_per_rank=given("ray_gpus_per_rank"), num_nodes=request.num_nodes)
    runner = RayRunner(options, request.settings.nproc_per_node, request.say)
    try:
        yield runner
    finally:
        runner.close()


def _check_ray(options: BackendOptions) -> None:
    if options.picks_hosts:
        raise UsageError("--backend ray: the cluster places the ranks; drop --hostfile/--include/--exclude")
    most, cpus, gpus = (options.value(d) for d in ("ray_max_concurrent", "ray_cpus_per_rank", "ray_gpus_per_rank"))
    if most is not None and most < 1:
        raise UsageError(f"--ray_max_concurrent: got {most}; expected at least 1")
    if cpus <= 0 or (gpus is not None and gpus < 0):
        raise UsageError("--ray_cpus_per_rank must be above 0 and --ray_gpus_per_rank at least 0")


register_backend(BackendSpec(
    "local", "experiments launched here, one at a time (the default)", _local_runner, uses_forkserver=True,
    launches_plainly=True))
register_backend(BackendSpec(
    "ray", "each experiment a placement group on a Ray cluster, several at once when they fit "
    "(pip install 'autotuner[ray]')", _ray_runner, places_nodes=True, check=_check_ray, flags=(
        Flag("--ray_address", {"default": None, "help": "an existing cluster (auto, or HOST:PORT of its head); "
                               "default: RAY_ADDRESS if set, else a Ray instance started for this run"}),
        Flag("--ray_placement", {"choices": PLACEMENT_POLICIES, "default": EXCLUSIVE,
                                 "help": "exclusive: an experiment takes whole nodes, so timings do not interfere "
                                         "(default); shared: experiments share nodes' free slots"}),
        Flag("--ray_max_concurrent", {"type": int, "default": None,
                                      "help": "at most this many experiments at once (default: as many as the "
                                              "cluster holds)"}),
        Flag("--ray_cpus_per_rank", {"type": float, "default": 1.0, "help": "CPUs each rank's bundle reserves"}),
        Flag("--ray_gpus_per_rank", {"type": float, "default": None,
                                     "help": "GPUs each rank's bundle reserves (default: 1 when the cluster has "
                                             "GPUs, else 0)"}),
    )))


@contextmanager
def _slurm_runner(request: RunnerRequest) -> Iterator[Runner]:
    from autotuner.execution.slurm_runner import SlurmRunner, WarmNodes
    from autotuner.launch.slurm import read_allocation

    allocation = read_allocation(dict(os.environ))
    warm = WarmNodes(request.settings.script, tuple(request.tuning.warm_preload)) if request.tuning.warm_start else None
    if warm is None:
        request.say("warm start off (autotuning.warm_start: false): each experiment starts cold")
    runner = SlurmRunner(allocation, request.num_nodes, request.settings.nproc_per_node, request.say,
                         max_concurrent=request.options.value("slurm_max_concurrent"), warm=warm)
    try:
        yield runner
    finally:
        runner.close()


def _check_slurm(options: BackendOptions) -> None:
    if not (os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")):
        raise UsageError("--backend slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); run the tune "
                         "inside salloc or sbatch, or use --backend ray or the default local backend")
    if options.picks_hosts:
        raise UsageError("--backend slurm: the experiments run on the allocation's nodes; drop "
                         "--hostfile/--include/--exclude and choose the nodes with salloc/sbatch (-w, -x, -N)")
    most = options.value("slurm_max_concurrent")
    if most is not None and most < 1:
        raise UsageError(f"--slurm_max_concurrent: got {most}; expected at least 1")


def _sbatch_script(request: RunnerRequest, results_dir: Path) -> list[str]:
    from autotuner.execution.sbatch import sbatch_script

    command = (results_dir / "cmd_optimal.txt").read_text().strip()
    path = results_dir / "sbatch_optimal.sh"
    path.write_text(sbatch_script(command, request.num_nodes, request.settings.nproc_per_node, os.getcwd(),
                                  dict(os.environ)))
    path.chmod(0o755)
    return [f"or submit it as a batch job: sbatch {path}"]


register_backend(BackendSpec(
    "slurm", "each experiment job steps on nodes of this Slurm allocation (run inside salloc or sbatch), "
    "several at once when the allocation holds more nodes than one needs", _slurm_runner, places_nodes=True,
    check=_check_slurm, write_outputs=_sbatch_script, flags=(
        Flag("--slurm_max_concurrent", {"type": int, "default": None,
                                        "help": "at most this many experiments at once (default: as many as the "
                                                "allocation's nodes hold, --num_nodes each)"}),
    )))
