"""A cluster described by the constants the cost model needs, read from (and written to) a small YAML file.

Sizes take numbers or strings with units ("32GB", "12.5GB/s", "200Gbit/s", "125T" FLOP/s, "5us"); every value is
checked before any planning starts, and a wrong one names the field and the file. Bits are divided by 8; a spelling
that reads as bits or bytes ("200Gb/s") is refused.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


_PREFIX = re.compile(r"([kmgtp]i?)?(.*)", re.IGNORECASE)
_UNITS_HINT = ("B or B/s for bytes, bit/s or bps for bits (divided by 8), FLOP/s; prefixes k, M, G, T, P (powers of "
               "1000) or Ki, Mi, Gi, Ti, Pi (powers of 1024)")


_UNIT_KINDS = {"bytes": ("b", "byte", "bytes", "bit", "bits"),
               "bytes/s": ("/s", "b/s", "byte/s", "bytes/s", "bit/s", "bits/s", "bps"),
               "FLOP/s": ("/s", "flop", "flops", "flop/s")}
"""What each unit measures (lowercase, after its prefix): a size, a byte rate or a compute rate. A number with a
prefix alone ("80G") fits any field; a bare rate ("12.5G/s") any rate."""
_FIELD_KINDS = {"device_memory": "bytes", "host_memory_per_node": "bytes", "device_flops": "FLOP/s",
                "attention_flops": "FLOP/s"} | dict.fromkeys(
    ("memory_bandwidth", "memory_small_bandwidth", "elementwise_bandwidth", "elementwise_small_bandwidth",
     "host_device_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"), "bytes/s")
"""The quantity each cluster field holds: a unit of another kind is refused ("device_memory: 80GB/s" was read as 80
GB, "inter_node_bandwidth: 400TFLOP/s" as 400 TB/s)."""
_KIND_EXAMPLES = {"bytes": "80GB", "bytes/s": "25GB/s or 200Gbit/s", "FLOP/s": "400TFLOP/s or 400T"}


def _unit_factor(unit: str, value: Any, name: str, number: float, prefix: str) -> float:
    """The factor a unit (after its prefix) turns the number into: 1 for bytes, FLOP/s and plain rates, 1/8 for
    bits. A lowercase ``b`` alone (``Gb/s``, ``Gb``) and ``Bps`` are refused: readers take them for bits or bytes."""
    lowered = unit.lower()
    rate = "/s" if lowered.endswith("/s") or lowered.endswith("ps") else ""
    # A lowercase b alone, in any case of the rest (Gb/S), and GBps, a letter's case away from Gbps (bits).
    if (unit[:1] == "b" and lowered in ("b", "b/s")) or (lowered == "bps" and unit != "bps"):
        bits, as_bytes, in_bytes = (f"{number:g}{prefix}bit{rate}", f"{number / 8:g}{prefix}B{rate}",
                                    f"{number:g}{prefix}B{rate}")
        raise ValueError(f"{name}: {value!r} is ambiguous, bits to some readers and bytes to others: write {bits} for "
                         f"bits (read as {as_bytes}) or {in_bytes} for bytes")
    if lowered in ("", "/s", "b", "b/s", "byte", "bytes", "byte/s", "bytes/s", "flop", "flops", "flop/s"):
        return 1.0
    if lowered in ("bit", "bits", "bit/s", "bits/s", "bps"):
        return 1 / 8
    raise ValueError(f"{name}: unknown unit in {value!r} (use {_UNITS_HINT})")


def parse_quantity(value: Any, name: str, *, unit: str = "", kind: str = "") -> float:
    """A number, or a string of a number with an SI or binary prefix and an optional unit: "32GB", "24GiB",
    "12.5GB/s", "125T", "125TFLOP/s", "1e12". Bits convert exactly: "200Gbit/s" and "200Gbps" are 25e9 bytes/s;
    a lowercase ``b`` alone ("200Gb/s") and "GBps" are refused as ambiguous, naming both readings. ``unit="s"`` reads
    times instead ("5us", "2ms"). ``kind`` ("bytes", "bytes/s" or "FLOP/s") refuses a unit of another kind."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a number or a string such as '32GB', got {value!r}")
    text = value.strip().replace(" ", "")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)([A-Za-zµ/]*)", text)
    if match is None:
        raise ValueError(f"{name}: cannot read {value!r} as a quantity (examples: 32GB, 12.5GB/s, 200Gbit/s, 125T, "
                         "5us)")
    number, suffix = float(match.group(1)), match.group(2)
    if unit == "s":
        if suffix == "":  # YAML reads 1e-9 (no dot) as a string
            return number
        if suffix not in _TIME:
            raise ValueError(f"{name}: cannot read {value!r} as a time (examples: 5us, 2ms, 0.001s)")
        return number * _TIME[suffix]
    prefix, rest = _PREFIX.fullmatch(suffix).groups()  # type: ignore[union-attr]  # (.*) always matches
    prefix = (prefix or "").lower()
    shown = (prefix[:1].upper() if prefix[:1] != "k" else "k") + prefix[1:]  # the hint's spelling: G, Gi, k
    factor = _unit_factor(rest, value, name, number, shown)
    found = [k for k, units in _UNIT_KINDS.items() if rest.lower() in units]
    if kind and found and kind not in found:
        raise ValueError(f"{name}: {value!r} is in {' or '.join(found)}, where this field holds {kind} (for example "
                         f"{_KIND_EXAMPLES[kind]})")
    return number * _SCALE[prefix] * factor


