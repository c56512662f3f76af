"""The GPT workload: a small byte-level decoder-only transformer trained on the Python
standard library's own source files (text that exists on every machine with Python, no
download).

Corpus (:func:`corpus`): every ``*.py`` file under the running interpreter's standard
library directory (``sysconfig``'s ``stdlib``), ``site-packages``, ``test``/``tests`` and
``idlelib`` excluded, in sorted path order; a file goes to validation when the CRC-32 of
its relative path is ``0 mod 10`` (about 10 %), else to training: the split depends only on
the file names. Files are joined with a NUL byte; ``max_bytes`` cuts each side to its first
bytes. The digest of both sides is recorded with each run (the stdlib differs between
Python versions).

Model (:class:`GPT`): byte embeddings (256) plus learned positions, ``layers`` pre-norm
blocks (causal multi-head self-attention through ``scaled_dot_product_attention``, a
4x GELU MLP), a final LayerNorm, the output head tied to the byte embedding. The default
(``d_model=192, layers=4, heads=4, context=128``) has 1.87 M parameters; :data:`TINY`
(32 wide, 2 layers, context 32) is the tests' size, :data:`MINI` (64 wide) the
time-to-accuracy grid's on 2 cores (docs/benchmarks/time-to-accuracy.md).

Batches (:func:`batch`): ``batch`` random windows of ``context + 1`` bytes of the training
bytes from a ``torch.Generator`` the caller seeds (per rank and step: the same data order
for every contender). Validation (:func:`val_loss`): the mean next-byte cross-entropy
(nats) over ``windows`` fixed, evenly spaced windows of the validation bytes; perplexity is
``exp`` of it.
"""
from __future__ import annotations

import hashlib
import math
import os
import sysconfig
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@dataclass(frozen=True)
class Config:
    d_model: int = 192
    layers: int = 4
    heads: int = 4
    context: int = 128


DEFAULT = Config()
SMALL = Config(d_model=144, layers=4, heads=4, context=64)     # 1.05 M parameters
MINI = Config(d_model=64, layers=2, heads=2, context=32)     # 0.12 M parameters
TINY = Config(d_model=32, layers=2, heads=2, context=32)     # 35 k parameters
#: link-dominated at 1 Gbit/s (issue 32): 6.6 M parameters (26 MB of float32 gradients,
#: about 0.2 s of a 1 Gbit/s link per allreduce) on few tokens per step: on a CPU core a
#: step is link-dominated at 1 Gbit/s only below ~40 tokens per rank (batch 2 x 16)
WIDE = Config(d_model=512, layers=2, heads=8, context=16)
SIZES = {"default": DEFAULT, "small": SMALL, "mini": MINI, "tiny": TINY, "wide": WIDE}


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the corpus's files, sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        out += [os.path.relpath(os.path.join(here, f), root) for f in files if f.endswith(".py")]
    return sorted(out)


def corpus(max_bytes: int | None = None, root: str | None = None) -> dict:
    """``{"train": uint8 tensor, "val": uint8 tensor, "digest": str, "files": (n_train,
    n_val)}``: the deterministic split of the module docstring."""
    root = root or sysconfig.get_paths()["stdlib"]
    sides: dict[str, list[bytes]] = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    for rel in stdlib_files(root):
        side = "val" if zlib.crc32(rel.encode()) % 10 == 0 else "train"
        with open(os.path.join(root, rel), "rb") as fh:
            sides[side].append(fh.read())
        counts[side] += 1
    out: dict = {"files": (counts["train"], counts["val"])}
    digest = hashlib.sha256()
    for side, parts in sides.items():
        data = b"\0".join(parts)
        if max_bytes is not None:
            data = data[:max_bytes]
        digest.update(data)
        out[side] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out["digest"] = digest.hexdigest()[:16]
    return out


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """``forward(idx)``: ``idx`` ``(batch, t)`` int64 bytes, ``t <= context``; returns
    ``(batch, t, 256)`` logits of the next byte."""

    def __init__(self, cfg: Config = DEFAULT) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(256, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.context, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("out.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[:idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.embed.weight.t()


def build(cfg: Config = DEFAULT, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def batch(data: torch.Tensor, size: int, context: int,
          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` random windows: inputs and next-byte targets, ``(size, context)`` int64."""
    starts = torch.randint(0, data.numel() - context - 1, (size,), generator=generator)
    rows = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def val_loss(model: nn.Module, val: torch.Tensor, context: int, windows: int = 64,
             batch_size: int = 32) -> float:
    """Mean next-byte cross-entropy (nats) over ``windows`` evenly spaced windows."""
    step = max(1, (val.numel() - context - 1) // windows)
    starts = list(range(0, step * windows, step))[:windows]
    was = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(starts), batch_size):
            rows = torch.stack([val[s:s + context + 1] for s in starts[i:i + batch_size]]).long()
            total += float(loss(model, rows[:, :-1], rows[:, 1:])) * len(rows)
    model.train(was)
    return total / len(starts)
