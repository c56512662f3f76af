"""Synchronous pipeline parallelism: schedules (GPipe, 1F1B, interleaved, Chimera) as pure
per-rank action lists (:mod:`commlib.pipeline.schedule`, no MPI) and :class:`Pipeline`,
which runs them over commlib's non-blocking send/recv."""
from .schedule import SCHEDULES, Action, Schedule, bubble_formula, generate, validate


def __getattr__(name: str):
    # the executor needs torch; the schedules do not
    if name == "Pipeline":
        from .executor import Pipeline
        return Pipeline
    raise AttributeError(f"module 'commlib.pipeline' has no attribute {name!r}")


__all__ = ["Action", "Pipeline", "SCHEDULES", "Schedule", "bubble_formula", "generate",
           "validate"]
