"""deepspeed.utils.RepeatingLoader: an endless stream of batches, the loader iterated again from
its start when it runs out (what DeepSpeed's pipeline engine reads its data through)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator


class RepeatingLoader:
    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
