"""`launcher` / `python -m autotuner`: argument parsing only. Errors become one line and an exit code."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any

from autotuner.app.backend_options import backend_options
from autotuner.app.launch_checks import check_training_config
from autotuner.core.errors import AutotunerError, UsageError
from autotuner.core.plugins import load_plugins
from autotuner.execution.backends import BACKENDS, add_backend_flags, check_backend
from autotuner.launch.nodes import STOP_WITH_STDIN_FLAG


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep our one-line format
        raise UsageError(message)


def _rank_counts(text: str) -> tuple[int, ...]:
    """`2`, or a comma list `1,2,4` (only --bench accepts more than one; see _single_rank_count)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        if "," in text:
            raise argparse.ArgumentTypeError(f"invalid list of ints: {text!r}; expected e.g. 1,2,4") from None
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None


def _single_rank_count(counts: tuple[int, ...] | None) -> int | None:
    if counts is not None and len(counts) > 1:
        listed = ",".join(map(str, counts))
        raise UsageError(f"--nproc_per_node: got the list {listed}; a list of world sizes is only allowed with "
                         "--bench; give one number of ranks per node")
    return counts[0] if counts else None


def _torchrun_env(dest: str, default: Any) -> Any:
    """torchrun reads each flag it has from PET_<FLAG> too (Kubeflow's PyTorchJob sets PET_NNODES,
    PET_NODE_RANK, PET_MASTER_ADDR, ...): the flag, where given, wins."""
    return os.environ.get(f"PET_{dest.upper()}", default)