ACCELERATORS = ("cuda", "cpu")


ELEMENTWISE_SMALL_BYTES = 2**18
"""Bytes of the activation tensor at which ``Cluster.elementwise_small_bandwidth`` is measured (64 rows of 1024
fp32)."""
ELEMENTWISE_LARGE_BYTES = 2**25
"""Bytes of the activation tensor at which ``Cluster.elementwise_bandwidth`` is measured (8192 rows of 1024 fp32)."""
MEMORY_SMALL_BYTES = 2 * 2**20
"""The working set at which ``Cluster.memory_small_bandwidth`` is measured: a 1 MiB weight and its gradient, which a
CPU's caches hold."""
MEMORY_LARGE_BYTES = 3 * 2**26
"""Bytes an add of three 64 MiB tensors touches, the working set at which ``Cluster.memory_bandwidth`` is measured:
far beyond a CPU's caches."""
_ZERO_MEANS_UNMEASURED = ("elementwise_small_bandwidth", "memory_small_bandwidth", "reference_step_seconds")
FITTED_TERMS = ("stage_overhead", "dtensor_overhead", "blocking_collective_overhead", "expert_wait_overhead")
"""The framework terms fitted to measured steps rather than measured one by one (``planning.framework.FITTED``)."""


def log_interpolated(size: float, small: tuple[float, float], large: tuple[float, float]) -> float:
    """A rate at ``size`` from two measured ``(size, rate)`` points: linear in log-log between them, the nearer
    point's rate outside them; the large point's rate alone when the small one is unmeasured (rate 0)."""
    (small_size, small_rate), (large_size, large_rate) = small, large
    if small_rate <= 0:
        return large_rate
    low, high = math.log(small_size), math.log(large_size)
    where = min(max((math.log(max(size, 1.0)) - low) / (high - low), 0.0), 1.0)
    return math.exp((1 - where) * math.log(small_rate) + where * math.log(large_rate))


