"""What a rank runs first when the launcher binds cores or logs per rank, then replaces itself
with the user's script (exec keeps the pid, so process-tree clean-up is unchanged).

    python -m autotuner.launch.rank_entry [--core_groups "0,1;2,3"] [--memory_policies "bind:0;bind:1"] \
        [--log_dir DIR] \
        -- python -u train.py ...

The core mask, the memory policy and the redirected stdout/stderr survive the exec, so the script's
interpreter and every thread it starts run on the rank's cores and allocate by its NUMA policy, like
DeepSpeed's `numactl -C ... -m ...` (or `-p ...`) prefix. A warm rank applies the same in its own process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


# The launcher's start time, set before the ranks start: every rank's log carries the same one, as
# under DeepSpeed's launcher.
LOG_PREFIX_ENV = "AUTOTUNER_EACH_RANK_LOG_PREFIX"


def log_prefix() -> str:
    return time.strftime("%Y%m%d%H%M%S", time.localtime())


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="autotuner.launch.rank_entry")
    parser.add_argument("--core_groups", default=None, help="cores per local rank, e.g. '0,1;2,3'")
    parser.add_argument("--memory_policies", default=None,
                        help="each local rank's memory policy, e.g. 'bind:0;bind:1', 'prefer:2;prefer:3' or "
                             "'bind:0,1;bind:2,3' (empty: none)")
    parser.add_argument("--log_dir", default=None, help="stdout and stderr go to DIR/<launch time>_rank<N>.log")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def apply(args: argparse.Namespace) -> None:
    """Bind this process to its local rank's cores and send its output to its log, as asked."""
    if args.core_groups:
        group = args.core_groups.split(";")[int(os.environ.get("LOCAL_RANK", 0))]
        os.sched_setaffinity(0, {int(core) for core in group.split(",")})
    if args.memory_policies:
        policy = args.memory_policies.split(";")[int(os.environ.get("LOCAL_RANK", 0))]
        if policy:
            set_memory_policy(policy)
    if args.log_dir:
        rank = os.environ.get("RANK", "0")
        prefix = os.environ.get(LOG_PREFIX_ENV) or log_prefix()
        path = os.path.join(args.log_dir, f"{prefix}_rank{rank}.log")
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # DeepSpeed opens it with "w"
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)


MPOL_MODES = {"prefer": 1, "bind": 2}  # MPOL_PREFERRED, MPOL_BIND: linux/mempolicy.h


def set_memory_policy(policy: str) -> None:
    """Allocate this process's memory as `policy` says ('bind:0,1': on those NUMA nodes only, as
    numactl -m; 'prefer:2': there first, elsewhere once it is full, as numactl -p), through
    libnuma's set_mempolicy. Should the kernel refuse (a node outside this cgroup's memory nodes),
    the rank says so once and runs without it."""
    import ctypes
    import ctypes.util

    from autotuner.launch.numa import MemoryPolicy

    parsed = MemoryPolicy.parse(policy)
    words = max(parsed.nodes) // 64 + 1
    mask = (ctypes.c_ulong * words)()
    for node in parsed.nodes:
        mask[node // 64] |= 1 << (node % 64)
    try:
        libnuma = ctypes.CDLL(ctypes.util.find_library("numa") or "libnuma.so.1", use_errno=True)
        failed = libnuma.set_mempolicy(MPOL_MODES[parsed.mode], mask, ctypes.c_ulong(words * 64 + 1)) != 0
        reason = os.strerror(ctypes.get_errno()) if failed else ""
    except OSError as err:
        failed, reason = True, str(err)
    if failed:
        print(f"autotuner: rank {os.environ.get('RANK', '0')}: memory policy {policy} not applied ({reason})",
              file=sys.stderr)


def main(argv: list[str]) -> None:
    args = parse(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    apply(args)
    sys.stdout.flush()
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
