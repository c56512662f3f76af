"""Horovod's gradient compression: ``Compression.none`` and ``Compression.fp16``
(floating-point tensors travel as float16 and come back in their own dtype)."""
from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface: ``compress(tensor) -> (compressed, ctx)``, ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors as float16 on the wire; other dtypes unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple:
        out = tensor.type(torch.float16) if tensor.dtype.is_floating_point else tensor
        return out, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.type(ctx) if ctx.is_floating_point else tensor


class Compression:
    """Optional gradient compression used by allreduce and DistributedOptimizer."""
    none = NoneCompressor
    fp16 = FP16Compressor