def _hardware_plan(args: argparse.Namespace) -> int:
    if args.autotuning != "plan":
        raise UsageError(f"--hardware {args.hardware}: a spec is planned for, never trained on; add --autotuning plan")
    from autotuner.app.hardware_plan import hardware_plan

    ranks = _single_rank_count(args.nproc_per_node)
    if not isinstance(ranks, int) or ranks < 1:
        raise UsageError(f"--nproc_per_node {ranks}: --hardware plans for a count of accelerators a node; "
                         "give a number")
    return hardware_plan(args.script, tuple(args.script_args), args.hardware, int(args.num_nodes or 1), ranks,
                         debug=args.debug, engine=args.engine)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="launcher",
        # No abbreviations: DeepSpeed's --no_ssh would otherwise be read as our --no_ssh_check.
        allow_abbrev=False,
        description="Start a training script on N ranks (torch elastic), or autotune its DeepSpeed-style config.",
        usage="launcher [options] script.py [script args ...] --deepspeed ds.json",
    )
    parser.add_argument("--nproc_per_node", "--num_gpus", dest="nproc_per_node", type=_rank_counts,
                        default=_torchrun_env("nproc_per_node", None),
                        help="ranks per node (default: all visible GPUs, or 1 on CPU); with --bench a comma list "
                             "of world sizes, e.g. 1,2,4")
    parser.add_argument("--num_nodes", "--nnodes", dest="num_nodes", type=int, default=_torchrun_env("nnodes", None),
                        help="number of nodes (default 1; with a --hostfile: its first N hosts, default all)")
    parser.add_argument("--node_rank", type=int, default=_torchrun_env("node_rank", 0),
                        help="this node's rank, 0..num_nodes-1")
    parser.add_argument("--master_addr", default=_torchrun_env("master_addr", None),
                        help="address of node 0 (default: 127.0.0.1 on one node)")
    parser.add_argument("--master_port", type=int, default=_torchrun_env("master_port", None),
                        help="rendezvous port (default: a free one)")
    parser.add_argument("--rdzv_endpoint", default=_torchrun_env("rdzv_endpoint", None),
                        help="HOST:PORT for torch's c10d elastic rendezvous")
    parser.add_argument("--rdzv_backend", "--rdzv-backend", dest="rdzv_backend", choices=("c10d", "static"),
                        default=_torchrun_env("rdzv_backend", None),
                        help="with --rdzv_endpoint: c10d (the default here: nodes numbered as they join) or static "
                             "(numbered by --node_rank; torchrun's default)")
    parser.add_argument("--rdzv_id", default=_torchrun_env("rdzv_id", None),
                        help="job id shared by all nodes with --rdzv_endpoint")
    parser.add_argument("--rdzv_conf", "--rdzv-conf", dest="rdzv_conf", default=_torchrun_env("rdzv_conf", ""),
                        help="torchrun's rendezvous settings, KEY=VALUE,...: e.g. timeout=60 (static: seconds to wait "
                             "for every node), join_timeout=60 (c10d)")
    ds = parser.add_argument_group("the deepspeed launcher's flags")
    ds.add_argument("-H", "--hostfile", default=None,
                    help="DeepSpeed-style hostfile ('host slots=N' lines): only this host sets the slots here; "
                         "other hosts start one launcher each over ssh (or srun: --launcher slurm); default "
                         "DeepSpeed's /job/hostfile where it exists")
    ds.add_argument("-i", "--include", default=None,
                    help="devices to use, e.g. localhost:0,1 (sets CUDA_VISIBLE_DEVICES; slot ids count the "
                         "GPUs this launcher sees)")
    ds.add_argument("-e", "--exclude", default=None, help="devices to leave out, e.g. localhost:1")
    ds.add_argument("--no_local_rank", action="store_true",
                    help="do not pass --local_rank=N to the script (it is passed by default, as DeepSpeed does)")
    ds.add_argument("--bind_cores_to_rank", action="store_true",
                    help="pin each rank to its own share of this process's cores (OMP_NUM_THREADS set to match)")
    ds.add_argument("--bind_core_list", default=None, help="with --bind_cores_to_rank: the cores to share, e.g. 0,2-5")
    ds.add_argument("--enable_each_rank_log", default=None, metavar="DIR",
                    help="each rank's stdout and stderr go to DIR/<time>_rank<N>.log")
    ds.add_argument("--launcher", default="pdsh",
                    help="multi-node backend: pdsh/ssh with a --hostfile; slurm/srun: one job step per node of the "
                         "Slurm allocation (inside salloc or sbatch); otherwise the ranks start locally whichever "
                         "is named")
    ds.add_argument("--launcher_args", default="",
                    help="--launcher slurm: more srun options for every node's step, one quoted string")
    ds.add_argument("--slurm_comment", default=None, help="--launcher slurm: srun's --comment on every node's step")
    ds.add_argument("--force_multi", action="store_true", help="refused: pdsh/MPI starts are not supported")
    ds.add_argument("--ssh_port", type=int, default=None, help="multi-host --hostfile over ssh: the remote port")
    ds.add_argument("--no_ssh", action="store_true",
                    help="refused: DeepSpeed's start of this node alone from a hostfile; start each node with "
                         "--num_nodes, --node_rank and --master_addr")
    ds.add_argument("--no_ssh_check", action="store_true",
                    help="multi-host --hostfile: do not check that every host answers ssh before starting")
    parser.add_argument(STOP_WITH_STDIN_FLAG, action="store_true", help=argparse.SUPPRESS)  # see launch/nodes.py
    add_backend_flags(parser)
    parser.add_argument("--engine", choices=("auto", "deepspeed", "autotuner"), default="auto",
                        help="whose engine the script trains on, for the checks that depend on it; auto: DeepSpeed's "
                             "own when the script imports deepspeed, ours (autotuner) when it imports autotuner, and "
                             "for a script that imports both, with --autotuning, the one the profile launch's ranks "
                             "build")
    parser.add_argument("--report_file", default=None, help=argparse.SUPPRESS)  # the tuner's launches: see LaunchReport
    parser.add_argument("--tuned_values", default=None, metavar="FILE",
                        help="a tune's tuned_values.json (cmd_optimal.txt names it): our engine trains with the "
                             "pick's values where the script builds its config in code")
    parser.add_argument("--autotuning", choices=("tune", "run", "plan", "online"), default=None,
                        help="tune: search ZeRO stage x micro-batch x gas and write the optimum; run: tune, then "
                             "train; plan: launch only the profile and print every candidate's predicted memory "
                             "and step time (autotuning_results/plan.csv); online: train the config as written, "
                             "tuning its communication knobs as it goes")
    parser.add_argument("--hardware", default=None, metavar="SPEC.json",
                        help="with --autotuning plan: plan for the accelerators and links SPEC.json describes, on "
                             "--num_nodes x --nproc_per_node of them that need not exist here (the model counted on "
                             "the meta device; nothing launched)")
    parser.add_argument("--bench", action="store_true",
                        help="synthetic benchmark: samples/s and scaling efficiency at each --nproc_per_node size, "
                             "fixed per-rank micro-batch (weak scaling); writes bench_results/bench.csv")
    parser.add_argument("--bench_warmup", type=int, default=5, help="--bench: optimizer steps run before timing")
    parser.add_argument("--bench_iters", type=int, default=20, help="--bench: optimizer steps timed per world size")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and torch elastic's logs")
    parser.add_argument("--history", nargs="?", const="", default=None, metavar="URL",
                        help="list the tuning runs in a history database, then exit (default: "
                             "sqlite:///autotuning_results/history.db); no script is given")
    parser.add_argument("script", help="training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _read_default_hostfile(args: argparse.Namespace) -> None:
    """Without --hostfile, DeepSpeed's default one where it exists (launch/resources.py)."""
    from autotuner.launch import resources

    if args.hostfile is not None or not BACKENDS[args.backend].launches_plainly:
        return
    starts_one_node = bool(args.node_rank or args.master_addr or args.rdzv_endpoint)
    args.hostfile = resources.default_hostfile(os.path.isfile(resources.DEFAULT_HOSTFILE),
                                               starts_one_node=starts_one_node)
    if args.hostfile is not None:
        print(f"launcher: note: no --hostfile given; reading DeepSpeed's default {args.hostfile}",
              file=sys.stderr)


def _launch(args: argparse.Namespace) -> int:
    import dataclasses

    from autotuner.core.boundary import ONLINE_ENV
    from autotuner.launch import LaunchOptions, build_plan, run_plan
    from autotuner.launch.nodes import nodes_plan
    from autotuner.launch.plan import config_checked
    from autotuner.launch.slurm import read_allocation, uses_allocation

    options = LaunchOptions.from_args(args)
    environ = dict(os.environ)
    # --launcher slurm: the allocation's nodes, read once (scontrol) before the plan is built.
    allocation = read_allocation(environ) if uses_allocation(options.launcher) else None
    nodes = nodes_plan(options, sys.executable, os.getcwd(), environ, num_nodes=args.num_nodes,
                       agent_flags=(("--debug",) if args.debug else ()) + (
                           ("--autotuning", "online") if args.autotuning == "online" else ()),
                       allocation=allocation)
    if nodes is not None:
        from autotuner.launch.node_runner import run_nodes

        check_training_config(tuple(args.script_args), nodes.world_size, args.autotuning == "online", args.script, args.engine)
        return run_nodes(nodes)
    if args.stop_with_stdin:
        _stop_when_stdin_closes()
    plan = build_plan(options, sys.executable)
    online = args.autotuning == "online"
    check_training_config(tuple(args.script_args), plan.world_size, online, args.script, args.engine)
    if online:
        plan = dataclasses.replace(plan, env={**plan.env, ONLINE_ENV: "1"})
    return run_plan(config_checked(plan), quiet=not args.debug)


def _stop_when_stdin_closes() -> None:
    """A node started by the head (launch/nodes.py): its stdin is the head's pipe. When that closes,
    stop as on SIGTERM, so torch elastic ends this node's ranks."""
    from autotuner.launch.stopping import stop_in_progress

    def watch() -> None:
        # The raw fd, not sys.stdin: a daemon thread blocked in a buffered read aborts interpreter exit.
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        # Already stopping (scancel signals every process of a job step, and the pipe closes as srun
        # goes): a second SIGTERM would cut the ranks' grace short. The signal and the pipe's end
        # race (seen once in a full suite run), so a signal on its way is given a second to register.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if stop_in_progress():
                return
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="stop-with-stdin").start()


