"""Small generated models for tests/test_partition.py (float64): a residual MLP with a long
skip, a ResNet-like CNN (skips, BatchNorm buffers), a model with a buffer read in several
places and frozen parameters, and a GPT-style block stack whose head is tied to its token
embedding."""
import math

import torch
from torch import nn
from torch.nn import functional as F


class ResMLP(nn.Module):
    """Residual blocks plus a skip from the first layer's output to the head."""

    def __init__(self, width=8, depth=4, inputs=5, outputs=3):
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                     for _ in range(depth)])
        self.out = nn.Linear(width, outputs)

    def forward(self, x):
        h = self.inp(x)
        first = h
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h + first)


class ResBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return torch.relu(x + self.conv2(torch.relu(self.bn(self.conv1(x)))))


class ResCNN(nn.Module):
    """ResNet-like: a stem, residual conv blocks with BatchNorm, pooling, a classifier."""

    def __init__(self, ch=3, blocks=2, outputs=3):
        super().__init__()
        self.stem = nn.Conv2d(2, ch, 3, padding=1)
        self.blocks = nn.Sequential(*[ResBlock(ch) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(ch, outputs)

    def forward(self, x):
        x = self.blocks(torch.relu(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class FrozenBuffer(nn.Module):
    """A frozen input layer, a frozen parameter read at both ends (it travels), a buffer
    read at three places (each stage reading it holds it)."""

    def __init__(self, width=8, inputs=5, outputs=3):
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.embed.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width, dtype=torch.float64))
        self.l1 = nn.Linear(width, width)
        self.l2 = nn.Linear(width, width)
        self.l3 = nn.Linear(width, width)
        self.frozen_bias = nn.Parameter(torch.linspace(-1, 1, width), requires_grad=False)
        self.out = nn.Linear(width, outputs)

    def forward(self, x):
        h = torch.tanh(self.embed(x) + self.frozen_bias) * self.scale
        h = torch.tanh(self.l1(h))
        h = torch.tanh(self.l2(h)) * self.scale
        h = self.l3(h) + self.frozen_bias
        return self.out(torch.tanh(h) * self.scale)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, with a causal mask buffer."""

    def __init__(self, c, heads, t):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc1, self.fc2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        hs = C // self.heads
        q = q.view(B, T, self.heads, hs).transpose(1, 2)
        k = k.view(B, T, self.heads, hs).transpose(1, 2)
        v = v.view(B, T, self.heads, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token + learned position embeddings, blocks, final LayerNorm, a head tied (``tie``)
    to the token embedding."""

    def __init__(self, vocab=11, c=8, heads=2, t=6, layers=2, tie=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Parameter(0.1 * torch.randn(t, c))
        self.blocks = nn.ModuleList([Block(c, heads, t) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(c)
        self.head = nn.Linear(c, vocab, bias=False)
        if tie:
            self.head.weight = self.wte.weight

    def forward(self, idx):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe[:T]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def mse(out, target):
    return F.mse_loss(out, target)


def make(name, seed=0):
    """(model, inputs, targets, loss_fn) in float64, the same on every rank for a seed."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    batch = 8
    if name == "resmlp":
        model = ResMLP()
        x = torch.randn(batch, 5, generator=g, dtype=torch.float64)
        y = torch.randn(batch, 3, generator=g, dtype=torch.float64)
        loss = mse
    elif name == "rescnn":
        model = ResCNN()
        x = torch.randn(batch, 2, 5, 5, generator=g, dtype=torch.float64)
        y = torch.randn(batch, 3, generator=g, dtype=torch.float64)
        loss = mse
    elif name == "frozen":
        model = FrozenBuffer()
        x = torch.randn(batch, 5, generator=g, dtype=torch.float64)
        y = torch.randn(batch, 3, generator=g, dtype=torch.float64)
        loss = mse
    elif name == "gpt":
        model = GPT()
        x = torch.randint(0, 11, (batch, 6), generator=g)
        y = torch.randint(0, 11, (batch, 6), generator=g)
        loss = gpt_loss
    else:
        raise KeyError(name)
    return model.double(), x, y, loss
