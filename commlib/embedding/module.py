"""``ShardedEmbeddingBag`` and ``ShardedEmbedding``: torch's embedding modules with the
table sharded over a commlib group and updated row-wise by the owners."""
from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import where
from .table import ShardTable

_MODES = ("sum", "mean")


class _Rows(torch.autograd.Function):
    """The fetched rows as a leaf of the graph: their gradient goes to the table."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, lookup: "_Lookup") -> torch.Tensor:
        ctx.lookup = lookup
        return lookup.rows

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        lookup = ctx.lookup
        if grad.is_sparse:  # torch's sparse embedding backward: one value per use
            grad = _dense_rows(grad, len(lookup.ids))
        lookup.table.accumulate(lookup.ids, grad)
        return None, None


def _dense_rows(grad: torch.Tensor, rows: int) -> torch.Tensor:
    """The per-row sums of a sparse ``(rows, dim)`` gradient (torch's coalesce, so the
    sums match those ``torch.optim`` computes from a ``sparse=True`` embedding)."""
    grad = grad.coalesce()
    out = torch.zeros(rows, grad.shape[1], dtype=grad.dtype)
    out[grad.indices()[0]] = grad.values()
    return out


class _Lookup:
    """One lookup: the sorted unique ids, the positions of the input in them, the rows."""

    __slots__ = ("table", "ids", "inverse", "rows", "_get", "key")

    def __init__(self, table: ShardTable, flat: torch.Tensor) -> None:
        self.table = table
        self.key = flat
        self.ids, self.inverse = torch.unique(flat, sorted=True, return_inverse=True)
        self.rows: torch.Tensor | None = None
        self._get = None

    def resolve(self) -> torch.Tensor:
        if self.rows is None:
            self.rows = self._get()
            self._get = None
        return self.rows


class _ShardedBase(torch.nn.Module):
    """What both modules share: the table, the optimizer hook, state_dict, prefetching."""

    _name = "ShardedEmbedding"

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any = None,
                 optimizer: str = "sgd", lr: float = 0.01, staleness: int = 0,
                 cache: Any = None, dtype: torch.dtype | None = None,
                 _weight: torch.Tensor | None = None, hook_optimizers: bool = True) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        dtype = dtype or torch.get_default_dtype()
        # Not an nn.Parameter nor a buffer: DDP (ours or torch's) and optimizers never see
        # the table; it has its own exchange and owner-side optimizer.
        self._table = ShardTable(num_embeddings, embedding_dim, group, optimizer, lr, dtype,
                                 staleness, self._name, _weight)
        self._anchor = torch.zeros(0, dtype=dtype, requires_grad=True)
        self._prefetched: deque = deque()
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
        need not call it. Collective over the group."""
        self._table.policy.step()

    def flush(self) -> None:
        """Apply every outstanding update (queued batches, cached writes). Collective."""
        self._table.policy.flush()

    def prefetch(self, input: torch.Tensor) -> None:
        """Issue the lookup of a future batch now (its rows arrive in the background);
        the next ``forward`` calls consume prefetched lookups in order and must pass the
        same ``input``. Collective; used by :class:`commlib.embedding.PrefetchLoader`."""
        if self.cache is not None:
            raise ValueError(f"{where(self._name, self._table.rank)}: prefetch is not "
                             f"supported with a cache")
        flat = self._flat(input)
        lookup = _Lookup(self._table, flat)
        self._table.begin_read()
        lookup._get = self._table.fetch(lookup.ids, async_op=True)
        self._prefetched.append(lookup)

    def _prefetch_ready(self, flat: torch.Tensor, rows: torch.Tensor) -> None:
        """A lookup whose rows are already here (from a :class:`LookaheadLoader`)."""
        lookup = _Lookup(self._table, flat)
        lookup.rows = rows
        self._table.issued += 1
        self._prefetched.append(lookup)

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
        if self.cache is not None:
            self.cache.invalidate()

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
        module is unusable after)."""
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

    def _rows(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (in the graph when training) and the input remapped to them."""
        flat = self._flat(input)
        training = torch.is_grad_enabled()
        if training:
            self._table.begin_training()
        if self._prefetched:
            lookup = self._prefetched.popleft()
            if not torch.equal(lookup.key, flat):
                raise ValueError(f"{where(self._name, self._table.rank)}: argument 'input' "
                                 f"differs from the prefetched batch it should be")
            lookup.resolve()
        else:
            lookup = _Lookup(self._table, flat)
            if self.cache is not None:
                lookup.rows = self.cache.read(lookup.ids, training)
            else:
                if training:
                    self._table.begin_read()
                lookup.rows = self._table.fetch(lookup.ids)
        rows = _Rows.apply(self._anchor, lookup) if training else lookup.rows
        return rows, lookup.inverse.reshape(input.shape)


