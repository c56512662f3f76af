"""``ShardedEmbeddingBag`` and ``ShardedEmbedding``: torch's embedding modules with the
table sharded over a commlib group and updated row-wise by the owners."""
from __future__ import annotations

import numbers
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..base.errors import where
from .lookup import Lookup, Rows
from .table import ShardTable

_MODES = ("sum", "mean", "max")


def _check_padding(name: str, num_embeddings: int, padding_idx: Any, max_norm: Any,
                   norm_type: Any, cache: Any) -> int | None:
    """torch's checks of ``padding_idx`` (negative counts from the end) and the norm
    arguments; ``ValueError``/``TypeError`` naming them (on every rank: from arguments)."""
    from ..core import runtime
    here = where(name, runtime.get_rank())
    if padding_idx is not None:
        if not isinstance(padding_idx, int) or isinstance(padding_idx, bool):
            raise TypeError(f"{here}: argument 'padding_idx' must be an int or None, got "
                            f"{padding_idx!r}")
        if isinstance(num_embeddings, int) and not \
                -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"{here}: argument 'padding_idx'={padding_idx} must be within "
                             f"num_embeddings ([-{num_embeddings}, {num_embeddings}))")
        if isinstance(num_embeddings, int) and padding_idx < 0:
            padding_idx += num_embeddings
    if max_norm is not None:
        if not isinstance(max_norm, numbers.Real) or isinstance(max_norm, bool) \
                or not max_norm > 0:
            raise ValueError(f"{here}: argument 'max_norm' must be a positive float or "
                             f"None, got {max_norm!r}")
        if cache is not None:
            raise ValueError(f"{here}: arguments 'max_norm' and 'cache' can't be combined "
                             f"(the owners renormalise the rows they serve)")
    if not isinstance(norm_type, numbers.Real) or isinstance(norm_type, bool) \
            or not norm_type > 0:
        raise ValueError(f"{here}: argument 'norm_type' must be a positive float, got "
                         f"{norm_type!r}")
    return padding_idx



