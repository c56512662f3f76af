"""Which parameters a forward pass reached: a walk of the autograd graph from the outputs
(what ``find_unused_parameters=True`` needs to mark the others ready in backward)."""
from __future__ import annotations

from typing import Any

import torch


def output_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors inside nested lists, tuples, dicts and dataclass-like objects."""
    found: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
    return found


def reached_parameters(outputs: Any) -> set[int]:
    """``id`` of every leaf tensor whose gradient the outputs' graph would accumulate."""
    seen_nodes: set[Any] = set()
    reached: set[int] = set()
    stack = [t.grad_fn for t in output_tensors(outputs) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions)
    return reached
