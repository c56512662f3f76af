"""A userspace delay line on a TUN device: every packet the kernel routes into the device
comes back out of it ``delay_ms`` later, in arrival order (optionally with Bernoulli loss).

Why it exists: :mod:`netsim`'s two-tier cluster adds delay with the ``netem`` qdisc, and
kernels built without it (``CONFIG_NET_SCH_NETEM`` unset; on our benchmark VM only pfifo,
tbf and htb exist, and ingress/ifb/bpf are missing too) have no in-kernel way to hold a
packet. A TUN device hands each routed packet to a process (``read``) and takes packets
from it (``write``, delivered as if received on the device), so a process that holds
each packet for ``delay_ms`` before writing it back is a delay line. How :mod:`netsim`
routes the traffic between its emulated nodes through it is in that module's docstring.

What holds:

- **Delay.** A packet read at time ``t`` (``time.monotonic``) is written back at the first
  wake-up at or after ``t + delay``; the constant delay makes the queue a FIFO (a deque),
  so packets leave in the order they came. The added delay is ``delay`` plus the
  forwarder's wake-up latency (``select`` with a microsecond timeout; tens of
  microseconds on an idle core, up to a scheduler slice when every core is busy).
- **Offloads.** With ``offload`` (the default) the device is opened with
  ``IFF_VNET_HDR`` and ``TUNSETOFFLOAD`` (checksum, TSO4, TSO6): the kernel hands over TCP
  super-packets of up to 64 KiB as it does between veths, and the forwarder passes each
  virtio-net header through untouched, so one ``read``/``write`` moves up to ~45 MTU
  segments (measured 1.5 KB per read at 10 Mbit/s, 39 KB at 1 Gbit/s). This is what lets
  Python keep up with 1 Gbit/s links (see :mod:`netsim`'s measurements).
- **Loss** (``loss_pct``): each packet is dropped with that probability, independently.
  With loss the device is opened without offloads, so a "packet" is one MTU-sized IP
  packet, as on a wire (dropping a 64 KiB super-packet would drop ~45 segments at once).
  Per-packet work then grows ~45x: loss is for low rates.
- **Lifetime.** The process exits when its standard input reaches end of file (the
  parent, :class:`netsim.Cluster`, holds the pipe's other end: if the parent dies for any
  reason the forwarder follows), on SIGTERM/SIGINT, or when the device fails. A TUN device
  that is not persistent disappears with its last file descriptor, so the device goes
  with the process; :mod:`netsim` routes around nothing when it is gone (a blackhole route
  below the device's route drops the traffic instead of letting it skip the delay).

Protocol with the parent: after the device exists the forwarder prints one line
``ready <device>`` on standard output; errors go to standard error with exit status 1.

Run: ``python delayline.py --dev dl0 --delay-ms 25 [--loss-pct 1]`` (root, in the network
namespace where the device should be; :mod:`netsim` starts it with ``ip netns exec``).
"""
from __future__ import annotations

import argparse
import collections
import fcntl
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
# virtio-net header (10 bytes) + a 64 KiB GSO packet, with room to spare: a read into a
# smaller buffer would truncate the packet
READ_SIZE = 1 << 17
BATCH = 64  # packets read per wake-up before releasing due ones again


def open_tun(name: str, offload: bool) -> int:
    """Create TUN device ``name`` (raw IP, no packet-info header) in this process's
    network namespace; return its non-blocking file descriptor."""
    if len(name.encode()) > 15:
        raise ValueError(f"delayline: device name must be at most 15 bytes, got {name!r}")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        flags = IFF_TUN | IFF_NO_PI | (IFF_VNET_HDR if offload else 0)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), flags))
        if offload:
            fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    except OSError:
        os.close(fd)
        raise
    return fd


def forward(fd: int, delay_s: float, loss: float = 0.0, lifeline: int | None = None,
            seed: int | None = None) -> dict[str, int]:
    """Hold every packet read from ``fd`` for ``delay_s`` seconds, then write it back to
    ``fd``; drop each with probability ``loss``. Returns counters when ``lifeline`` (a file
    descriptor) reaches end of file. Runs until then (or until an exception)."""
    queue: collections.deque = collections.deque()
    read, write, now = os.read, os.write, time.monotonic
    rnd = random.Random(seed).random
    stats = {"packets": 0, "bytes": 0, "dropped": 0, "write_errors": 0}
    watch = [fd] if lifeline is None else [fd, lifeline]
    while True:
        timeout = max(0.0, queue[0][0] - now()) if queue else 1.0
        ready = select.select(watch, [], [], timeout)[0]
        if lifeline is not None and lifeline in ready and not os.read(lifeline, 4096):
            return stats
        if fd in ready:
            due = now() + delay_s
            for _ in range(BATCH):
                try:
                    packet = read(fd, READ_SIZE)
                except BlockingIOError:
                    break
                stats["packets"] += 1
                stats["bytes"] += len(packet)
                if loss and rnd() < loss:
                    stats["dropped"] += 1
                    continue
                queue.append((due, packet))
        t = now()
        while queue and queue[0][0] <= t:
            try:
                write(fd, queue.popleft()[1])
            except OSError:  # e.g. the device went down: count, keep serving
                stats["write_errors"] += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="TUN delay line (see the module docstring).")
    p.add_argument("--dev", required=True, help="TUN device to create (<= 15 bytes)")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay, ms")
    p.add_argument("--loss-pct", type=float, default=0.0,
                   help="Bernoulli loss per packet, percent (turns offloads off)")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    if args.delay_ms < 0 or not 0 <= args.loss_pct < 100:
        print(f"delayline: expected --delay-ms >= 0 and 0 <= --loss-pct < 100, got "
              f"{args.delay_ms}, {args.loss_pct}", file=sys.stderr)
        return 1

    def stop(signum, frame):  # noqa: ARG001 - SIGTERM ends the loop like Ctrl-C
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        fd = open_tun(args.dev, offload=not args.loss_pct)
    except OSError as exc:
        print(f"delayline: cannot create TUN device {args.dev!r}: {exc}", file=sys.stderr)
        return 1
    print(f"ready {args.dev}", flush=True)
    stats = forward(fd, args.delay_ms / 1e3, args.loss_pct / 100, lifeline=0, seed=args.seed)
    print(f"delayline: parent closed the pipe; {stats}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
