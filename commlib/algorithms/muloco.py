"""``muloco``: MuLoCo (Thérien et al., 2025, arXiv 2505.23725, "MuLoCo: Muon is a practical
inner optimizer for DiLoCo"): DiLoCo whose inner optimizer is Muon (AdamW for the
parameters that are not matrices) and whose pseudo-gradients travel compressed, with an
error-feedback accumulator per rank.

.. not run: pseudocode of the algorithm's step

Every rank keeps the global weights ``g`` (the same on every rank) and trains its replica
``x`` with the user's inner optimizer (:func:`muloco_inner_optimizer` builds the paper's:
Muon for 2-D weights, AdamW for the rest) for ``sync_every`` (H) iterations. Then, per
bucket (a flat vector of L elements in the global weights' dtype)::

    delta = g - x                                  # this rank's pseudo-gradient
    e     = error_decay * e + delta                # error feedback (e = delta without it)
    m     = C(e)                                   # compressed message: M bytes
    all   = allgather(m)                           # every rank receives every message
    avg   = (D(all[0]) + D(all[1]) + ... + D(all[n-1])) / n      # in rank order
    e     = e - D(m)                               # what was not sent is kept for later
    g     = OuterSGD(g, grad=avg);  x = g          # Nesterov SGD, as in ``diloco``

``D`` decodes to float32, converted to the global weights' dtype before the sum. Every rank
decodes the same bytes in the same order, so ``avg``, ``g`` and ``x`` are bitwise the same
on every rank; ``e`` is this rank's (``per_rank_state``). A compressed message cannot be
summed by an allreduce, hence the allgather (the paper's code gathers too).

``compression`` (``C``, per bucket; the tensors of a bucket are its parameters in order):

* ``"int2"`` (default; the paper's 2-bit "statistical" quantizer, 4 bins, range 6 sigma):
  per tensor of ``n_t`` elements, in float64, ``s = float32(mean(e_t))``, ``c = e_t - s``,
  ``h = 6 * std(c) / 4`` (unbiased std; 1 when that is 0 or not finite), code ``q =
  clamp(round(c / h + 2), 0, 3)`` (half to even) and a 4-entry table ``T[b] = float32(mean
  of the c with q = b)`` (0 for an empty bin); decoded as ``T[q] + s`` in float32. Message
  per tensor: ``s, T[0..3]`` (5 float32) and the codes, 4 per byte (element ``4i`` in the
  low 2 bits): ``20 + ceil(n_t / 4)`` bytes.
* ``"topk"``: per tensor the ``k_t = max(1, int(topk_ratio * n_t))`` elements of largest
  magnitude (``torch.topk``), as float32 values and int32 positions in the bucket:
  ``8 k_t`` bytes. The others decode to 0.
* ``"int8"``: commlib's min-max uint8 kernels (``commlib.kernels``) over the bucket in
  chunks of 2048: ``kernels.compressed_nbytes(L, 2048, "minmax_uint8")`` = ``32 + 8 *
  ceil(L / 2048) + L`` bytes rounded up to a multiple of 8.
* ``"int4"``: commlib's 4-bit min-max codes (:mod:`commlib.algorithms.int4`), chunks of
  2048: ``int4.nbytes(L, 2048)`` = ``ceil(L / 2048) * (8 + 1024)`` bytes.
* ``None``: no compression: the average is DiLoCo's allreduce (``error_feedback`` then has
  nothing to keep).

**Bytes per outer step** (commlib's counters, per rank): ``bytes`` = ``sum over buckets of
M_b`` (one allgather per bucket) and ``bus_bytes`` = ``(n - 1) * sum M_b``. DiLoCo's is
one float32 allreduce per bucket: ``2 (n - 1) / n * 4 L_b`` bus bytes, so for a float32
model of P parameters in large tensors the ratio to DiLoCo is about ``n M / (8 P)``:
``n / 32`` with ``"int2"`` (1/8 at 4 ranks, the paper's "8x less" was against 16-bit
DiLoCo at 8 workers), ``n / 16`` with ``"int4"``, ``n / 8`` with ``"int8"``,
``n * topk_ratio`` with ``"topk"``. An allgather grows with the group: beyond 32 ranks
``"int2"`` moves more than DiLoCo's allreduce.

**The paper's choices** (v1 and the authors' code, github.com/facebookresearch/MuLoCo):
error feedback before the exchange, the accumulator decayed (``error_decay`` 0.9 in their
runs), 2-bit statistical quantization (4 bins, 6 sigma) as the recommended compression
("MuLoCo ... communicating 8x less"), top-k studied as well; the gathered messages are
decoded and averaged. Their accumulator adds ``outer_lr * delta`` and the outer SGD then
steps with ``outer_lr`` again; every compressor here is scale-equivariant, so that is this
algorithm with ``outer_lr`` squared. Outer optimizer: Nesterov SGD, the authors' released
defaults lr 0.7, momentum 0.6 (``muloco-1``), H = 30.

State (:meth:`state_dict`): DiLoCo's (global weights and outer momentum, the same on every
rank) and this rank's accumulators; resumed exactly. A non-finite accumulator is sent as
NaN (``"int2"``/``"topk"``: the whole tensor; ``"int8"``/``"int4"``: its chunks), so the
average is NaN on every rank and every rank raises
:class:`~commlib.base.errors.NonFiniteError` as in ``diloco``; nothing (weights, momentum,
accumulators) is changed then.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..primitives import allgather
from . import int4, state
from .base import Context
from .buckets import Bucket
from .diloco import DiLoCo
from .registry import register

COMPRESSIONS = (None, "int2", "int4", "int8", "topk")
CHUNK = 2048          # elements per min-max chunk ("int8", "int4")
INT2_BINS = 4         # the paper's 2-bit statistical quantizer
INT2_RANGE = 6.0      # its range in standard deviations
INT2_HEADER = 4 * (1 + INT2_BINS)   # shift and table, float32


# -- codecs (flat float vectors <-> uint8 messages) ---------------------------------------
def _int2_encode(x: torch.Tensor) -> torch.Tensor:
    """One tensor's message: 20 header bytes (shift, table) and ``ceil(n/4)`` code bytes."""
    x = x.detach().double()
    n = x.numel()
    if not bool(torch.isfinite(x).all()):
        header = torch.full((1 + INT2_BINS,), float("nan"), dtype=torch.float32)
        codes = torch.zeros(n, dtype=torch.long)
    else:
        shift = x.mean().float()
        c = x - shift.double()
        std = c.std() if n > 1 else torch.zeros((), dtype=torch.float64)
        step = INT2_RANGE * std / INT2_BINS
        if not (bool(step > 0) and bool(torch.isfinite(step))):
            step = torch.ones((), dtype=torch.float64)
        codes = torch.clamp(torch.round(c / step + INT2_BINS // 2), 0, INT2_BINS - 1).long()
        sums = torch.zeros(INT2_BINS, dtype=torch.float64).index_add_(0, codes, c)
        counts = torch.bincount(codes, minlength=INT2_BINS)
        table = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
        header = torch.cat([shift.reshape(1), table.float()])
    pad = (-n) % 4
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    q = codes.view(-1, 4).to(torch.uint8)
    packed = q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)
    return torch.cat([header.view(torch.uint8), packed])


def _int2_nbytes(n: int) -> int:
    return INT2_HEADER + (n + 3) // 4


def _int2_decode(buf: torch.Tensor, n: int) -> torch.Tensor:
    """float32 values of one tensor's message."""
    header = buf[:INT2_HEADER].clone().view(torch.float32)
    packed = buf[INT2_HEADER:INT2_HEADER + (n + 3) // 4]
    codes = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1)[:n]
    return header[1:][codes.long()] + header[0]


def _topk_count(n: int, ratio: float) -> int:
    return max(1, int(ratio * n))


@register("muloco")
class MuLoCo(DiLoCo):
    """``sync_every`` (H), ``compression`` (``"int2"``, ``"topk"``, ``"int8"``, ``"int4"``
    or ``None``), ``topk_ratio`` (the fraction of each tensor sent by ``"topk"``),
    ``error_feedback`` and ``error_decay`` (the accumulator's decay, in (0, 1]); the outer
    SGD as in ``diloco`` with the paper's defaults. The inner optimizer is whatever the user
    steps (:func:`muloco_inner_optimizer` for the paper's)."""

    per_rank_state = True

    def __init__(self, sync_every: int = 30, compression: str | None = "int2",
                 topk_ratio: float = 0.02, error_feedback: bool = True,
                 error_decay: float = 0.9, outer_lr: float = 0.7,
                 outer_momentum: float = 0.6, outer_nesterov: bool = True) -> None:
        super().__init__(sync_every, outer_lr, outer_momentum, outer_nesterov)
        name = type(self).name
        if compression not in COMPRESSIONS:
            raise ValueError(f"{name}: compression must be one of {COMPRESSIONS}, got "
                             f"{compression!r}")
        if isinstance(topk_ratio, bool) or not isinstance(topk_ratio, (int, float)) or \
                not 0 < topk_ratio <= 1:
            raise ValueError(f"{name}: topk_ratio must be a number in (0, 1], got "
                             f"{topk_ratio!r}")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"{name}: error_feedback must be True or False, got "
                             f"{error_feedback!r}")
        if isinstance(error_decay, bool) or not isinstance(error_decay, (int, float)) or \
                not 0 < error_decay <= 1:
            raise ValueError(f"{name}: error_decay must be a number in (0, 1], got "
                             f"{error_decay!r}")
        self.compression = compression
        self.topk_ratio = float(topk_ratio)
        self.error_feedback = error_feedback
        self.error_decay = float(error_decay)
        self._residual: dict[int, torch.Tensor] = {}

    # -- the message of a bucket ----------------------------------------------------------
    def message_nbytes(self, bucket: Bucket) -> int:
        """Bytes of one rank's message for ``bucket`` (0 without compression)."""
        length = bucket.flat.numel()
        if self.compression == "int2":
            return sum(_int2_nbytes(n) for n in bucket.numels)
        if self.compression == "topk":
            return 8 * sum(_topk_count(n, self.topk_ratio) for n in bucket.numels)
        if self.compression == "int8":
            from .. import kernels
            return kernels.compressed_nbytes(length, CHUNK, kernels.MINMAX_UINT8)
        if self.compression == "int4":
            return int4.nbytes(length, CHUNK)
        return 0

    def encode(self, bucket: Bucket, e: torch.Tensor) -> torch.Tensor:
        """``C(e)``: the uint8 message (1-D, :meth:`message_nbytes` long, on the CPU or
        ``e``'s device) of the flat accumulator ``e`` of ``bucket``; ``e`` is only read."""
        if self.compression == "int2":
            return torch.cat([_int2_encode(e[o:o + n])
                              for o, n in zip(bucket.offsets, bucket.numels)]).to(e.device)
        if self.compression == "topk":
            values, positions = [], []
            for o, n in zip(bucket.offsets, bucket.numels):
                part = e[o:o + n].detach()
                idx = torch.topk(part.abs(), _topk_count(n, self.topk_ratio),
                                 sorted=False).indices.sort().values
                v = part[idx].float()
                if not bool(torch.isfinite(part).all()):
                    v = torch.full_like(v, float("nan"))
                values.append(v)
                positions.append((idx + o).to(torch.int32))
            return torch.cat([torch.cat(values).view(torch.uint8),
                              torch.cat(positions).view(torch.uint8)])
        if self.compression == "int8":
            from .. import kernels
            return kernels.quantize_minmax_uint8(e.detach().float().contiguous(), CHUNK,
                                                 nonfinite="nan")
        return int4.compress(e.detach().float().reshape(1, -1), CHUNK)[0]

    def decode(self, bucket: Bucket, message: torch.Tensor) -> torch.Tensor:
        """``D(message)``: the bucket's flat float32 values encoded in ``message``."""
        length = bucket.flat.numel()
        if self.compression == "int2":
            parts, at = [], 0
            for n in bucket.numels:
                parts.append(_int2_decode(message[at:at + _int2_nbytes(n)], n))
                at += _int2_nbytes(n)
            return torch.cat(parts)
        if self.compression == "topk":
            k = message.numel() // 8
            values = message[:4 * k].clone().view(torch.float32)
            positions = message[4 * k:].clone().view(torch.int32).long()
            out = torch.zeros(length, dtype=torch.float32, device=message.device)
            out[positions] = values
            return out
        if self.compression == "int8":
            from .. import kernels
            return kernels.dequantize_minmax_uint8(message.contiguous())
        return int4.decompress(message.reshape(1, -1), length, CHUNK)[0]

    # -- the outer step -------------------------------------------------------------------
    def _sync(self, ctx: Context) -> None:
        if self.compression is None:
            return super()._sync(ctx)
        buckets = ctx.buckets
        n = ctx.world_size
        accumulators = []
        for b, delta in zip(buckets, self.pseudo_gradients(buckets)):
            prev = self._residual.get(b.index) if self.error_feedback else None
            accumulators.append(delta if prev is None else
                                prev.mul(self.error_decay).add_(delta))
        works = [allgather(self.encode(b, e), group=ctx.group, async_op=True)
                 for b, e in zip(buckets, accumulators)]
        averaged, residuals = [], []
        for b, e, work in zip(buckets, accumulators, works):
            gathered = work.wait()
            decoded = [self.decode(b, gathered[r]).to(e.dtype) for r in range(n)]
            total = decoded[0].clone()
            for d in decoded[1:]:
                total += d
            averaged.append(total.div_(n))
            residuals.append(e - decoded[ctx.rank] if self.error_feedback else None)
        self.check_finite(ctx, buckets, averaged)
        for b, r in zip(buckets, residuals):
            if r is not None:
                self._residual[b.index] = r
        self.outer_step(buckets, averaged)
        for bucket in buckets:
            self.write_weights(bucket, self._global[bucket.index])

    # -- saving and resuming --------------------------------------------------------------
    def save_state(self, ctx: Context) -> dict[str, Any]:
        """DiLoCo's and this rank's error-feedback accumulators (``None`` per bucket before
        its first outer step, or without error feedback)."""
        out = super().save_state(ctx)
        out["residual"] = [self._residual.get(b.index) for b in ctx.buckets]
        return out

    def reset_own_state(self) -> None:
        """A newcomer starts without error-feedback accumulators (as before its first
        outer step)."""
        self._residual = {}

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        self.check_state(ctx, saved, where, ("residual",))
        if len(saved["residual"]) != len(ctx.buckets):
            raise ValueError(f"{where}: the saved state has {len(saved['residual'])} "
                             f"accumulators, this run has {len(ctx.buckets)} buckets")
        for b, r in zip(ctx.buckets, saved["residual"]):
            if r is not None:
                state.check_tensor(where, f"the error-feedback accumulator of bucket "
                                   f"{b.index}", r, self._global[b.index])
        self.restore(saved)
        self._residual = {b.index: state.restore(r, self._global[b.index].device)
                          for b, r in zip(ctx.buckets, saved["residual"]) if r is not None}



