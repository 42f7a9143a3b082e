"""How long a collective takes: the ring and all-to-all formulas, on the link its group spans.

Payloads are counted as :mod:`lightning_p2r.strategy.accounting` counts them (an all-reduce's tensor, a gather's
whole assembled buffer, an all-to-all's bytes sent). With ``g`` ranks, bus bandwidth ``B`` and latency ``a`` per
step (the NCCL / gloo ring model):

- all-reduce: ``2 (g - 1) / g * payload / B + 2 (g - 1) a`` (a reduce-scatter then an all-gather);
- all-gather, reduce-scatter: ``(g - 1) / g * payload / B + (g - 1) a``;
- all-to-all: ``(g - 1) / g * payload / B + (g - 1) a`` (each rank sends all but its own share);
- broadcast: ``payload / B + (g - 1) a`` (pipelined ring);
- point-to-point: ``payload / B + a``.

Which link a group uses: the package's mesh is ``(pipeline, data..., expert, tensor)`` with the tensor dimension
innermost, so a group of ``g`` ranks ``stride`` apart spans ``g * stride`` consecutive devices; it stays inside a
node when that span fits in ``devices_per_node``, else its ring crosses the network and runs at the inter-node
bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster


@dataclass(frozen=True)
class Link:
    bandwidth: float
    latency: float


def group_link(cluster: Cluster, size: int, stride: int) -> Link:
    """The link a group of ``size`` ranks ``stride`` devices apart communicates over."""
    if size * stride <= cluster.devices_per_node:
        return Link(cluster.intra_node_bandwidth, cluster.intra_node_latency)
    return Link(cluster.inter_node_bandwidth, cluster.inter_node_latency)


def ring_terms(kind: str, size: int) -> tuple[float, int]:
    """(the share of the payload each rank moves over the link, the latency steps) of one collective of ``kind``
    among ``size`` ranks, by the formulas above."""
    g = size
    if kind == "all_reduce":
        return 2 * (g - 1) / g, 2 * (g - 1)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (g - 1) / g, g - 1
    if kind == "broadcast":
        return 1.0, g - 1
    if kind == "send":
        return 1.0, 1
    raise ValueError(f"unknown collective kind {kind!r}")


def collective_seconds(kind: str, payload: float, size: int, link: Link, calls: int = 1) -> float:
    """Seconds of ``calls`` collectives of ``kind`` moving ``payload`` bytes in all, over ``size`` ranks."""
    if payload < 0 or size < 1 or calls < 0:
        raise ValueError(f"collective_seconds: payload {payload}, size {size}, calls {calls} must be >= 0 / >= 1")
    share, steps = ring_terms(kind, size)
    if size == 1 or payload == 0:
        return 0.0
    return share * payload / link.bandwidth + calls * steps * link.latency