def _bench(args: argparse.Namespace) -> int:
    from autotuner.app.bench import bench

    return bench(args)


@contextmanager
def _early_forkserver(args: argparse.Namespace):
    """The warm path's forkserver, started before this process imports torch, so the two imports
    run side by side. Only for a config that loads and asks for warm local launches; anything the
    config gets wrong is left for `settle` to report. Stopped on the way out whoever ends up with it."""
    from autotuner.config import load_config
    from autotuner.execution.forkserver import Forkserver, WarmStartBroken
    from autotuner.launch.script_args import config_path

    forkserver = None
    source = config_path(tuple(args.script_args))
    loader_log = logging.getLogger("autotuner.config.loader")
    loader_log.disabled = True  # its one warning is settle's to give, when it loads the file again
    try:
        uses_forkserver = BACKENDS[getattr(args, "backend", "local")].uses_forkserver
        tuning = load_config(source).autotuning if source and uses_forkserver else None
    except AutotunerError:
        tuning = None
    finally:
        loader_log.disabled = False
    if tuning is not None and tuning.warm_start:
        forkserver = Forkserver(args.script, tuple(tuning.warm_preload))
        try:
            forkserver.start()
        except WarmStartBroken:  # the runner starts its own at the first launch, and reports why not
            forkserver.close()
            forkserver = None
        else:
            logging.getLogger("autotuner").info("warm start: forkserver %s started early (torch imported here "
                                                "already: %s)", forkserver.pid, "torch" in sys.modules)
    try:
        yield forkserver
    finally:
        if forkserver is not None:
            forkserver.close()