# -- the paper's inner optimizer ----------------------------------------------------------
class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` for some parameters (2-D) and ``torch.optim.AdamW`` for the
    others, stepped, zeroed, saved and loaded as one optimizer. ``param_groups`` is the
    Muon groups followed by the AdamW groups (the same dicts the two optimizers step, so a
    learning-rate scheduler acts on both). ``state_dict()`` is ``{"muon": ...,
    "adamw": ...}`` (either ``None`` when it has no parameters)."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict],
                 muon_kwargs: Mapping[str, Any], adamw_kwargs: Mapping[str, Any]) -> None:
        if not muon_groups and not adamw_groups:
            raise ValueError("MuonWithAdamW: no parameters to optimize")
        self.muon = torch.optim.Muon(muon_groups, **muon_kwargs) if muon_groups else None
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw_kwargs) if adamw_groups \
            else None
        parts = [o for o in (self.muon, self.adamw) if o is not None]
        super().__init__([p for o in parts for g in o.param_groups for p in g["params"]], {})
        self.param_groups = [g for o in parts for g in o.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in (self.muon, self.adamw):
            if o is not None:
                o.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"muon": None if self.muon is None else self.muon.state_dict(),
                "adamw": None if self.adamw is None else self.adamw.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"muon", "adamw"}:
            raise ValueError("MuonWithAdamW.load_state_dict: expected a dict with keys "
                             "'muon' and 'adamw' (what state_dict() returns)")
        for key, o in (("muon", self.muon), ("adamw", self.adamw)):
            if (o is None) != (state_dict[key] is None):
                raise ValueError(f"MuonWithAdamW.load_state_dict: the saved state has "
                                 f"{'no' if state_dict[key] is None else 'a'} {key} part, "
                                 f"this optimizer has {'none' if o is None else 'one'}")
        for key, o in (("muon", self.muon), ("adamw", self.adamw)):
            if o is not None:
                o.load_state_dict(state_dict[key])


def muloco_inner_optimizer(module: torch.nn.Module, lr: float = 0.02,
                           adamw_lr: float | None = None, momentum: float = 0.95,
                           nesterov: bool = False, weight_decay: float = 0.01,
                           betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                           adamw_params: Iterable[str] = ()) -> MuonWithAdamW:
    """MuLoCo's inner optimizer for ``module``: Muon for its 2-D weights, AdamW for the
    rest, with the paper's (released ``muloco-1``) defaults.

    * Muon (``torch.optim.Muon``: momentum ``momentum``, Nesterov ``nesterov``, 5
      Newton-Schulz steps, decoupled weight decay ``lr * weight_decay``) for every
      trainable 2-D parameter except those of ``torch.nn.Embedding`` modules and those
      named in ``adamw_params`` (e.g. the output head, as the paper does for LLMs). Each
      matrix of shape ``(fan_out, fan_in)`` steps with ``lr * sqrt(fan_out / fan_in)``
      (the paper's "spectral_norm" scaling; torch's ``adjust_lr_fn="original"`` gives
      ``sqrt(max(1, fan_out / fan_in))``, so each matrix gets its own group whose ``lr``
      and ``weight_decay`` are set so that the product is the paper's).
    * AdamW (``adamw_lr``, default ``lr`` as in the paper's code; ``betas``, ``eps``,
      ``weight_decay``) for everything else: biases, norms, embeddings, tensors of other
      ranks (torch's Muon takes 2-D parameters only).

    Parameters that do not require grad are left out. Muon orthogonalizes in bfloat16 whatever
    the parameter dtype (torch's implementation), so float64 models step with bfloat16-rounded
    directions. Rank-local: nothing communicates. Raises ``ValueError`` naming a bad
    argument or an entry of ``adamw_params`` that is not a parameter name of ``module``.
    """
    where = "muloco_inner_optimizer"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{where}: module must be a torch.nn.Module, got "
                        f"{type(module).__name__}")
    adamw_lr = lr if adamw_lr is None else adamw_lr
    for label, value in (("lr", lr), ("adamw_lr", adamw_lr)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{where}: {label} must be a number > 0, got {value!r}")
    if not 0 <= momentum < 1:
        raise ValueError(f"{where}: momentum must be in [0, 1), got {momentum!r}")
    if not weight_decay >= 0:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {weight_decay!r}")
    if len(tuple(betas)) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    if not eps > 0:
        raise ValueError(f"{where}: eps must be > 0, got {eps!r}")
    named = dict(module.named_parameters())
    forced = set(adamw_params) if not isinstance(adamw_params, str) else {adamw_params}
    unknown = sorted(forced - set(named))
    if unknown:
        raise ValueError(f"{where}: adamw_params names {unknown}, which are not parameters "
                         f"of the module")
    embedded = {id(p) for m in module.modules() if isinstance(m, torch.nn.Embedding)
                for p in m.parameters(recurse=False)}
    muon_groups, others = [], []
    for name, p in named.items():
        if not p.requires_grad:
            continue
        if p.ndim == 2 and name not in forced and id(p) not in embedded:
            fan_out, fan_in = p.shape
            # torch's "original" adjustment times this factor = sqrt(fan_out / fan_in)
            factor = math.sqrt(fan_out / fan_in) / math.sqrt(max(1.0, fan_out / fan_in))
            muon_groups.append({"params": [p], "lr": lr * factor,
                                "weight_decay": weight_decay / factor})
        else:
            others.append(p)
    adamw_groups = [{"params": others}] if others else []
    return MuonWithAdamW(
        muon_groups, adamw_groups,
        dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
             adjust_lr_fn="original"),
        dict(lr=adamw_lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))


__all__ = ["MuLoCo", "MuonWithAdamW", "muloco_inner_optimizer", "COMPRESSIONS"]