@dataclass(frozen=True)
class Cluster:
    """The machines a run would use. Bandwidths are per device and per direction; FLOP/s are what a device achieves
    on the training's large matmuls (not its datasheet peak)."""

    name: str = "cluster"
    accelerator: str = "cuda"
    """"cuda" or "cpu": what the devices are. It decides the kernels the model runs where it lets the device choose
    (``M6Config.expert_kernel="auto"``: grouped expert GEMMs on CUDA in bf16). ``lightning-p2r calibrate`` writes
    it; a file without it describes GPUs."""
    devices: int = 8
    """Accelerators (or, on a CPU-only machine, training processes) in the whole run."""
    devices_per_node: int = 8
    """Devices that share a node: its host memory, and the faster intra-node links."""
    device_memory: float = 80e9
    """Bytes of memory per device."""
    host_memory_per_node: float = 1e12
    """Bytes of host memory per node available for offloaded model states."""
    device_flops: float = 400e12
    """Matmul FLOP/s one device achieves at the training precision."""
    attention_flops: float = 200e12
    """FLOP/s of the attention kernel (scores and weighted sum), counted over the keys a query attends to."""
    attention_rates: list[list[float]] = dataclasses.field(default_factory=list)
    """The attention kernel's FLOP/s by shape: ``[seq_len, head_dim, FLOP/s]`` rows on a full grid of sequence
    lengths and head sizes, each the marginal rate of one more sequence and head (its fixed cost per call is the
    layer's, in ``dense_layer_overhead``). Measured by ``lightning-p2r calibrate``: a small head (a CPU run's 8 to 32)
    attends several times slower per FLOP than the 64-wide head of ``attention_flops``. The planner interpolates
    log-log between the grid's points and holds the edge's rate outside it; empty: every shape at
    ``attention_flops``."""
    memory_bandwidth: float = 2e12
    """Device memory bytes/s of plain traffic (gradient accumulation, FSDP2's buffer copies) over a working set far
    larger than the caches (``MEMORY_LARGE_BYTES``)."""
    memory_small_bandwidth: float = 0.0
    """The same over a working set a CPU's caches hold (``MEMORY_SMALL_BYTES``); between the two sizes the planner
    interpolates (log-log) by the traffic's working set: a small model's weights and gradients stay in the caches.
    Measured by ``lightning-p2r calibrate`` on a CPU (1.2 to 1.7 times ``memory_bandwidth`` on a 2-vCPU EPYC; two
    processes streaming memory at once can halve the latter, hardly the former). 0: every size at
    ``memory_bandwidth`` (a GPU, whose small copies are bound by their launch, priced apart; a file from before
    2026-11-30)."""
    elementwise_bandwidth: float = 1.5e12
    """Bytes/s the elementwise operators (norms, GELU, residual adds) achieve, in the bytes the cost model counts, on
    activations far larger than the caches (``ELEMENTWISE_LARGE_BYTES`` per tensor). On a CPU that size is where a
    training process maps a tensor on its own and faults its pages in at every step, even keeping what it frees below
    it (``P2RStrategy(host_allocator="auto")``): measured on a 2-vCPU EPYC, 7 GB/s, against 33 GB/s for the same
    tensor kept for reuse and 31-48 GB/s from 2 to 17 MB."""
    elementwise_small_bandwidth: float = 0.0
    """The same on activations of ``ELEMENTWISE_SMALL_BYTES`` per tensor, which a CPU's caches hold; between the two
    sizes the planner interpolates (log-log) by a micro-batch's activation tensor. 0: every size at
    ``elementwise_bandwidth`` (a file from before ``calibrate`` measured it)."""
    operator_overhead: float = 5e-6
    """Seconds of fixed cost per operator launch (kernel launch, or the host dispatcher on a CPU-only run)."""
    dense_layer_overhead: float = 0.0
    """Seconds one dense layer's forward and backward take at a negligible size, on the model's own code (its
    operators' dispatch, autograd and Python: what a small layer pays beyond its FLOPs and traffic). Measured by
    ``lightning-p2r calibrate``; 0: the planner prices a layer's fixed cost as operators times ``operator_overhead``."""
    moe_layer_overhead: float = 0.0
    """The same for an MoE layer's routing, dispatch and combine (its experts excluded: ``moe_expert_overhead``)."""
    hf_layer_overheads: dict[str, float] = dataclasses.field(default_factory=dict)
    """``dense_layer_overhead`` of each Hugging Face family's layer on ``transformers``' code, which launches more and
    smaller operators than M6's at a cost per operator that differs by family (6.2 to 8.4 us on a 2-vCPU EPYC): keyed
    by ``model_type`` for a dense layer and ``model_type:moe`` for an MoE one
    (``planning.hf_decoder.layer_cost_scales``). Measured by ``lightning-p2r calibrate`` where ``transformers`` is
    installed; a family absent is priced from M6's layer by its operator count."""
    moe_expert_overhead: float = 0.0
    """Seconds each expert an MoE layer computes adds to the layer's forward and backward at a negligible size (the
    loop kernel's per-expert matmuls and activation; about 0 with the grouped kernel)."""
    dense_checkpoint_overhead: float = 0.0
    """Seconds activation checkpointing adds to one dense layer's forward and backward at a negligible size: the
    forward run again in backward, with the saved-tensor hooks ``torch.utils.checkpoint`` calls on every tensor the
    layer saves (several times the rerun forward's own fixed cost on a CPU). A pipeline stage with recompute checkpoints
    each layer (layered accumulation's recompute runs no hooks: priced as one more forward). Measured by
    ``lightning-p2r calibrate`` on the stage's own call; 0: priced as one more forward's fixed cost."""
    moe_checkpoint_overhead: float = 0.0
    """The same for an MoE layer's routing, dispatch and combine (its experts excluded)."""
    moe_expert_checkpoint_overhead: float = 0.0
    """The same for each expert an MoE layer computes (the loop kernel's per-expert operators save tensors too)."""
    moe_expert_weight_overhead: float = 0.0
    """Seconds per element of one expert's weights (both matrices) that each expert the loop kernel computes adds per
    micro-batch beyond the weights' priced traffic: on a CPU its backward stacks the experts' weight gradients into
    the stacked weights' gradient, slower per byte than plain traffic. Measured by ``lightning-p2r calibrate`` on the
    model's own MoE layers at two widths; 0: not priced (and never with the grouped kernel)."""
    dense_token_overhead: float = 0.0
    """Seconds each token adds to one dense layer's forward and backward beyond what its FLOPs and elementwise
    traffic are priced at: the per-row work of operators over narrow rows (norms, rotary, softmax, the attention
    kernel's per-query setup), which a bandwidth measured on 1024-wide rows does not count. Measured by
    ``lightning-p2r calibrate`` on the model's own code at two token counts; 0: not priced."""
    dense_token_width_overhead: float = 0.0
    """Seconds per token and per unit of the model's width that one dense layer adds on top of
    ``dense_token_overhead`` (the unpriced per-token work grows with the width: measured at two widths)."""
    moe_token_overhead: float = 0.0
    """The same as ``dense_token_overhead`` for an MoE layer (its routing's top-k, sort, gathers and scatters add
    per-token work of their own)."""
    moe_token_width_overhead: float = 0.0
    """The same as ``dense_token_width_overhead`` for an MoE layer."""
    hf_dense_token_overhead: float = 0.0
    """``dense_token_overhead`` on a Hugging Face layer's code (a Llama layer, ``planning.hf_decoder.TOKEN_PROBES``),
    for every Hugging Face dense layer. Measured by ``lightning-p2r calibrate`` with ``transformers`` installed; where
    ``hf_layer_overheads`` is empty the planner uses M6's (``dense_token_overhead``)."""
    hf_dense_token_width_overhead: float = 0.0
    """The same as ``dense_token_width_overhead`` for a Hugging Face dense layer."""
    hf_moe_token_overhead: float = 0.0
    """The same as ``moe_token_overhead`` for a Hugging Face MoE layer (a Qwen3-MoE layer, grouped experts: per token
    it pays routing's sort and gathers, not M6's per-expert loop)."""
    hf_moe_token_width_overhead: float = 0.0
    """The same as ``moe_token_width_overhead`` for a Hugging Face MoE layer."""
    dropout_element_overhead: float = 0.0
    """Seconds per element of a dropout in training, forward and backward: drawing the random mask and applying it
    (on a CPU several times the traffic of a plain elementwise operator). Measured by ``lightning-p2r calibrate``;
    0: dropout not priced."""
    attention_dropout_element_overhead: float = 0.0
    """Seconds per attention probability (one per head, query and key of the causal square) that attention with
    dropout adds, forward and backward: on a CPU the fused kernel cannot drop probabilities, so the attention runs one
    that materializes them and draws a mask over them (a GPU's fused kernels drop inside: there it measures small).
    Measured by ``lightning-p2r calibrate``; 0: not priced."""
    matmul_overhead: float = 0.0
    """Seconds of fixed cost per matmul call beyond ``operator_overhead`` and the weight's memory traffic: on a CPU
    the BLAS call's setup, which a matmul of few rows cannot amortize (matmul efficiency by shape). Measured by
    ``lightning-p2r calibrate``; 0 in a file written before it was."""
    step_overhead: float = 0.0
    """Seconds of fixed cost per optimizer step outside the model (the Trainer's hooks and logging, the strategy's
    cross-rank checks)."""
    batch_overhead: float = 0.0
    """Seconds per Lightning batch beyond the first of a step (standard accumulation repeats Lightning's batch loop);
    measured by ``lightning-p2r calibrate`` (0 in a file written before it was)."""
    module_hook_overhead: float = 0.0
    """Seconds per hooked module (FSDP2 unit, a block the block streamer drives) per micro-batch; measured by
    ``calibrate`` (tiny blocks with and without FSDP2)."""
    stage_overhead: float = 0.0
    """Seconds per pipeline stage action (one stage's forward or backward of one micro-batch); fitted."""
    dtensor_overhead: float = 0.0
    """Seconds per pass of a tensor-parallel split module (its input and output converted to and from DTensor, its
    weight's operator dispatched through DTensor; ``planning.framework.tensor_parallel_module_passes``); fitted.
    Files fitted before 2026-11-29 priced it per operator of the layer: calibrate again."""
    blocking_collective_overhead: float = 0.0
    """Seconds per collective call on the critical path (tensor parallel, balance loss, pipeline sends, clipping)
    beyond the microbenchmark's latency: each waits for the slowest rank of its group (tensor parallelism once per
    sync point); fitted."""
    expert_wait_overhead: float = 0.0
    """Seconds per expert-parallel all-to-all beyond the microbenchmark's latency: each waits for the rank whose
    experts received the most tokens (dropless routing leaves the ranks' expert work unequal); fitted."""
    fitted_spread: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """The fitted terms ``lightning-p2r calibrate`` fitted on this machine, each with the [lowest, highest] value of
    the fits leaving one timed probe layout out (``lightning_p2r.measure.fit_terms``). A term listed here was fitted, 0
    included; one absent and at 0 was never fitted, and the planner warns when its layouts count it."""
    cpu_oversubscription: float = 1.0
    """Training threads per core of a node when above 1 (a CPU-only run with more processes x threads than cores;
    written by ``lightning-p2r calibrate``): each process gets 1 / this of a core, which stretches the fitted
    framework terms' Python time (``lightning_p2r.planning.framework``). 1 on GPUs."""
    host_device_bandwidth: float = 25e9
    """Bytes/s between a device and host memory, per direction (pinned memory)."""
    host_device_latency: float = 10e-6
    """Seconds of fixed cost per host-device copy."""
    optimizer_seconds_per_param: float = 2e-11
    """Seconds the device's optimizer step (fused Adam) takes per parameter element it updates."""
    host_optimizer_seconds_per_param: float = 1e-9
    """Seconds the host's optimizer step (Adam) takes per parameter it updates, per device's share of the host."""
    intra_node_bandwidth: float = 150e9
    """Collective bus bandwidth per device inside a node, bytes/s (NVLink)."""
    intra_node_latency: float = 5e-6
    """Seconds of latency per collective step inside a node."""
    inter_node_bandwidth: float = 25e9
    """Collective bus bandwidth per device between nodes, bytes/s (the node's network share per device)."""
    inter_node_latency: float = 10e-6
    """Seconds of latency per collective step between nodes."""
    collective_factors: dict[str, float] = dataclasses.field(default_factory=dict)
    """Bus bandwidth of a collective kind relative to all-reduce's ("all_gather", "reduce_scatter", "all_to_all",
    "broadcast", "send"; 1 when absent): NCCL runs them alike, gloo's gathers and reduce-scatters are slower."""
    overlap_collectives: bool = True
    """Data-parallel collectives (FSDP2 prefetch, DDP buckets) run while the device computes. False where they
    compete for the same cores (gloo on a CPU-only machine)."""
    overlap_copies: bool = True
    """Host-device copies of offloaded blocks run while the device computes (asynchronous copies from pinned
    memory); False where a copy is synchronous (CPU-only)."""
    reference_step_seconds: float = 0.0
    """Seconds of a short reference step on one thread of this machine when it was calibrated
    (``lightning_p2r.measure.speed``); ``plan`` times it again and prices the run at the machine's present speed
    (:func:`at_speed`). 0: not measured (a hand-written file, or one from before 2026-11-30), and not re-timed."""
    calibrated_on: str = ""
    """The host and processor (or GPU) the file was calibrated on; ``plan`` re-times the reference step only on the
    same machine."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "collective_factors":
                kinds = ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
                if not isinstance(value, dict) or any(k not in kinds or isinstance(v, bool) or not isinstance(
                        v, (int, float)) or v <= 0 for k, v in value.items()):
                    raise ValueError(f"Cluster.{field.name} must map some of {list(kinds)} to positive "
                                     f"numbers, got {value!r}")
            elif field.name == "attention_rates":
                _check_rate_grid(value)
            elif field.name == "hf_layer_overheads":
                if not isinstance(value, dict) or any(not isinstance(k, str) or isinstance(v, bool) or not isinstance(
                        v, (int, float)) or not 0 < v < math.inf for k, v in value.items()):
                    raise ValueError(f"Cluster.{field.name} must map model types (\"llama\", \"qwen3_moe:moe\") to "
                                     f"positive seconds, got {value!r}")
            elif field.name == "fitted_spread":
                if not isinstance(value, dict) or any(k not in FITTED_TERMS or not _is_range(v)
                                                      for k, v in value.items()):
                    raise ValueError(f"Cluster.{field.name} must map some of {list(FITTED_TERMS)} to [low, high] "
                                     f"seconds (0 <= low <= high), got {value!r}")
            elif field.name == "calibrated_on":
                if not isinstance(value, str):
                    raise ValueError(f"Cluster.calibrated_on must be a string (host / processor), got {value!r}")
            elif field.name == "name":
                if not isinstance(value, str) or not value:
                    raise ValueError(f"Cluster.name must be a non-empty string, got {value!r}")
            elif field.name == "accelerator":
                if value not in ACCELERATORS:
                    raise ValueError(f"Cluster.accelerator must be one of {list(ACCELERATORS)}, got {value!r}")
            elif field.type == "bool" or isinstance(field.default, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"Cluster.{field.name} must be true or false, got {value!r}")
            elif field.name in ("devices", "devices_per_node"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"Cluster.{field.name} must be a positive integer, got {value!r}")
            elif not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"Cluster.{field.name} must be a finite number, got {value!r}")
            elif value < 0 or (value == 0 and not field.name.endswith(("latency", "overhead", "per_param"))
                               and field.name not in _ZERO_MEANS_UNMEASURED):
                raise ValueError(f"Cluster.{field.name} must be {'>= 0' if 'latency' in field.name else '> 0'}, "
                                 f"got {value!r}")
        if self.cpu_oversubscription < 1:
            raise ValueError(f"Cluster.cpu_oversubscription must be >= 1 (training threads per core, 1 when each has "
                             f"a core), got {self.cpu_oversubscription!r}")
        if self.devices % self.devices_per_node and self.devices > self.devices_per_node:
            raise ValueError(f"Cluster.devices ({self.devices}) must be a multiple of devices_per_node "
                             f"({self.devices_per_node}): nodes are whole")

    def elementwise_bandwidth_at(self, tensor_bytes: float) -> float:
        """Bytes/s of elementwise operators on activation tensors of ``tensor_bytes``: interpolated in log-log between
        the two measured sizes, clamped outside them (``elementwise_bandwidth`` alone when the small size is
        unmeasured)."""
        return log_interpolated(tensor_bytes, (ELEMENTWISE_SMALL_BYTES, self.elementwise_small_bandwidth),
                                (ELEMENTWISE_LARGE_BYTES, self.elementwise_bandwidth))

    def memory_bandwidth_at(self, working_set_bytes: float) -> float:
        """Bytes/s of plain memory traffic over a working set of ``working_set_bytes``: interpolated in log-log
        between ``MEMORY_SMALL_BYTES`` and ``MEMORY_LARGE_BYTES``, clamped outside them (``memory_bandwidth`` alone
        when the small size is unmeasured)."""
        return log_interpolated(working_set_bytes, (MEMORY_SMALL_BYTES, self.memory_small_bandwidth),
                                (MEMORY_LARGE_BYTES, self.memory_bandwidth))

    def attention_flops_at(self, seq_len: int, head_dim: int) -> float:
        """FLOP/s of the attention kernel at ``seq_len`` and ``head_dim``: bilinear in (log seq_len, log head_dim)
        on the log of ``attention_rates``, clamped to the grid (``attention_flops`` when there is none)."""
        if not self.attention_rates:
            return self.attention_flops
        rates = {(row[0], row[1]): row[2] for row in self.attention_rates}
        seqs, heads = sorted({key[0] for key in rates}), sorted({key[1] for key in rates})

        def bracket(points: list[float], value: float) -> tuple[float, float, float]:
            """The grid points around ``value`` and its position between them (0..1, clamped)."""
            if value <= points[0]:
                return points[0], points[0], 0.0
            if value >= points[-1]:
                return points[-1], points[-1], 0.0
            upper = next(i for i, point in enumerate(points) if point >= value)
            low, high = points[upper - 1], points[upper]
            return low, high, (math.log(value) - math.log(low)) / (math.log(high) - math.log(low))

        s0, s1, ws = bracket(seqs, float(seq_len))
        h0, h1, wh = bracket(heads, float(head_dim))
        log_rate = ((1 - ws) * (1 - wh) * math.log(rates[s0, h0]) + ws * (1 - wh) * math.log(rates[s1, h0])
                    + (1 - ws) * wh * math.log(rates[s0, h1]) + ws * wh * math.log(rates[s1, h1]))
        return math.exp(log_rate)

    @property
    def nodes(self) -> int:
        return max(1, self.devices // self.devices_per_node)

    def with_devices(self, devices: int) -> Cluster:
        return dataclasses.replace(self, devices=devices)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_rate_grid(value: Any) -> None:
    """``attention_rates`` must be [seq_len, head_dim, FLOP/s] rows, positive and finite, covering every pair of
    the sequence lengths and head sizes they name once."""
    rows_ok = isinstance(value, list) and all(
        isinstance(row, (list, tuple)) and len(row) == 3 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in row)
        for row in value)
    if not rows_ok:
        raise ValueError(f"Cluster.attention_rates must be a list of [seq_len, head_dim, FLOP/s] rows of positive "
                         f"numbers, got {value!r}")
    pairs = [(row[0], row[1]) for row in value]
    seqs, heads = {pair[0] for pair in pairs}, {pair[1] for pair in pairs}
    if len(set(pairs)) != len(pairs) or len(pairs) != len(seqs) * len(heads):
        raise ValueError(f"Cluster.attention_rates must give each pair of its sequence lengths {sorted(seqs)} and "
                         f"head sizes {sorted(heads)} exactly once (a full grid), got {len(pairs)} rows")


def _is_range(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
            and 0 <= value[0] <= value[1])


TOKEN_COSTS = ("dense_token_overhead", "dense_token_width_overhead", "moe_token_overhead", "moe_token_width_overhead")
"""The per-token layer costs (``lightning_p2r.measure.layer_probes.token_overheads``)."""
HF_TOKEN_COSTS = tuple(f"hf_{name}" for name in TOKEN_COSTS)
"""The per-token costs of Hugging Face layers (``lightning_p2r.measure.layer_probes.hf_token_overheads``)."""
SIZE_DEPENDENT_LAYER_COSTS = (*TOKEN_COSTS, "moe_expert_weight_overhead")
"""The layer costs ``calibrate`` measures at more than one size; a CPU file with the fixed layer costs but none of
these was written before they existed (``plan`` warns)."""


_TIMES = {"dense_layer_overhead", "moe_layer_overhead", "moe_expert_overhead", "dense_checkpoint_overhead",
          "moe_checkpoint_overhead", "moe_expert_checkpoint_overhead", "dense_token_overhead",
          "moe_token_overhead", "dense_token_width_overhead", "moe_token_width_overhead", "moe_expert_weight_overhead",
          "hf_dense_token_overhead", "hf_dense_token_width_overhead", "hf_moe_token_overhead",
          "hf_moe_token_width_overhead", "dropout_element_overhead", "attention_dropout_element_overhead",
          "operator_overhead", "matmul_overhead", "step_overhead", "batch_overhead", "module_hook_overhead",
          "stage_overhead", "dtensor_overhead", "blocking_collective_overhead", "expert_wait_overhead",
          "host_device_latency", "intra_node_latency", "inter_node_latency", "optimizer_seconds_per_param",
          "host_optimizer_seconds_per_param", "reference_step_seconds"}


_RATES = ("device_flops", "attention_flops", "memory_bandwidth", "memory_small_bandwidth", "elementwise_bandwidth",
          "elementwise_small_bandwidth", "host_device_bandwidth", "intra_node_bandwidth")
"""A CPU-only machine's rates: its cores do all of it, so all of it runs at their speed."""
_NETWORK = ("inter_node_bandwidth", "inter_node_latency")
"""The links between nodes, which do not run on the machine the reference step re-times."""
HOST_TIMES = ("operator_overhead", "dense_layer_overhead", "moe_layer_overhead", "moe_expert_overhead",
              "dense_checkpoint_overhead", "moe_checkpoint_overhead", "moe_expert_checkpoint_overhead",
              "matmul_overhead", "step_overhead", "batch_overhead", "module_hook_overhead", "stage_overhead",
              "dtensor_overhead", "host_optimizer_seconds_per_param")
