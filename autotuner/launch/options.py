"""The launcher's command-line options as frozen records: what the user asked for (LaunchOptions)
and the flags a tuner's launches carry over (RankFlags). launch/plan.py turns them into a plan."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class RankFlags:
    """The launcher flags that pick devices and shape each rank: what the tuner's launches and the
    optimal command carry over from the user's command line."""

    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    bind_core_list: str | None = None
    no_local_rank: bool = False
    bind_cores_to_rank: bool = False
    master_port: int | None = None

    @property
    def picks_ranks_itself(self) -> bool:
        """--include and --exclude set the rank count: --nproc_per_node must not be added. A hostfile's
        slots do not when --nproc_per_node is given (it takes that many of them, as DeepSpeed's
        --num_gpus does), so the settled count is passed on beside it."""
        return any(value is not None for value in (self.include, self.exclude))

    def to_argv(self) -> tuple[str, ...]:
        # This order is in the fingerprints of journals written before RankFlags: keep it.
        flags: list[str] = []
        for flag, value in (("--hostfile", self.hostfile), ("--include", self.include), ("--exclude", self.exclude),
                            ("--bind_core_list", self.bind_core_list)):
            if value is not None:
                flags += [flag, value]
        if self.no_local_rank:
            flags.append("--no_local_rank")
        if self.bind_cores_to_rank:
            flags.append("--bind_cores_to_rank")
        if self.master_port is not None:
            flags += ["--master_port", str(self.master_port)]
        return tuple(flags)


@dataclass(frozen=True)
class LaunchOptions:
    """What the user asked for on the command line. None means "choose for me"."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int | None = None
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str = ""  # torchrun's --rdzv_conf: KEY=VALUE,...
    rdzv_backend: str | None = None  # torchrun's: with --rdzv_endpoint, c10d (ours by default) or static
    # The `deepspeed` launcher's flags.
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    no_local_rank: bool = False
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    each_rank_log_dir: str | None = None
    launcher: str = "pdsh"
    launcher_args: str = ""  # more srun options for --launcher slurm, one shell-quoted string (DeepSpeed's flag)
    slurm_comment: str | None = None  # srun --comment on every node's job step
    force_multi: bool = False
    ssh_port: int | None = None
    ssh_check: bool = True
    # A tuner's launch: the launcher writes its LaunchReport here (and run_script records the ranks' failures).
    report_file: str | None = None
    # A tune's tuned_values.json: our engine lays the pick's values over a script's config built in code.
    tuned_values: str | None = None

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> "LaunchOptions":
        """From the launcher's parsed command line; `overrides` replace fields."""
        fields = dict(
            script=args.script, script_args=tuple(args.script_args), nproc_per_node=args.nproc_per_node,
            num_nodes=args.num_nodes or 1, node_rank=args.node_rank, master_addr=args.master_addr,
            master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
            rdzv_conf=getattr(args, "rdzv_conf", ""), rdzv_backend=getattr(args, "rdzv_backend", None),
            hostfile=args.hostfile, include=args.include, exclude=args.exclude, no_local_rank=args.no_local_rank,
            bind_cores_to_rank=args.bind_cores_to_rank, bind_core_list=args.bind_core_list,
            each_rank_log_dir=args.enable_each_rank_log, launcher=args.launcher,
            launcher_args=getattr(args, "launcher_args", ""), slurm_comment=getattr(args, "slurm_comment", None),
            force_multi=args.force_multi,
            ssh_port=getattr(args, "ssh_port", None), ssh_check=not getattr(args, "no_ssh_check", False),
            report_file=args.report_file, tuned_values=getattr(args, "tuned_values", None),
        )
        return cls(**{**fields, **overrides})

    def rank_flags(self) -> RankFlags:
        """The flags the tuner's launches and the optimal command carry over (not --master_port:
        each launch picks a free one)."""
        return RankFlags(self.hostfile, self.include, self.exclude, self.bind_core_list, self.no_local_rank,
                         self.bind_cores_to_rank)

    def to_argv(self) -> tuple[str, ...]:
        """`launcher` arguments that parse back to these options (the inverse of from_args over the
        CLI's parser): flags at their defaults are left out."""
        argv: list[str] = []
        for flag, value, default in (
                ("--nproc_per_node", self.nproc_per_node, None), ("--num_nodes", self.num_nodes, 1),
                ("--node_rank", self.node_rank, 0), ("--master_addr", self.master_addr, None),
                ("--master_port", self.master_port, None), ("--rdzv_endpoint", self.rdzv_endpoint, None),
                ("--rdzv_id", self.rdzv_id, None), ("--rdzv_conf", self.rdzv_conf, ""),
                ("--rdzv_backend", self.rdzv_backend, None),
                ("--hostfile", self.hostfile, None), ("--include", self.include, None),
                ("--exclude", self.exclude, None), ("--bind_core_list", self.bind_core_list, None),
                ("--enable_each_rank_log", self.each_rank_log_dir, None), ("--launcher", self.launcher, "pdsh"),
                ("--launcher_args", self.launcher_args, ""), ("--slurm_comment", self.slurm_comment, None),
                ("--ssh_port", self.ssh_port, None), ("--report_file", self.report_file, None),
                ("--tuned_values", self.tuned_values, None)):
            if value != default:
                # A value that starts with a dash (--launcher_args) would read as a flag of its own.
                argv += [f"{flag}={value}"] if str(value).startswith("-") else [flag, str(value)]
        for flag, on in (("--no_local_rank", self.no_local_rank), ("--bind_cores_to_rank", self.bind_cores_to_rank),
                         ("--force_multi", self.force_multi), ("--no_ssh_check", not self.ssh_check)):
            if on:
                argv.append(flag)
        return (*argv, self.script, *self.script_args)
