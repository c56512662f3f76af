"""``commlib.nn.SyncBatchNorm``: batch normalization with statistics over a group of ranks.

A drop-in for ``torch.nn.SyncBatchNorm`` that runs on CPU and CUDA tensors alike (torch's
needs CUDA and a ``torch.distributed`` group). In training mode each forward makes ONE
fused allreduce (SUM) of ``[sum over the batch, sum of squares, element count]`` per
channel (``2C + 1`` values) and each backward ONE allreduce of ``[sum of grad_output, sum of
grad_output * x_hat]`` (``2C`` values). The exchanged sums are float64 whatever the input
dtype (exact counts, less cancellation): ``8 (2C + 1)`` bytes forward and ``16 C`` backward
per layer and step. Elementwise work runs in float32 for half-precision inputs. Mean and
biased variance come from the group's totals, so every rank normalizes with the statistics
of the concatenated global batch, whatever each rank's batch size (an empty batch included); the running statistics (unbiased variance with the global count,
as torch) are therefore the same on every rank. ``weight``/``bias`` gradients are this
rank's contribution (as torch's SyncBatchNorm): DDP's gradient averaging combines them.

Every rank of the group must run each training forward, and each backward through the
layer, in the same order (the collectives are matched by order). The variance is
``E[x^2] - E[x]^2`` over the group (one pass, so one allreduce): inputs whose mean is
many orders of magnitude larger than their spread lose precision.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..base.errors import where
from ..base.reduce_ops import ReduceOp
from ..core import runtime
from ..primitives import Group, allreduce


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_group(process_group: Any, op: str) -> Any:
    if process_group is None or isinstance(process_group, Group):
        return process_group
    try:
        import torch.distributed as dist
        is_torch_pg = isinstance(process_group, dist.ProcessGroup)
    except (ImportError, AttributeError):
        is_torch_pg = False
    if is_torch_pg:
        from ..ddp.arguments import resolve_group
        return resolve_group(process_group, None)
    raise TypeError(f"{where(op, runtime.get_rank())}: argument 'process_group' must be None "
                    f"(the world), a commlib.Group or a torch.distributed.ProcessGroup, got "
                    f"{type(process_group).__name__}")


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalization of ``x`` (N, C, *) with group-wide batch statistics."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float, group: Any,
                result: dict[str, Any]) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        sdt = _stats_dtype(x.dtype)
        xs = x.to(sdt)
        stats = torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
        if x.numel():
            stats[:channels] = xs.sum(dims, dtype=torch.float64)
            stats[channels:2 * channels] = (xs * xs).sum(dims, dtype=torch.float64)
        stats[-1] = x.numel() // channels if channels else 0
        allreduce(stats, ReduceOp.SUM, group)
        count = int(stats[-1].item())
        if count <= 1:
            rank = runtime.get_rank()
            raise ValueError(f"{where('SyncBatchNorm', rank)}: expected more than 1 value per "
                             f"channel over the whole group when training, got input size "
                             f"{list(x.shape)} on this rank and {count} in all")
        mean = stats[:channels] / count
        var = (stats[channels:2 * channels] / count - mean * mean).clamp_(min=0)
        invstd = torch.rsqrt(var + eps).to(sdt)
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = (xs - mean.to(sdt).view(shape)) * invstd.view(shape)
        out = xhat
        if weight is not None:
            out = out * weight.to(sdt).view(shape)
        if bias is not None:
            out = out + bias.to(sdt).view(shape)
        result.update(mean=mean, var=var, count=count)
        ctx.group, ctx.count, ctx.shape, ctx.dims = group, count, shape, dims
        ctx.weight_dtype = None if weight is None else weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(xhat, invstd, weight)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        channels, shape, dims = invstd.numel(), ctx.shape, ctx.dims
        g = grad_out.to(xhat.dtype)
        local = torch.zeros(2 * channels, dtype=torch.float64, device=xhat.device)
        if g.numel():
            local[:channels] = g.sum(dims, dtype=torch.float64)
            local[channels:] = (g * xhat).sum(dims, dtype=torch.float64)
        # weight and bias gradients: this rank's part (DDP's averaging combines them)
        grad_bias = (None if ctx.bias_dtype is None
                     else local[:channels].to(ctx.bias_dtype, copy=True))
        grad_weight = (None if ctx.weight_dtype is None
                       else local[channels:].to(ctx.weight_dtype, copy=True))
        total = allreduce(local, ReduceOp.SUM, ctx.group)
        mean_dy = (total[:channels] / ctx.count).to(g.dtype).view(shape)
        mean_dy_xhat = (total[channels:] / ctx.count).to(g.dtype).view(shape)
        scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
        grad_x = (g - mean_dy - xhat * mean_dy_xhat) * scale.view(shape)
        return grad_x.to(grad_out.dtype), grad_weight, grad_bias, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the N and spatial dimensions of an ``(N, C, *)`` input, with
    training statistics computed over every rank of ``process_group``.

    Same constructor, parameters, buffers and ``state_dict`` as ``torch.nn.SyncBatchNorm``;
    ``process_group`` is ``None`` (the world), a :class:`commlib.Group` or a torch
    ``ProcessGroup`` (its ranks). Input: any dtype torch's batch norm takes, at least 2-D,
    on any device; the output has the input's shape, dtype and device. In training mode
    the forward and the backward are collective over the group (one allreduce each, see
    the module docstring), every rank ends with the same running statistics, and a rank
    may bring an empty batch (N = 0) as long as the group holds more than one value per
    channel (``ValueError`` on every rank otherwise). In eval mode (with running
    statistics) the layer is local: no communication.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, device: Any = None, dtype: Any = None, *,
                 bias: bool = True) -> None:
        # ``bias=False`` (an affine weight without bias) exists from torch 2.13 on.
        extra = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, **extra)
        self.process_group = _check_group(process_group, "SyncBatchNorm")

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` ``(N, C, *)``; see the class docstring for what is collective."""
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"{where('SyncBatchNorm', runtime.get_rank())}: argument "
                             f"'input' must have {self.num_features} channels (dim 1), got "
                             f"shape {list(input.shape)}")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not (batch_stats and self.training):
            # eval mode (or eval without running statistics): local, as torch.
            running = not batch_stats or self.track_running_stats
            return F.batch_norm(input, self.running_mean if running else None,
                                self.running_var if running else None, self.weight,
                                self.bias, batch_stats, factor, self.eps)
        result: dict[str, Any] = {}
        out = _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.eps,
                                           self.process_group, result)
        if self.running_mean is not None and self.running_var is not None:
            count = result["count"]
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(
                    result["mean"].to(self.running_mean.dtype), alpha=factor)
                unbiased = result["var"] * (count / (count - 1))
                self.running_var.mul_(1 - factor).add_(
                    unbiased.to(self.running_var.dtype), alpha=factor)
        return out

    def __deepcopy__(self, memo: dict) -> SyncBatchNorm:
        # A copy (an EMA model, say) shares the group: communicators are not copied.
        import copy
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_group: Any = None) -> torch.nn.Module:
        """Replace every batch-norm layer of ``module`` (``torch.nn.BatchNorm1d/2d/3d``,
        ``torch.nn.SyncBatchNorm``) by a :class:`SyncBatchNorm` over ``process_group``
        sharing its parameters and buffers (as torch's classmethod); returns the module
        (a new one when ``module`` itself is a batch-norm layer)."""
        group = _check_group(process_group, "SyncBatchNorm.convert_sync_batchnorm")
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, group,
                      bias=not module.affine or module.bias is not None)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, group))
        return out


__all__ = ["SyncBatchNorm"]