"""Beside GPUs, the times the host's Python, dispatcher and kernel launches set (what a small model's step on a GPU
waits on): the ones the reference step's speed moves there."""


def at_speed(cluster: Cluster, ratio: float) -> Cluster:
    """``cluster`` on a machine ``ratio`` times slower (above 1) or faster (below 1) than when it was calibrated, as
    measured by the reference step (``lightning_p2r.measure.speed``). On a CPU-only cluster every time and rate of
    the node scales (the cores run all of it: a step's prediction scales by ``ratio`` exactly); beside GPUs only the
    host's fixed costs (``HOST_TIMES``) do, since the reference step there waits on the host, not the GPU's math.
    The links between nodes never scale."""
    if not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"the speed ratio must be a positive number, got {ratio!r}")
    if cluster.accelerator != "cpu":
        times = HOST_TIMES
        rates: tuple[str, ...] = ()
    else:
        times = tuple(sorted(_TIMES - set(_NETWORK)))
        rates = _RATES
    changes: dict[str, Any] = {name: getattr(cluster, name) * ratio for name in {*times, "reference_step_seconds"}}
    changes |= {name: getattr(cluster, name) / ratio for name in rates}
    if cluster.accelerator == "cpu":
        changes["attention_rates"] = [[row[0], row[1], row[2] / ratio] for row in cluster.attention_rates]
    changes["hf_layer_overheads"] = {kind: seconds * ratio for kind, seconds in cluster.hf_layer_overheads.items()}
    changes["fitted_spread"] = {name: [low * ratio, high * ratio] if name in times else [low, high]
                                for name, (low, high) in cluster.fitted_spread.items()}
    return dataclasses.replace(cluster, **changes)


