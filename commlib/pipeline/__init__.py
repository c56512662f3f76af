"""Synchronous pipeline parallelism: schedules (GPipe, 1F1B, interleaved, Chimera) as pure
per-rank action lists (:mod:`commlib.pipeline.schedule`, no MPI), :class:`Pipeline`,
which runs them over commlib's non-blocking send/recv, and :func:`partition`, which cuts a
model into balanced stages for it (:mod:`commlib.pipeline.partitioner`;
the module is not named ``partition``, which would shadow the function)."""
from .schedule import SCHEDULES, Action, Schedule, bubble_formula, generate, validate


def __getattr__(name: str):
    # the executor needs torch; the schedules do not
    if name == "Pipeline":
        from .executor import Pipeline
        return Pipeline
    if name in ("partition", "Partition"):
        from . import partitioner as module
        return getattr(module, name)
    raise AttributeError(f"module 'commlib.pipeline' has no attribute {name!r}")


__all__ = ["Action", "Partition", "Pipeline", "SCHEDULES", "Schedule", "bubble_formula",
           "generate", "partition", "validate"]
