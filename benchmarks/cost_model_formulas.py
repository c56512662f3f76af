"""The cost model's formulas: alpha-beta tiers, a cluster of them, and the communication
seconds and wire bytes per step of every algorithm (the formulas are documented in
cost_model.py's module doc)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SYNC, PEER, CONTROL = "gradient_allreduce", "torch_ddp_gloo", "control_nocomm"
MODELLED = ("gradient_allreduce", "gradient_allreduce_hier", "bytegrad", "qadam",
            "decentralized", "low_precision_decentralized", "local_sgd",
            "async_model_average", "torch_ddp_gloo", "diloco", "streaming_diloco", "powersgd",
            "sparseloco", "muloco", "demo")
#: the allgather-based algorithms of issue 32: every rank's compressed message goes to
#: every rank (sparseloco and muloco every H steps, demo every step)
GATHERED = ("sparseloco", "muloco", "demo")

#: bytes on the wire per element of the min-max codecs, chunk headers included (2048)
WIRE = {"int4": (0.5 + 8 / 2048) / 4, "int8": (1 + 8 / 2048) / 4, None: 1.0}
#: defaults of the algorithms' arguments the model reads
DEFAULTS = {"local_sgd": {"sync_every": 4}, "diloco": {"sync_every": 8},
            "streaming_diloco": {"sync_every": 8, "num_fragments": 2,
                                 "fragment_sync_delay": 1, "quantize": "int4"},
            "powersgd": {"rank": 4},
            "sparseloco": {"sync_every": 15, "density": 1 / 64, "chunk_size": 4096,
                           "value_bits": 2},
            "muloco": {"sync_every": 30, "compression": "int2", "topk_ratio": 0.02},
            "demo": {"chunk_size": 64, "topk": 32}}


def args_of(name: str, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    return {**DEFAULTS.get(name, {}), **(kwargs or {})}


def message_ratio(name: str, a: dict[str, Any]) -> float:
    """One rank's message of a gathered algorithm (``GATHERED``) per byte of float32
    weights, from its arguments ``a`` (defaults filled in), headers included:

    * sparseloco: per chunk of ``C`` elements, ``k = ceil(density C)`` values with a
      ``bit_length(C - 1)``-bit index and a ``value_bits`` code each, plus 8 bytes of
      scales: ``(8 + k (w + b) / 8) / 4C`` (1/136.5 with the defaults; the tensors'
      partial last chunks are not modelled);
    * muloco: int2 ``1/16`` (its 20-byte header per tensor not modelled), int8 / int4 the
      min-max codecs (``WIRE``), topk ``2 topk_ratio`` (an int32 index and a float32 value
      per kept element);
    * demo: ASSUMES matrices cut into ``s x s`` chunks (``s`` = chunk_size): ``k`` values
      (float32) and indices (the smallest of 1, 2, 4 bytes that holds ``s^2 - 1``) per
      chunk, ``k (4 + w) / 4 s^2`` (vectors, chunked by ``s``, cost more: a run's exact
      figure, ``message_ratio`` of its row, replaces this one).
    """
    if name == "sparseloco":
        c = int(a["chunk_size"])
        k = min(c, max(1, math.ceil(a["density"] * c - 1e-9)))
        w = max(1, (c - 1).bit_length())
        return (8 + k * (w + a["value_bits"]) / 8) / (4 * c)
    if name == "muloco":
        comp = a.get("compression")
        if comp == "int2":
            return 1 / 16
        if comp == "topk":
            return 2 * a["topk_ratio"]
        return WIRE[comp]
    if name == "demo":
        s2 = a["chunk_size"] ** 2
        w = next(b for b in (1, 2, 4) if s2 - 1 < 256 ** b)
        return min(s2, a["topk"]) * (4 + w) / (4 * s2)
    raise KeyError(name)


def gathered_ratio(name: str, a: dict[str, Any], ranks: int,
                   msg_ratio: float | None = None) -> tuple[float, float]:
    """(mean, peak) bus bytes per step of a gathered algorithm relative to a synchronous
    gradient allreduce at ``ranks`` ranks: an allgather hands every rank ``(n - 1) M``
    against the allreduce's ``2 (n - 1) / n S``, so ``n M / 2 S`` per exchange, every
    ``sync_every`` steps (demo: every step; muloco without compression: DiLoCo's
    allreduce)."""
    every = 1 if name == "demo" else a["sync_every"]
    if name == "muloco" and a.get("compression") is None:
        return 1 / every, 1.0
    rho = message_ratio(name, a) if msg_ratio is None else msg_ratio
    peak = ranks * rho / 2
    return peak / every, peak


def bytes_ratio(name: str, kwargs: dict[str, Any] | None = None,
                psgd_ratio: float | None = None, ranks: int | None = None,
                msg_ratio: float | None = None) -> tuple[float, float] | None:
    """(mean bytes per step, bytes at the peak step), relative to one synchronous
    gradient allreduce, after warm-ups; None where the model has no byte term (the
    gathered algorithms' ratio grows with the ranks: None without ``ranks``)."""
    a = args_of(name, kwargs)
    if name in GATHERED:
        return None if ranks is None else gathered_ratio(name, a, ranks, msg_ratio)
    if name in (SYNC, PEER):   # (hierarchical: counted per tier, not modelled in bytes)
        return 1.0, 1.0
    if name == "bytegrad":
        return 0.25, 0.25
    if name == "qadam":
        return 1 / 32, 1 / 32
    if name == "local_sgd":
        return 1 / a["sync_every"], 1.0
    if name == "diloco":
        return 1 / a["sync_every"], 1.0
    if name == "streaming_diloco":
        w = WIRE[a["quantize"]]
        return w / a["sync_every"], w / a["num_fragments"]
    if name == "powersgd" and psgd_ratio is not None:
        return psgd_ratio, psgd_ratio
    if name == "async_model_average" and a.get("sync_every_steps"):
        return 1 / a["sync_every_steps"], 1.0
    return None


@dataclass
class Tier:
    alpha: float   # seconds per message
    beta: float    # seconds per byte

    def cost(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.alpha + nbytes * self.beta


@dataclass
class Cluster:
    nodes: int
    per_node: int
    intra: Tier
    inter: Tier

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


def tier_of(probe: Any, fallback: Tier) -> Tier:
    """A tier from netsim's probe ({"mbit", "rtt_ms"}); ``fallback`` when absent."""
    if not isinstance(probe, dict):
        return fallback
    return Tier(alpha=probe["rtt_ms"] / 2e3, beta=8 / (probe["mbit"] * 1e6))


# -- communication formulas ---------------------------------------------------------------

def allreduce_rhd(c: Cluster, nbytes: float) -> float:
    """Recursive halving / doubling allreduce of ``nbytes`` (see the module doc)."""
    n, r = c.ranks, c.per_node
    if n < 2:
        return 0.0
    steps = math.ceil(math.log2(n))
    total = 0.0
    for k in range(steps):
        chunk = nbytes / 2 ** (k + 1)
        if 2 ** k < r:
            total += 2 * c.intra.cost(chunk)
        else:
            total += 2 * c.inter.cost(min(r, n) * chunk)
    return total


def allreduce_hier(c: Cluster, nbytes: float) -> float:
    r = c.per_node
    local = 0.0
    if r > 1:
        local = 2 * c.intra.cost(2 * (r - 1) / r * nbytes, math.ceil(math.log2(r)))
    leaders = Cluster(c.nodes, 1, c.intra, c.inter)
    return local + allreduce_rhd(leaders, nbytes)


def ring(c: Cluster, nbytes: float) -> float:
    n = c.ranks
    if n < 2:
        return 0.0
    tier = c.inter if c.nodes > 1 else c.intra
    return tier.cost(2 * (n - 1) / n * nbytes, 2 * (n - 1))


def compressed(c: Cluster, nbytes: float) -> float:
    """alltoall + allgather of ``nbytes`` (already compressed)."""
    n, r = c.ranks, c.per_node
    if n < 2:
        return 0.0
    messages = n - 1 + math.ceil(math.log2(n))
    if c.nodes == 1:
        return c.intra.cost(2 * (n - 1) / n * nbytes, messages)
    return (c.inter.cost(2 * r * (n - r) / n * nbytes, messages)
            + c.intra.cost(2 * (r - 1) / n * nbytes))


def allgather(c: Cluster, nbytes: float) -> float:
    """Allgather of ``nbytes`` per rank (recursive doubling: ``log2 N`` latencies): every
    rank receives ``(N - 1)`` messages; across nodes each node link carries its ``R``
    ranks' ``(N - R)`` messages, inside the node ``R - 1``."""
    n, r = c.ranks, c.per_node
    if n < 2:
        return 0.0
    messages = math.ceil(math.log2(n))
    if c.nodes == 1:
        return c.intra.cost((n - 1) * nbytes, messages)
    return c.inter.cost(r * (n - r) * nbytes, messages) + c.intra.cost((r - 1) * nbytes)


def peer_exchange(c: Cluster, nbytes: float) -> float:
    n, r = c.ranks, c.per_node
    if n < 2:
        return 0.0
    off = (n - r) / (n - 1)
    return c.inter.cost(r * off * nbytes) + c.intra.cost((1 - off) * nbytes) \
        if c.nodes > 1 else c.intra.cost(nbytes)


def neighbours(c: Cluster, nbytes: float) -> float:
    if c.ranks < 2:
        return 0.0
    tier = c.inter if c.nodes > 1 else c.intra
    return tier.cost(2 * nbytes, 2)


def streaming_exchange(c: Cluster, nbytes: float, a: dict[str, Any],
                       compress_s_per_byte: float = 0.0) -> float:
    """Seconds of one fragment exchange of streaming_diloco."""
    frag = nbytes / a["num_fragments"]
    if a["quantize"] is None:
        return allreduce_rhd(c, frag)
    return compressed(c, frag * WIRE[a["quantize"]]) + 2 * compress_s_per_byte * frag


def powersgd_steady(c: Cluster, nbytes: float, rho: float,
                    compress_s_per_byte: float = 0.0) -> float:
    return (allreduce_rhd(c, 0.0) + 2 * allreduce_rhd(c, rho * nbytes / 2)
            + compress_s_per_byte * nbytes)


def comm_time(name: str, c: Cluster, nbytes: float, warm_fraction: float = 0.0,
              compress_s_per_byte: float = 0.0, kwargs: dict[str, Any] | None = None,
              psgd_ratio: float | None = None, compute_s: float = 0.0,
              msg_ratio: float | None = None) -> float:
    """Communication seconds per step (mean over steps) of algorithm ``name`` that show
    on the step (streaming_diloco's overlap with ``compute_s`` per step subtracted;
    ``msg_ratio``: a run's exact message ratio of a gathered algorithm)."""
    a = args_of(name, kwargs)
    if name in GATHERED:
        every = 1 if name == "demo" else a["sync_every"]
        if name == "muloco" and a.get("compression") is None:
            return allreduce_rhd(c, nbytes) / every
        rho = message_ratio(name, a) if msg_ratio is None else msg_ratio
        return (allgather(c, rho * nbytes) + compress_s_per_byte * nbytes) / every
    if name == "diloco":
        return allreduce_rhd(c, nbytes) / a["sync_every"]
    if name == "streaming_diloco":
        e = streaming_exchange(c, nbytes, a, compress_s_per_byte)
        hidden = a["fragment_sync_delay"] * compute_s
        return a["num_fragments"] * max(0.0, e - hidden) / a["sync_every"]
    if name == "powersgd":
        rho = 1.0 if psgd_ratio is None else psgd_ratio
        return (warm_fraction * allreduce_rhd(c, nbytes)
                + (1 - warm_fraction) * powersgd_steady(c, nbytes, rho, compress_s_per_byte))
    if name == SYNC:
        return allreduce_rhd(c, nbytes)
    if name == "gradient_allreduce_hier":
        return allreduce_hier(c, nbytes)
    if name == "bytegrad":
        return compressed(c, nbytes / 4) + compress_s_per_byte * nbytes
    if name == "qadam":
        steady = compressed(c, nbytes / 32) + compress_s_per_byte * nbytes
        return warm_fraction * allreduce_rhd(c, nbytes) + (1 - warm_fraction) * steady
    if name in ("bytegrad_hier", "qadam_hier"):   # compress only between node leaders
        leaders = Cluster(c.nodes, 1, c.intra, c.inter)
        local = allreduce_hier(c, nbytes) - allreduce_rhd(leaders, nbytes)
        ratio = 4 if name == "bytegrad_hier" else 32
        steady = local + compressed(leaders, nbytes / ratio) + compress_s_per_byte * nbytes
        if name == "bytegrad_hier":
            return steady
        return warm_fraction * allreduce_hier(c, nbytes) + (1 - warm_fraction) * steady
    if name == "decentralized":
        return peer_exchange(c, nbytes)
    if name == "low_precision_decentralized":
        return neighbours(c, nbytes / 4) + compress_s_per_byte * nbytes
    if name == "local_sgd":
        return allreduce_rhd(c, nbytes) / a["sync_every"]
    if name == "async_model_average":   # beside training; in steps: behind the next one
        # (its warmup_steps: gradient allreduces, as synchronous training)
        steady = 0.0
        if a.get("sync_every_steps"):
            steady = max(0.0, allreduce_rhd(c, nbytes) - compute_s) / a["sync_every_steps"]
        return warm_fraction * allreduce_rhd(c, nbytes) + (1 - warm_fraction) * steady
    if name == PEER:
        return ring(c, nbytes)
    if name == CONTROL:
        return 0.0
    raise KeyError(name)