def cluster_from_dict(values: dict[str, Any], source: str = "the cluster") -> Cluster:
    """A :class:`Cluster` from a mapping (a parsed YAML file), with every unknown key and bad value named."""
    if not isinstance(values, dict):
        raise ValueError(f"{source}: expected a mapping of cluster fields, got {type(values).__name__}")
    known = {f.name: f for f in fields(Cluster)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        sections = sorted({"model", "trainer", "data"} & set(unknown))
        if sections:
            raise ValueError(f"{source}: this looks like a recipe (its {sections} sections), not a cluster file: pass "
                             "the recipe to --config, and a cluster file (`lightning-p2r calibrate --out FILE` writes "
                             "one) to --cluster")
        close = {name: difflib.get_close_matches(name, list(known), n=1, cutoff=0.75) for name in unknown}
        meant = [f"{name} -> {match[0]}" for name, match in close.items() if match]
        hint = f" (did you mean: {', '.join(meant)}?)" if meant else ""
        raise ValueError(f"{source}: unknown field(s) {unknown}{hint}; known: {sorted(known)}")
    parsed: dict[str, Any] = {}
    for key, value in values.items():
        if key == "hf_layer_overheads" and isinstance(value, dict):  # seconds, written as any other time field
            parsed[key] = {kind: parse_quantity(seconds, f"{source}: {key}.{kind}", unit="s")
                           for kind, seconds in value.items()}
        elif key in ("name", "accelerator", "collective_factors", "fitted_spread", "attention_rates",
                     "hf_layer_overheads", "calibrated_on") or isinstance(
                known[key].default, bool):
            parsed[key] = value
        elif key in ("devices", "devices_per_node"):
            parsed[key] = value
        else:
            parsed[key] = parse_quantity(value, f"{source}: {key}", unit="s" if key in _TIMES else "",
                                         kind=_FIELD_KINDS.get(key, ""))
    try:
        return Cluster(**parsed)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


REQUIRED_IN_FILES = ("devices", "device_memory", "device_flops")
"""Fields a cluster file must give: the machine's size, memory and speed. Every field has a default (an 8 x A100
node's, for the Python API's convenience), and a file without these was priced as that machine, silently: one giving
only ``accelerator: cpu`` predicted 183k tokens/s where its machine ran 9k (a new-user audit)."""


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster YAML file (see ``docs/planning.md`` for its fields); :data:`REQUIRED_IN_FILES` must be there."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cluster file {path} does not exist")
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"cluster file {path} is not valid YAML: {error}") from None
    cluster = cluster_from_dict(values or {}, source=str(path))
    missing = [name for name in REQUIRED_IN_FILES if name not in (values or {})]
    if missing:
        raise ValueError(f"cluster file {path} does not give {missing}: the planner would price the defaults' 8 x A100 "
                         "80 GB node instead. Measure this machine with `lightning-p2r calibrate --out FILE`, or write "
                         "them (docs/planning.md, 'The cluster file'; recipes/clusters/ has examples)")
    return cluster