class ShardedEmbeddingBag(_ShardedBase):
    """``torch.nn.EmbeddingBag`` whose table is sharded over a commlib group.

    Row ``i`` of the ``(num_embeddings, embedding_dim)`` table lives on group rank
    ``i % n``. ``forward(input, offsets=None, per_sample_weights=None)`` takes torch's
    arguments (``input`` 2-D ``(B, L)`` bags, or 1-D with ``offsets``; int32/int64 ids) and
    returns ``(B, embedding_dim)`` of the table's dtype. Collective over the group: every
    rank calls it (with its own ids, possibly none) the same number of times.

    Training: the gradient of each looked-up row (summed over its uses on this rank) goes
    to the owner, which averages over the group (as DDP averages dense gradients) and
    applies the row-wise ``optimizer`` (``"sgd"``, ``"adagrad"`` or ``"adam"``: torch's
    ``SGD``, ``Adagrad`` and ``SparseAdam`` on a sparse gradient, learning rate ``lr``,
    torch's defaults otherwise; pass e.g. ``RowAdam(lr, betas, eps)`` for other settings)
    when any ``torch.optim`` optimizer steps, or at the latest before the next lookup
    (:meth:`step`). ``staleness=tau``: up to ``tau`` earlier batches may be read before
    their updates are applied (Persia). ``cache``: an :class:`EmbeddingCache` (HET).
    ``state_dict()`` holds the whole table as ``weight`` (gathered, every rank);
    ``load_state_dict`` keeps this rank's rows. The table is no ``nn.Parameter``:
    ``commlib.DistributedDataParallel`` and optimizers leave it alone.
    """

    _name = "ShardedEmbeddingBag"

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean",
                 group: Any = None, optimizer: str = "sgd", lr: float = 0.01,
                 staleness: int = 0, cache: Any = None, dtype: torch.dtype | None = None,
                 include_last_offset: bool = False, _weight: torch.Tensor | None = None,
                 hook_optimizers: bool = True) -> None:
        if mode not in _MODES:
            from .. import runtime
            raise ValueError(f"{where(self._name, runtime.get_rank())}: argument 'mode' "
                             f"must be one of {_MODES}, got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, group, optimizer, lr, staleness,
                         cache, dtype, _weight, hook_optimizers)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        rows, local = self._rows(input)
        return F.embedding_bag(local, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights,
                               include_last_offset=self.include_last_offset, sparse=True)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, "
                f"shards={self._table.n}")


class ShardedEmbedding(_ShardedBase):
    """``torch.nn.Embedding`` whose table is sharded over a commlib group: ``forward(input)``
    maps int ids of any shape ``S`` to ``(*S, embedding_dim)``. Everything else as
    :class:`ShardedEmbeddingBag`."""

    _name = "ShardedEmbedding"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows, local = self._rows(input)
        return F.embedding(local, rows, sparse=True)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, shards={self._table.n}"


def _register_step_hook(module: _ShardedBase) -> list[Any]:
    """A global optimizer post hook: any ``torch.optim`` step closes the module's batch."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    ref = weakref.ref(module)

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        target = ref()
        if target is not None:
            target.step()

    return [register_optimizer_step_post_hook(post)]
