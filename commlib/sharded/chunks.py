"""Flat chunks of parameters (PatrickStar-style), each sharded evenly across the ranks.

A chunk packs parameters of one dtype, device, ``requires_grad`` and param group, in
registration order, into one flat buffer of at most ``cap`` elements (a larger parameter
gets a chunk of its own), zero-padded to a multiple of the number of shards ``N``. Rank
``r`` keeps elements ``[r*S, (r+1)*S)`` (``S = padded / N``) as the ``nn.Parameter``
:attr:`Chunk.shard`; the optimizer sees only these. :attr:`Chunk.full` is the gathered
chunk (a leaf tensor whose storage is released when the chunk is not in use); the module's
parameters become views into it, so gradients accumulate into ``full.grad`` (one node per
chunk, ``torch.split``), which is reduce-scattered into ``shard.grad``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Slot:
    """One (deduplicated) parameter of the module: where it lives in its chunk and which
    ``(module, attribute)`` pairs refer to it (several when it is tied)."""
    name: str
    param: nn.Parameter
    offset: int
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def shape(self) -> torch.Size:
        return self.param.shape


class Chunk:
    """A flat, padded chunk of parameters and this rank's shard of it."""

    def __init__(self, index: int, slots: list[Slot], shards: int, rank: int,
                 group_index: int, keep_full: bool = False,
                 compute_dtype: torch.dtype | None = None) -> None:
        first = slots[0].param
        self.index = index
        self.slots = slots
        self.group_index = group_index
        self.dtype, self.device = first.dtype, first.device
        self.requires_grad = first.requires_grad
        # mixed precision: the gathered chunk (what the module computes with) in
        # compute_dtype, the shard (the optimizer's master copy) in the parameters' dtype
        self.compute_dtype = compute_dtype if first.is_floating_point() and compute_dtype \
            else self.dtype
        self.cast = self.compute_dtype != self.dtype
        self.keep_full = keep_full and shards > 1 and not self.cast
        self.numel = sum(s.numel for s in slots)
        self.shards = shards
        self.padded = -(-self.numel // shards) * shards
        self.shard_numel = self.padded // shards
        self.rank = rank
        self.modules: list[nn.Module] = []
        with torch.no_grad():
            flat = self.flatten([s.param for s in slots])
            lo = rank * self.shard_numel
            if shards == 1:
                self.shard = nn.Parameter(flat, requires_grad=self.requires_grad)
                # the full chunk is the shard itself (NO_SHARD): same storage, own leaf
                self.full = (flat.to(self.compute_dtype) if self.cast else
                             self.shard.detach()).requires_grad_(self.requires_grad)
            else:
                # kept gathered (SHARD_GRAD_OP): the shard is this rank's slice of the full
                # chunk itself, so the parameters are held once
                mine = flat[lo:lo + self.shard_numel]
                self.shard = nn.Parameter(mine if keep_full else mine.clone(),
                                          requires_grad=self.requires_grad)
                self.full = flat.to(self.compute_dtype).requires_grad_(self.requires_grad)
        self.gathered = True
        self.gathered_version = self.shard._version
        self.views: list[torch.Tensor] = []
        # [bytes of gathered chunks now, their peak]: shared by a wrapper's chunks
        self.tracker = [0, 0]
        # whoever gathers this chunk on demand (:class:`ReleasedView`); set by the wrapper
        self.owner: Any = None
        self.released: list[torch.Tensor] | None = None   # the placeholders
        self.placeholders = False   # whether the owners hold them now

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """New flat padded buffer of ``tensors`` (this chunk's layout)."""
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        offset = 0
        for t in tensors:
            flat[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
        return flat

    # -- storage of the gathered chunk ----------------------------------------------------
    def free(self) -> None:
        """Release the gathered chunk's memory (views stay valid objects)."""
        if self.shards > 1 and self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False
            self.tracker[0] -= self.padded * self.full.element_size()

    def fill(self, flat: torch.Tensor) -> None:
        """(Re)allocate the gathered chunk's memory and copy ``flat`` into it, keeping the
        version counter that autograd checks saved views against. (MPI writes into a
        separate receive buffer: a tensor exported to numpy can no longer be resized.)"""
        storage = self.full.untyped_storage()
        nbytes = self.padded * self.full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
            self.tracker[0] += nbytes
            self.tracker[1] = max(self.tracker[1], self.tracker[0])
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
            self.full.detach().copy_(flat)

    def stale(self) -> bool:
        return not self.gathered or self.gathered_version != self.shard._version

    def mark_gathered(self) -> None:
        self.gathered = True
        self.gathered_version = self.shard._version

    # -- module parameters as views ---------------------------------------------------------
    def set_views(self) -> None:
        """Point every owner attribute at a view of :attr:`full`, made under the current
        grad mode (one ``torch.split`` node, so backward builds one flat gradient)."""
        sizes = [s.numel for s in self.slots]
        if self.padded > self.numel:
            sizes.append(self.padded - self.numel)
        pieces = torch.split(self.full, sizes)
        self.views = []
        for slot, piece in zip(self.slots, pieces):
            view = piece.view(slot.shape)
            self.views.append(view)
            for module, attr in slot.owners:
                setattr(module, attr, view)
        self.placeholders = False

    def set_released_views(self) -> None:
        """Point every owner attribute at a :class:`ReleasedView` (made once, while the
        chunk is gathered: call it before :meth:`free`): a use gathers the chunk through
        :attr:`owner` or raises naming the parameter, instead of reading released memory."""
        if self.released is None:
            flat, offset, self.released = self.full.detach(), 0, []
            for i, slot in enumerate(self.slots):
                view = flat[offset:offset + slot.numel].view(slot.shape)
                offset += slot.numel
                placeholder = torch.Tensor._make_subclass(ReleasedView, view,
                                                          slot.param.requires_grad)
                placeholder._commlib_slot = (self, i)
                self.released.append(placeholder)
        for slot, placeholder in zip(self.slots, self.released):
            for module, attr in slot.owners:
                setattr(module, attr, placeholder)
        self.placeholders = True

    def state_bytes(self) -> dict[str, int]:
        item = self.shard.element_size()
        full = self.full.untyped_storage().nbytes() if self.shards > 1 else 0
        return {"shard": self.shard_numel * item, "full": full}


def scope(module: nn.Module, boundary: Callable[[nn.Module], bool]
          ) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """(``(name, module)`` of every module of ``module``'s tree that is not inside a
    boundary module, in ``named_modules`` order with duplicates; the outermost boundary
    modules found, with their names). ``module`` itself is never a boundary."""
    inside: list[tuple[str, nn.Module]] = []
    found: list[tuple[str, nn.Module]] = []

    def visit(m: nn.Module, name: str) -> None:
        inside.append((name, m))
        for child_name, child in m._modules.items():
            if child is None:
                continue
            full = f"{name}.{child_name}" if name else child_name
            if boundary(child):
                found.append((full, child))
            else:
                visit(child, full)

    visit(module, "")
    return inside, found


def plan(modules: list[tuple[str, nn.Module]], cap_bytes: int, shards: int, rank: int,
         group_of: dict[int, int], keep_full: bool = False,
         compute_dtype: torch.dtype | None = None) -> list[Chunk]:
    """Chunks over the parameters of ``modules`` (``(name, module)`` pairs, see
    :func:`scope`; deduplicated, registration order), keyed by dtype, device,
    ``requires_grad`` and ``group_of[id(param)]`` (default 0)."""
    slots: dict[int, Slot] = {}
    order: list[Slot] = []
    for mname, m in modules:
        for attr, p in m._parameters.items():
            if p is None:
                continue
            if id(p) not in slots:
                slots[id(p)] = Slot(f"{mname}.{attr}" if mname else attr, p, 0)
                order.append(slots[id(p)])
            if (m, attr) not in [(o, a) for o, a in slots[id(p)].owners]:
                slots[id(p)].owners.append((m, attr))
    open_: dict[tuple, list[Slot]] = {}
    done: list[tuple[list[Slot], int]] = []
    for slot in order:
        p = slot.param
        key = (p.dtype, str(p.device), p.requires_grad, group_of.get(id(p), 0))
        cap = max(1, cap_bytes // p.element_size())
        members = open_.setdefault(key, [])
        if members and sum(s.numel for s in members) + p.numel() > cap:
            done.append((members, key[3]))
            members = open_[key] = []
        slot.offset = sum(s.numel for s in members)
        members.append(slot)
    done.extend((members, key[3]) for key, members in open_.items() if members)
    done.sort(key=lambda item: order.index(item[0][0]))
    chunks = [Chunk(i, members, shards, rank, g, keep_full, compute_dtype)
              for i, (members, g) in enumerate(done)]
    for chunk in chunks:
        mods = {id(m): m for s in chunk.slots for m, _ in s.owners}
        chunk.modules = list(mods.values())
    return chunks


_METADATA = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.nelement,
             torch.Tensor.element_size, torch.Tensor.is_floating_point,
             torch.Tensor.is_complex, torch.Tensor.__hash__, torch.Tensor.stride,
             torch.Tensor.dtype.__get__, torch.Tensor.shape.__get__,
             torch.Tensor.device.__get__, torch.Tensor.ndim.__get__,
             torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
             torch.Tensor.is_leaf.__get__, torch.Tensor.grad.__get__}


class ReleasedView(torch.Tensor):
    """What a module attribute holds while its FULL_SHARD chunk is released: metadata
    (shape, dtype, device...) answers at once; any other use asks the chunk's owner
    (``owner.use_released(chunk, slot_index)``), which gathers the chunk or raises naming
    the parameter, and runs on the gathered view."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        def swap(t: Any) -> Any:
            if isinstance(t, ReleasedView):
                chunk, i = t._commlib_slot
                owner = chunk.owner() if chunk.owner is not None else None
                if owner is None:
                    raise RuntimeError(f"commlib.FullyShardedDataParallel: parameter "
                                       f"{chunk.slots[i].name!r} belongs to a wrapper that no "
                                       f"longer exists")
                return owner.use_released(chunk, i)
            return t

        args, kwargs = torch.utils._pytree.tree_map(swap, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def detach_parameters(chunks: list[Chunk]) -> None:
    """Remove the sharded parameters from their modules (they become plain attributes,
    set to views by :meth:`Chunk.set_views`)."""
    for chunk in chunks:
        for slot in chunk.slots:
            for module, attr in slot.owners:
                module._parameters.pop(attr, None)
        chunk.set_views()  # (gathered at construction)


def owned_chunks(chunks: list[Chunk]) -> dict[int, list[Chunk]]:
    """id(module) -> the chunks holding parameters that module registered directly."""
    out: dict[int, list[Chunk]] = {}
    for chunk in chunks:
        for m in chunk.modules:
            out.setdefault(id(m), []).append(chunk)
    return out