class _ShardedBase(torch.nn.Module):
    """What both modules share: the table, the optimizer hook, state_dict, prefetching."""

    _name = "ShardedEmbedding"

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any = None,
                 optimizer: str = "sgd", lr: float = 0.01, staleness: int = 0,
                 cache: Any = None, dtype: torch.dtype | None = None,
                 _weight: torch.Tensor | None = None, hook_optimizers: bool = True, *,
                 padding_idx: int | None = None, max_norm: float | None = None,
                 norm_type: float = 2.0) -> None:
        super().__init__()
        padding_idx = _check_padding(self._name, num_embeddings, padding_idx, max_norm,
                                     norm_type, cache)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.max_norm = padding_idx, max_norm
        self.norm_type = float(norm_type)
        dtype = dtype or torch.get_default_dtype()
        # Not an nn.Parameter nor a buffer: DDP (ours or torch's) and optimizers never see
        # the table; it has its own exchange and owner-side optimizer.
        self._table = ShardTable(num_embeddings, embedding_dim, group, optimizer, lr, dtype,
                                 staleness, self._name, _weight, padding_idx,
                                 None if max_norm is None else float(max_norm),
                                 self.norm_type)
        self._anchor = torch.zeros(0, dtype=dtype, requires_grad=True)
        # Lookups a loader prepared: those of the batch being trained (consumed in order
        # by its training lookups) and every prepared one not consumed yet.
        self._scheduled: deque = deque()
        self._outstanding: list[Lookup] = []
        self.cache = None
        if cache is not None:
            if staleness:
                raise ValueError(f"{where(self._name, self._table.rank)}: arguments "
                                 f"'cache' and 'staleness' can't be combined")
            cache.attach(self._table)
            self.cache = cache
        self._hooks = _register_step_hook(self) if hook_optimizers else []

    # -- public surface ----------------------------------------------------------------
    @property
    def local_weight(self) -> torch.Tensor:
        """This rank's shard, shape ``(ceil((num_embeddings - rank) / n), dim)``: row ``j``
        is global row ``rank + j * n`` (the live tensor; treat as read-only)."""
        return self._table.weight

    @property
    def table(self) -> ShardTable:
        return self._table

    @property
    def group(self) -> Any:
        return self._table.group

    def step(self) -> None:
        """Close the current batch: apply its embedding update (``staleness=0``) or queue
        it. Called by every ``torch.optim`` optimizer step (a global post hook), so users
        need not call it; a batch is everything since the last step (several lookups,
        several backward passes: their gradients summed, one update, as torch's
        accumulate-then-step). A step after no backward through the table does nothing.
        Collective over the group."""
        self._table.policy.step()

    def flush(self) -> None:
        """Apply every outstanding update (queued batches, cached writes, a lookahead
        schedule's background part) and drop the lookups a loader prepared and nobody
        used (later lookups fetch the flushed rows). Collective."""
        self._release()
        self._table.policy.flush()

    # -- lookups a loader prepares (PrefetchLoader, LookaheadLoader) -------------------
    def _prefetch(self, inputs: Sequence[torch.Tensor], ahead: int) -> list[Lookup]:
        """Issue the lookups of the batch ``ahead`` batches after the open one now (rows
        arrive in the background), under the staleness bound. Collective."""
        if self.cache is not None:
            raise ValueError(f"{where(self._name, self._table.rank)}: prefetch is not "
                             f"supported with a cache")
        flats = [self._flat(x) for x in inputs]
        batch = self._table.begin_read(ahead)
        out = []
        for flat in flats:
            lookup = Lookup(self._table, flat)
            lookup._get = self._table.fetch(lookup.ids, async_op=True, batch=batch)
            out.append(lookup)
        self._outstanding.extend(out)
        return out

    def _ready(self, flat: torch.Tensor, rows: torch.Tensor) -> Lookup:
        """A prepared lookup whose rows are already here (a lookahead schedule's)."""
        lookup = Lookup(self._table, flat)
        lookup.rows = rows
        self._outstanding.append(lookup)
        return lookup

    def _schedule(self, lookups: Sequence[Lookup]) -> None:
        """The batch being trained starts: its training lookups consume ``lookups`` in
        order (local)."""
        self._scheduled = deque(x for x in lookups if not x.released)

    def _unschedule(self, lookups: Sequence[Lookup]) -> int:
        """The loader moves past (or abandons) the batch of ``lookups``: release those not
        consumed (local). Returns how many were left unused."""
        mine = {id(x) for x in lookups}
        self._scheduled = deque(x for x in self._scheduled if id(x) not in mine)
        waiting = {id(x) for x in self._outstanding}
        unused = [x for x in lookups if id(x) in waiting]
        self._drop(unused)
        return len(unused)

    def _drop(self, lookups: Sequence[Lookup]) -> None:
        gone = {id(x) for x in lookups}
        for x in lookups:
            x.release()
        self._outstanding = [x for x in self._outstanding if id(x) not in gone]

    def _release(self) -> None:
        """Drop every prepared lookup not consumed yet (local)."""
        self._drop(list(self._outstanding))
        self._scheduled = deque()

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self.flush()
        destination[prefix + "weight"] = self._table.full()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list, unexpected_keys: list,
                              error_msgs: list) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        full = state_dict[key]
        want = (self.num_embeddings, self.embedding_dim)
        if tuple(full.shape) != want:
            error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(full.shape)}, the shape in current model is {want}.")
            return
        self.flush()
        self._table.load(full)
        invalidate = getattr(self._table.policy, "invalidate", None)
        if invalidate is not None:  # a cache's copies, a lookahead schedule's held rows
            invalidate()

    def optimizer_state_dict(self) -> dict[str, Any]:
        """What the table's row-wise optimizer needs to continue exactly: its name,
        hyperparameters, the number of batches applied (Adam's step) and each per-row
        state (Adagrad's sums, Adam's moments) as a whole ``(num_embeddings,
        embedding_dim)`` tensor, gathered on every rank like ``state_dict()["weight"]``.
        Outstanding updates are applied first. Collective over the group."""
        self.flush()
        return self._table.optimizer_state()

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`optimizer_state_dict` returned (at any world size): this rank
        keeps its rows of each state tensor. Load the weights with ``load_state_dict`` as
        well. ``ValueError`` naming what does not fit (another optimizer, missing state,
        wrong shape). Collective over the group."""
        self.flush()
        self._table.load_optimizer_state(state_dict)
        if self.cache is not None:
            self.cache.invalidate()

    def close(self) -> None:
        """Remove the optimizer hook and free the table's communicator (collective; the
        module is unusable after). Prepared lookups and a lookahead schedule's background
        exchange are completed first; queued updates are not applied (``flush()`` them)."""
        self._release()
        close = getattr(self._table.policy, "close", None)
        if close is not None:
            close()
        self._unhook()
        if self._table.group.comm is not None:
            self._table.group.free()

    def _unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __del__(self) -> None:
        try:
            self._unhook()  # the hook holds a weak reference only; this just tidies up
        except Exception:
            pass

    # -- lookups -----------------------------------------------------------------------
    def _flat(self, input: torch.Tensor) -> torch.Tensor:
        rank = self._table.rank
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"{where(self._name, rank)}: argument 'input' must be a tensor, "
                            f"got {type(input).__name__}")
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{where(self._name, rank)}: argument 'input' must hold int32 "
                            f"or int64 ids, got {input.dtype}")
        flat = input.reshape(-1).to(torch.int64)
        self._table.check_ids(flat)
        return flat

    def _rows(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """Rows (in the graph when grad is enabled), the input remapped to them and the
        padding row's position among them (None: absent).

        A training lookup (grad enabled, module in training mode) of a batch a loader
        prepared takes the next prepared lookup (the same count on every rank); any other
        lookup (evaluation, ``no_grad``, one more than the loader listed, or none
        prepared) fetches the rows now, after whatever is outstanding was applied."""
        flat = self._flat(input)
        grad = torch.is_grad_enabled()
        t = self._table
        if grad and self.training and self._scheduled:
            lookup = self._scheduled.popleft()
            self._outstanding = [x for x in self._outstanding if x is not lookup]
            if not torch.equal(lookup.key, flat):
                lookup.release()
                raise ValueError(f"{where(self._name, t.rank)}: argument 'input' differs "
                                 f"from the lookup the loader prepared for this call (the "
                                 f"training forward must call the table with what "
                                 f"'inputs' returns, in that order)")
            lookup.resolve()
        else:
            lookup = Lookup(t, flat)
            if self.cache is not None:
                lookup.rows = self.cache.read(lookup.ids)
            else:
                t.policy.before_read(lookup.ids, grad)
                t.begin_read()
                lookup.rows = t.fetch(lookup.ids)
        rows = Rows.apply(self._anchor, lookup, self.padding_idx) if grad else lookup.rows
        return rows, lookup.inverse.reshape(input.shape), lookup.padding(self.padding_idx)

    def _extra(self) -> str:
        s = ""
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}"
        if self.norm_type != 2.0:
            s += f", norm_type={self.norm_type}"
        return s


class ShardedEmbeddingBag(_ShardedBase):
    """``torch.nn.EmbeddingBag`` whose table is sharded over a commlib group.

    Row ``i`` of the ``(num_embeddings, embedding_dim)`` table lives on group rank
    ``i % n``. ``forward(input, offsets=None, per_sample_weights=None)`` takes torch's
    arguments (``input`` 2-D ``(B, L)`` bags, or 1-D with ``offsets``; int32/int64 ids) and
    returns ``(B, embedding_dim)`` of the table's dtype; ``mode`` ``"sum"``, ``"mean"`` or
    ``"max"`` (``per_sample_weights`` with ``"sum"`` only, as torch). Collective over the
    group: every rank calls it (with its own ids, possibly none) the same number of times.

    ``padding_idx`` (torch's meaning; negative counts from the end): entries equal to it
    are left out of every bag's reduction (and of ``"mean"``'s count), its row gets no
    gradient and starts at zero (unless ``_weight`` gives it). ``max_norm``/``norm_type``:
    each looked-up row whose ``norm_type``-norm exceeds ``max_norm`` is renormalised in
    the table first (by its owner, in place, as ``torch.embedding_renorm_``), in every
    lookup, training or not.

    Training: the gradient of each looked-up row (summed over its uses on this rank, over
    every lookup and backward pass since the last step) goes to the owner, which averages
    over the group (as DDP averages dense gradients) and applies the row-wise
    ``optimizer`` (``"sgd"``, ``"adagrad"`` or ``"adam"``: torch's ``SGD``, ``Adagrad`` and
    ``SparseAdam`` on a sparse gradient, learning rate ``lr``, torch's defaults otherwise;
    pass e.g. ``RowAdam(lr, betas, eps)`` for other settings) when any ``torch.optim``
    optimizer steps (or :meth:`step`). Until then every lookup reads the same table:
    gradient accumulation over micro-batches, several lookups of one table per batch and
    evaluation forwards between steps give torch's results. ``staleness=tau``: up to
    ``tau`` earlier batches may be read before their updates are applied (Persia).
    ``cache``: an :class:`EmbeddingCache` (HET). ``state_dict()`` holds the whole table as
    ``weight`` (gathered, every rank); ``load_state_dict`` keeps this rank's rows. The
    table is no ``nn.Parameter``: ``commlib.DistributedDataParallel`` and optimizers leave
    it alone.
    """

    _name = "ShardedEmbeddingBag"

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean",
                 group: Any = None, optimizer: str = "sgd", lr: float = 0.01,
                 staleness: int = 0, cache: Any = None, dtype: torch.dtype | None = None,
                 include_last_offset: bool = False, _weight: torch.Tensor | None = None,
                 hook_optimizers: bool = True, *, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0) -> None:
        if mode not in _MODES:
            from ..core import runtime
            raise ValueError(f"{where(self._name, runtime.get_rank())}: argument 'mode' "
                             f"must be one of {_MODES}, got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, group, optimizer, lr, staleness,
                         cache, dtype, _weight, hook_optimizers, padding_idx=padding_idx,
                         max_norm=max_norm, norm_type=norm_type)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        here = where(self._name, self._table.rank)
        # torch's argument checks, before anything is fetched
        if isinstance(input, torch.Tensor):
            if input.dim() == 2 and offsets is not None:
                raise ValueError(f"{here}: if input is 2D, then offsets has to be None, as "
                                 f"input is treated is a mini-batch of fixed length sequences")
            if input.dim() == 1 and offsets is None:
                raise ValueError(f"{here}: offsets has to be a 1D Tensor but got None")
            if input.dim() not in (1, 2):
                raise ValueError(f"{here}: input has to be 1D or 2D Tensor, but got Tensor "
                                 f"of dimension {input.dim()}")
        if per_sample_weights is not None and self.mode != "sum":
            raise NotImplementedError(
                f"{here}: embedding_bag: per_sample_weights was not None. "
                f"per_sample_weights is only supported for mode='sum' (got "
                f"mode='{self.mode}')")
        rows, local, pad = self._rows(input)
        return F.embedding_bag(local, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights,
                               include_last_offset=self.include_last_offset,
                               sparse=self.mode != "max", padding_idx=pad)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}"
                f"{self._extra()}, shards={self._table.n}")


class ShardedEmbedding(_ShardedBase):
    """``torch.nn.Embedding`` whose table is sharded over a commlib group: ``forward(input)``
    maps int ids of any shape ``S`` to ``(*S, embedding_dim)``; ``padding_idx``: its
    entries get the padding row (zero unless ``_weight`` gives it) and no gradient;
    ``max_norm``/``norm_type`` as torch. Everything else as :class:`ShardedEmbeddingBag`."""

    _name = "ShardedEmbedding"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows, local, pad = self._rows(input)
        return F.embedding(local, rows, padding_idx=pad, sparse=True)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}{self._extra()}, "
                f"shards={self._table.n}")


def _register_step_hook(module: _ShardedBase) -> list[Any]:
    """A global optimizer post hook: any ``torch.optim`` step closes the module's batch."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    ref = weakref.ref(module)

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        target = ref()
        if target is not None:
            target.step()

    return [register_optimizer_step_post_hook(post)]
