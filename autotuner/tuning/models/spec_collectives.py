"""Collectives costed from a hardware spec's links, by algorithm (issue 80, part 3).

A group of n ranks with g of them on each node it spans. Inside one node the ring runs over the
intra-node link; across nodes NCCL runs one ring per network card in parallel, so a ring's bus
bandwidth is the lesser of the intra-node link and g cards' worth of the inter-node one, and a
hop pays the inter-node latency. For a full (unsharded) tensor of S bytes:

- all_gather, reduce_scatter (ring): (n - 1) latency + S (n - 1) / n / bus;
- all_reduce: the faster of the ring, 2 (n - 1) latency + 2 S (n - 1) / n / bus, and the tree,
  2 ceil(log2 n) latency + 2 S / bus (fewer hops for small messages);
- broadcast (a tree, pipelined): ceil(log2 n) latency + S / bus;
- send (point to point): latency + S / link, over the inter-node link where the pair spans nodes.
A link's `collectives` entry (config/hardware.py) gives a collective its own bus bandwidth and
latency where the library runs it at another speed. A group of one moves nothing. Pure functions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autotuner.config.hardware import HardwareSpec

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "send")


@dataclass(frozen=True)
class Group:
    size: int
    per_node: int  # of its ranks on one node (its size where it fits in one)

    @property
    def spans_nodes(self) -> bool:
        return self.size > self.per_node


def group_of(size: int, stride: int, spec: HardwareSpec) -> Group:
    """The group of `size` ranks `stride` apart (1: neighbours, a tensor-parallel group; the
    model-parallel ranks between, for a data-parallel group) on nodes of the spec's accelerators."""
    per_node = max(1, min(size, spec.accelerators_per_node // max(1, stride)))
    return Group(size, per_node)


def collective_seconds(op: str, nbytes: float, group: Group, spec: HardwareSpec) -> float:
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    intra, inter = spec.intra_node, spec.inter_node
    if op == "send":
        link = inter if group.spans_nodes else intra
        return link.latency + nbytes / link.bandwidth
    if op not in OPS:
        raise ValueError(f"collective {op!r}: expected one of {', '.join(OPS)}")
    (intra_bus, intra_latency), (inter_bus, inter_latency) = intra.bus(op), inter.bus(op)
    if group.spans_nodes:
        bus = min(intra_bus, group.per_node * inter_bus)
        latency = inter_latency
    else:
        bus, latency = intra_bus, intra_latency
    share = (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) * latency + nbytes * share / bus
    if op == "all_reduce":
        ring = 2 * (n - 1) * latency + 2 * nbytes * share / bus
        tree = 2 * math.ceil(math.log2(n)) * latency + 2 * nbytes / bus
        return min(ring, tree)
    return math.ceil(math.log2(n)) * latency + nbytes / bus  # broadcast