def _autotune(args: argparse.Namespace) -> int:
    from autotuner.launch.stopping import raise_if_stopped

    with _early_forkserver(args) as forkserver:
        from autotuner.app.request import TuneRequest
        from autotuner.app.tune import autotune  # torch and the tuner: seconds of imports

        # A stop during those imports raised inside a library, which may have swallowed it (a bare
        # except around an optional import): the stop stands all the same.
        raise_if_stopped()
        return autotune(TuneRequest.of(args), forkserver)


def main(argv: list[str] | None = None) -> int:
    from autotuner.launch.stopping import (Stopped, end_descendants, raise_if_stopped, remove_temporary_dirs,
                                           stop_guard, stop_signal, sweep_stale_temporary_dirs)

    argv = sys.argv[1:] if argv is None else argv
    script_at = next((i for i, arg in enumerate(argv) if arg.endswith(".py")), len(argv))
    if "--report_file" in argv[:script_at]:  # a tuner's launch: it ends (and ends its ranks) with the tuner
        from autotuner.core.parent_death import die_with_parent

        die_with_parent(death_signal=signal.SIGTERM)
    sweep_stale_temporary_dirs()
    with stop_guard():
        try:
            status = _main(argv, script_at)
            raise_if_stopped()  # a stop some library swallowed on the way: it stands all the same
            return status
        except BaseException as err:  # noqa: BLE001 - a stop, whatever it turned into on the way up
            # A stop raised inside a library (an import, say) can come up as another error; with a
            # stop in progress it is the stop.
            stop = err if isinstance(err, Stopped) else Stopped(stop_signal()) if stop_signal() else None
            if stop is None:
                raise
            # Every level has ended what it started on the way up; this ends anything a stop at an
            # awkward instant left (a process forked as the signal came, say).
            end_descendants()
            remove_temporary_dirs()
            if not stop.reported:
                print(f"launcher: stopped by {stop.name}", file=sys.stderr)
            return stop.exit_status


def _history(argv: list[str]) -> int:
    """`launcher --history [URL] [--debug]`: no script, so it is parsed on its own."""
    from autotuner.app.history import show_history

    rest = [arg for arg in argv if arg not in ("--history", "--debug")]
    if len(rest) > 1 or any(arg.startswith("-") for arg in rest):
        raise UsageError(f"--history takes at most one URL and no script; got {' '.join(rest)}")
    return show_history(rest[0] if rest else None)


def _main(argv: list[str], script_at: int) -> int:
    debug = "--debug" in argv[:script_at]  # a --debug after the script is the script's
    try:
        if "--history" in argv[:script_at]:
            return _history(argv)
        load_plugins()  # before parsing: a plugin's backend adds --backend choices and flags
        args = build_parser().parse_args(argv)
        # Read once, here: the launchers this one starts (a tune's experiments, other nodes') get
        # their flags spelt out and must not read PET_* in their place.
        for name in [name for name in os.environ if name.startswith("PET_")]:
            del os.environ[name]
        debug = args.debug
        logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(name)s: %(message)s")
        if args.no_ssh:
            raise UsageError("--no_ssh: DeepSpeed's start of this node alone from a hostfile is not supported; start "
                             "each node with --num_nodes N --node_rank R --master_addr ADDR (or --rdzv_endpoint)")
        check_backend(backend_options(args))
        _read_default_hostfile(args)
        if args.bench:
            return _bench(args)
        if args.hardware is not None:
            return _hardware_plan(args)
        args.nproc_per_node = _single_rank_count(args.nproc_per_node)
        if args.autotuning in ("tune", "run", "plan"):
            return _autotune(args)
        return _launch(args)
    except AutotunerError as err:
        if debug:
            traceback.print_exc()
        print(f"launcher: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("launcher: interrupted", file=sys.stderr)
        return 130
