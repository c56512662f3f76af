"""Per-phase time accounting of a K-FAC algorithm (this rank only)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("factors", "inverses", "precondition", "communication")


class Timers:
    """Accumulates wall-clock and calling-thread CPU seconds per phase.

    CPU time (``time.thread_time``) is the work this rank's calling thread did, which stays
    meaningful when ranks share cores; it misses work of torch's intra-op threads, so
    benchmarks that rely on it run with ``torch.set_num_threads(1)``. The wall time of
    ``communication`` includes waiting for slower ranks to reach the collective.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.cpu = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent inside the ``with`` block to ``name``."""
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.wall[name] += time.perf_counter() - wall
            self.cpu[name] += time.thread_time() - cpu

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{phase: {"wall_s": float, "cpu_s": float}}`` accumulated since the last reset."""
        return {p: {"wall_s": self.wall[p], "cpu_s": self.cpu[p]} for p in PHASES}
