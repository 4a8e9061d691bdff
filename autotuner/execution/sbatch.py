"""sbatch_optimal.sh: what a tune under `--backend slurm` writes beside cmd_optimal.txt."""

from __future__ import annotations

import shlex


def sbatch_script(command: str, num_nodes: int, nproc_per_node: int, cwd: str, environ: dict[str, str]) -> str:
    """sbatch_optimal.sh: the optimal command as a batch job on `num_nodes` nodes, one agent per node
    as a job step (--launcher slurm, added where the command lacks it), from the folder the tune ran in."""
    words = shlex.split(command)
    if "--launcher" not in words:
        at = 1 if not (len(words) > 2 and words[1:3] == ["-m", "autotuner"]) else 3
        words[at:at] = ["--launcher", "slurm", "--num_nodes", str(num_nodes)]
    gpus = [f"#SBATCH --gpus-per-node={nproc_per_node}"] if ("SLURM_GPUS_ON_NODE" in environ
                                                              or "SLURM_GPUS_PER_NODE" in environ) else []
    return "\n".join([
        "#!/bin/bash",
        "#SBATCH --job-name=autotuner-optimal",
        f"#SBATCH --nodes={num_nodes}",
        "#SBATCH --ntasks-per-node=1",
        *gpus,
        f"# Written by launcher --autotuning --backend slurm: the optimal config on {num_nodes} node(s) x "
        f"{nproc_per_node} rank(s).",
        f"cd {shlex.quote(cwd)}",
        shlex.join(words),
        "",
    ])
