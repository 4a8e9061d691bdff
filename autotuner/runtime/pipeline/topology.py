"""DeepSpeed's process topologies: a row-major grid of named axes over the ranks (the last axis
fastest), so a pipeline with axes ("pipe", "data") puts rank = stage * dp + d, and the ranks of
one stage are consecutive, as DeepSpeed lays them out."""

from __future__ import annotations

import itertools
from collections import namedtuple
from math import prod
from typing import Any, Sequence


class ProcessTopology:
    """Ranks over the cartesian product of `axes` with sizes `dims` (row-major)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]):
        if len(axes) != len(dims) or not axes:
            raise ValueError(f"ProcessTopology: {len(axes)} axes and {len(dims)} dims; give one size per axis")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # as DeepSpeed names it
        self.mapping = {self.ProcessCoord(*coord): rank
                        for rank, coord in enumerate(itertools.product(*(range(d) for d in self.dims)))}
        self._coords = {rank: coord for coord, rank in self.mapping.items()}

    def get_rank(self, **coord_kwargs: int) -> int:
        if sorted(coord_kwargs) != sorted(self.axes):
            raise ValueError(f"get_rank() needs a coordinate on every axis {self.axes}; got {sorted(coord_kwargs)}")
        return self.mapping[self.ProcessCoord(**coord_kwargs)]

    def get_coord(self, rank: int) -> Any:
        if rank not in self._coords:
            raise ValueError(f"rank {rank} is not in this topology of {self.world_size()} ranks")
        return self._coords[rank]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """The axis's size; 0 where the topology has no such axis (as DeepSpeed answers)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def world_size(self) -> int:
        return prod(self.dims)

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes
                              if axis not in omit_axes)

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates match every given axis value, in rank order."""
        return [rank for coord, rank in sorted(self.mapping.items(), key=lambda item: item[1])
                if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks at index `idx` of `axis`."""
        return self.filter_match(**{axis: idx}) if axis in self.axes else []

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only along `axis` (one communicator each), in DeepSpeed's
        order: over every combination of the other axes' values."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists


class PipeDataParallelTopology(ProcessTopology):
    """Stages outermost, data parallel inside: the ranks of one stage are consecutive."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Stages, then data parallel, then tensor (model) parallel fastest: a tensor-parallel group is
    consecutive ranks, as our tensor-parallel layout builds it."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