def cluster_for(clusters: list[Cluster], devices: int | None) -> tuple[Cluster, str | None]:
    """The calibration to price ``devices`` devices with, from one or several cluster files (``lightning-p2r calibrate
    --processes N`` writes ``devices: N``): the file of that count, else the first; with a warning when a CPU file
    measured under another number of processes serves (its constants were measured with that many processes loading
    the machine: a one-process step priced by a two-process file came out 36% slow, median, docs/planning.md)."""
    if not clusters:
        raise ValueError("no cluster file given")
    if devices is None:
        return clusters[0], None
    same = [cluster for cluster in clusters if cluster.devices == devices]
    chosen = (same or clusters)[0]
    if same or chosen.accelerator != "cpu":
        return chosen.with_devices(devices), None
    return chosen.with_devices(devices), (
        f"{chosen.name} was calibrated with {chosen.devices} process(es) and the run has {devices}: on a CPU its "
        f"constants depend on how many processes load the machine; run `lightning-p2r calibrate --processes "
        f"{devices}` and pass that file too (--cluster accepts several)")


def write_cluster(cluster: Cluster, path: str | Path, comment: str = "") -> None:
    """Write ``cluster`` as YAML, atomically (a failed write leaves an earlier file whole)."""
    import yaml

    from ..files import write_atomically

    text = "".join(f"# {line}\n" for line in comment.splitlines()) + yaml.safe_dump(cluster.to_dict(),
                                                                                      sort_keys=False)
    write_atomically(path, text)
