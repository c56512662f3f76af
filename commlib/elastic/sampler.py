"""Data for elastic training: each step's global batch, split over the ranks alive now."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..primitives import block_offsets, block_sizes


class ElasticSampler:
    """A batch sampler whose shards follow the group: step ``s`` reads global batch ``s``
    (``batch_size`` indices of a dataset of ``length``, a new permutation of the dataset
    every epoch when ``shuffle``, from ``seed + epoch``), split over the ranks of the current
    group in consecutive blocks (the first ``batch_size % size`` ranks get one more).

    A rank's share depends only on the step and on its rank and the size of the group, so
    after a failure the survivors read the same global batches, re-sharded over them, from
    the step they agreed on; no sample of a committed step is read twice, none is skipped.
    The global batch stays the same whatever the world size (with ``DistributedDataParallel``
    averaging gradients over the ranks, the update stays that of the whole global batch when
    ``batch_size`` divides by the group size). With warm spares (``run(spares=K)``) the
    shards follow the trainers' group alike: idle spares read nothing, and a spare that
    joined reads the share of its group rank (after the survivors'), so a group back at
    ``N`` ranks reads each global batch as ``N`` ranks without failure would. Bound to a
    :class:`commlib.elastic.State` as its ``sampler``, iterating yields this rank's index
    lists from the state's step to the end of that step's epoch.
    """

    def __init__(self, length: int, batch_size: int, shuffle: bool = True,
                 seed: int = 0) -> None:
        if int(batch_size) < 1 or int(length) < int(batch_size):
            raise ValueError(f"ElasticSampler: need 1 <= batch_size <= length, got "
                             f"batch_size={batch_size}, length={length}")
        self.length, self.batch_size = int(length), int(batch_size)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.state: Any = None
        self._perm: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.length // self.batch_size

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def global_batch(self, step: int) -> np.ndarray:
        """The indices of global batch ``step``."""
        epoch, pos = divmod(int(step), self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            order = (np.random.RandomState(self.seed + epoch).permutation(self.length)
                     if self.shuffle else np.arange(self.length))
            self._perm = (epoch, order)
        return self._perm[1][pos * self.batch_size:(pos + 1) * self.batch_size]

    def indices(self, step: int, rank: int, size: int) -> list[int]:
        """Rank ``rank``'s share (of a group of ``size``) of global batch ``step``."""
        start = block_offsets(self.batch_size, size)[rank]
        return self.global_batch(step)[start:start + block_sizes(self.batch_size, size)[rank]
                                       ].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        state = self.state
        if state is None:
            raise RuntimeError("ElasticSampler: iterate it as the sampler of a "
                               "commlib.elastic.State (it follows the state's step and group)")
        step = state.step
        end = (self.epoch_of(step) + 1) * self.steps_per_epoch
        for s in range(step, end):
            yield self.indices(s, state.group.rank, state.group.size)

    def __len__(self) -> int:
        return self.steps_per_epoch
