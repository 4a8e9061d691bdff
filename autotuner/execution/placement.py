"""Where an experiment's ranks go on a cluster, as data: which nodes, how many ranks on each,
and whether it fits beside the experiments already running. Nothing here talks to Ray.

An experiment's layout is torchrun's: `num_nodes` nodes with `nproc_per_node` ranks each. A node
offers slots: its GPUs divided by the GPUs a rank takes, else its CPUs divided by the CPUs a rank
takes. With the default policy (exclusive) an experiment takes whole nodes, so two experiments
never share a node's cores, memory bandwidth or network link while they are timed; with sharing,
it takes free slots on any node.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotuner.launch.plan import elastic_rank_variables

EXCLUSIVE = "exclusive"
SHARED = "shared"
PLACEMENT_POLICIES = (EXCLUSIVE, SHARED)


@dataclass(frozen=True)
class ClusterNode:
    """One live node as the cluster reports it."""

    node_id: str
    address: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class RankShape:
    """What one rank reserves: a bundle of the placement group."""

    cpus: float = 1.0
    gpus: float = 0.0

    def slots(self, node: ClusterNode) -> int:
        if self.gpus > 0:
            return int(node.gpus // self.gpus) if node.cpus >= self.cpus else 0
        return int(node.cpus // self.cpus) if self.cpus > 0 else 0

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus > 0 else {})}


@dataclass(frozen=True)
class Layout:
    """torchrun's shape of one experiment."""

    num_nodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node


@dataclass(frozen=True)
class RankPlace:
    """One rank's place: its global and local rank and the node it runs on."""

    rank: int
    local_rank: int
    node_rank: int
    node_id: str
    address: str


@dataclass(frozen=True)
class Placement:
    ranks: tuple[RankPlace, ...]

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.node_id for r in self.ranks))

    @property
    def master(self) -> RankPlace:
        return self.ranks[0]  # rendezvous on the first rank's node


def feasible(nodes: list[ClusterNode], layout: Layout, shape: RankShape) -> str | None:
    """None when the cluster, empty, could hold the layout; else why not, in one clause."""
    roomy = [n for n in nodes if shape.slots(n) >= layout.nproc_per_node]
    if len(roomy) >= layout.num_nodes:
        return None
    unit = f"{shape.gpus:g} GPU" if shape.gpus > 0 else f"{shape.cpus:g} CPU"
    largest = max((shape.slots(n) for n in nodes), default=0)
    return (f"{layout.num_nodes} node(s) with {layout.nproc_per_node} rank slot(s) of {unit} each are needed; the "
            f"cluster has {len(roomy)} such node(s) of {len(nodes)} (the largest holds {largest} rank(s))")


def place(nodes: list[ClusterNode], used: dict[str, int], layout: Layout, shape: RankShape,
          policy: str = EXCLUSIVE) -> Placement | None:
    """A placement for one experiment on the nodes' free slots (`used`: slots taken per node id by
    experiments running now), or None when it must wait. Nodes are taken in the cluster's order,
    fullest-fitting first under sharing (so whole nodes stay free for larger experiments)."""
    if policy not in PLACEMENT_POLICIES:
        raise ValueError(f"placement policy {policy!r}; expected one of {PLACEMENT_POLICIES}")

    def free(node: ClusterNode) -> int:
        if policy == EXCLUSIVE and used.get(node.node_id, 0):
            return 0
        return shape.slots(node) - used.get(node.node_id, 0)

    candidates = [n for n in nodes if free(n) >= layout.nproc_per_node]
    if policy == SHARED:
        candidates.sort(key=free)
    if len(candidates) < layout.num_nodes:
        return None
    ranks = []
    for node_rank, node in enumerate(candidates[:layout.num_nodes]):
        for local_rank in range(layout.nproc_per_node):
            ranks.append(RankPlace(node_rank * layout.nproc_per_node + local_rank, local_rank, node_rank,
                                   node.node_id, node.address))
    return Placement(tuple(ranks))


def taken(placement: Placement, policy: str, nodes: list[ClusterNode], shape: RankShape) -> dict[str, int]:
    """Slots a running experiment holds per node: all of each node's under exclusive use."""
    held: dict[str, int] = {}
    for rank in placement.ranks:
        held[rank.node_id] = held.get(rank.node_id, 0) + 1
    if policy == EXCLUSIVE:
        slots = {n.node_id: shape.slots(n) for n in nodes}
        held = {node_id: max(count, slots.get(node_id, count)) for node_id, count in held.items()}
    return held


def concurrency(nodes: list[ClusterNode], layout: Layout, shape: RankShape, policy: str,
                max_concurrent: int | None) -> int:
    """How many experiments of this layout the empty cluster runs at once (at least 1)."""
    used: dict[str, int] = {}
    count = 0
    while max_concurrent is None or count < max_concurrent:
        placement = place(nodes, used, layout, shape, policy)
        if placement is None:
            break
        for node_id, slots in taken(placement, policy, nodes, shape).items():
            used[node_id] = used.get(node_id, 0) + slots
        count += 1
    return max(1, count)


def rank_variables(place_: RankPlace, layout: Layout, master_addr: str, master_port: int,
                   run_id: str) -> dict[str, str]:
    """torch elastic's per-rank variables (and DeepSpeed's LOCAL_SIZE/CROSS_*) for a rank placed
    by us. Rank 0 hosts the rendezvous store itself: there is no elastic agent to host it."""
    return {**elastic_rank_variables(place_.rank, place_.local_rank, place_.node_rank, layout.nproc_per_node,
                                     layout.num_nodes, master_addr, master_port, run_id, agent_store=False),
            "LOCAL_SIZE": str(layout.nproc_per_node), "CROSS_RANK": str(place_.node_rank),
            "CROSS_SIZE": str(layout.num_nodes)}


def node_kinds(nodes: list[dict]) -> str:
    """The live nodes' kinds (CPUs, GPUs and accelerator type, never memory or load), for the
    fingerprint: which nodes an experiment gets is Ray's choice, so the kinds, not their count."""
    kinds = set()
    for node in nodes:
        if node.get("Alive"):
            resources = node.get("Resources", {})
            accelerators = sorted(key for key in resources if key.startswith("accelerator_type:"))
            kinds.add(" ".join([f"CPU={resources.get('CPU', 0):g}", f"GPU={resources.get('GPU', 0):g}", *accelerators]))
    return "ray nodes: " + "; ".join(sorted(kinds))


C10D_PORT = 29400  # torchrun's default for --rdzv_endpoint


def rendezvous_flags(num_nodes: int, head_address: str) -> tuple[str, ...]:
    """The optimal command's flags for experiments that spanned several nodes of a Ray cluster:
    torch's c10d rendezvous at the head node (reachable from every node that joined it), run on
    each of the nodes, as torchrun users do; on one node, none."""
    if num_nodes <= 1:
        return ()
    return ("--num_nodes", str(num_nodes), "--rdzv_endpoint", f"{head_address}:{C10D_PORT}",
            "--rdzv_id", "autotuner-optimal")
