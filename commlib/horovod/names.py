"""DistributedOptimizer's parameter names, checked as Horovod checks them."""
from __future__ import annotations

from typing import Any


def named_parameters(optimizer_groups: list, named_parameters: Any) -> list:
    if named_parameters is not None:
        named = list(named_parameters)
    else:
        named = [(f"allreduce.noname.{i}.{j}", v) for i, g in enumerate(optimizer_groups)
                 for j, v in enumerate(g["params"])]
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for k, _ in named:
        (dups if k in seen else seen).add(k)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found "
                         f"duplicates: {', '.join(sorted(dups))}")
    all_ids = {id(v) for g in optimizer_groups for v in g["params"]}
    unnamed = all_ids - {id(v) for _, v in named}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named. Python object ids: {', '.join(map(str, unnamed))}")
    return named
