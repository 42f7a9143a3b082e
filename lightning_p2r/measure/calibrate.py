"""``lightning-p2r calibrate``: measure this machine's constants and write them as a cluster file.

    lightning-p2r calibrate --out cluster.yaml [--processes 2] [--threads N] [--quick]
                                   [--probe-rounds R] [--no-fit]

What it measures, each as the median of several timed repetitions after a warm-up:

- ``device_flops``: a linear layer's forward and backward, fp32 (CPU) or bf16 (CUDA), of training-like shapes;
- ``attention_flops``: causal scaled-dot-product attention, forward and backward;
- ``attention_rates``: the same attention's marginal FLOP/s on a grid of sequence lengths and head sizes
  (:func:`attention_rate`), which the planner reads by the model's shape;
- ``memory_bandwidth``: an add of large tensors (three of 64 MiB): plain memory traffic beyond the caches;
- ``elementwise_bandwidth`` / ``elementwise_small_bandwidth``: LayerNorm, GELU and a residual add, forward and
  backward, in the bytes the cost model counts for them, on activations of 32 MiB and of 256 KiB (which a CPU's
  caches hold);
- ``dense_layer_overhead``, ``moe_layer_overhead``, ``moe_expert_overhead``: the package's own transformer at a
  negligible size with 1 and 5 layers, dense and MoE, 2 and 16 experts: a layer's fixed cost (dispatch, autograd,
  Python), which on a CPU is several times its operator count at ``operator_overhead`` (:func:`layer_overheads`);
- ``hf_layer_overheads``: the same for one layer of each Hugging Face family the planner prices, dense and MoE (with
  ``transformers`` installed; :func:`hf_layer_overheads`);
- ``dense_checkpoint_overhead``, ``moe_checkpoint_overhead``, ``moe_expert_checkpoint_overhead``: the same five
  models with each layer checkpointed by the call a pipeline stage with recompute makes: what checkpointing adds to
  each fixed cost (the forward run again, and the saved-tensor hooks on every tensor a layer saves);
- ``dense_token_overhead``, ``moe_token_overhead`` and their ``..._width_overhead``: the same dense and MoE models
  on 16 sequences instead of one, at widths 16 and 64: what a layer's added tokens cost beyond the growth the cost
  model prices, per token, on a line in the width (:func:`token_overheads`);
- ``moe_expert_weight_overhead``: the 16- and 2-expert MoE models at widths 16 and 64: what each expert costs more at
  the wider width beyond the priced difference, per element of its weights (:func:`expert_weight_overhead`);
- ``dropout_element_overhead``: a dropout (p = 0.1) over 1M elements, forward and backward, less a multiply of the
  same, per element; ``attention_dropout_element_overhead``: causal attention with dropout less without, per
  probability (sequences x heads x length squared) (:func:`dropout_overheads`);
- ``operator_overhead``: the fixed cost of one operator in a chain of tiny ones, forward and backward (the
  dispatcher and autograd on CPU, the launch on CUDA);
- ``matmul_overhead``: a linear layer's forward and backward at 16 to 128 rows, fitted to a line in the rows: the
  intercept beyond the launches and weight traffic the cost model prices, per matmul call (efficiency by shape).
  On a CPU the layer is timed at four widths (weights of 16 KiB to 1 MiB) and the intercepts fitted to a line in
  the weight's bytes: its value at no weight, less the launches, is the call's cost, and its slope five passes over
  the weight in the caches (``memory_small_bandwidth``, the rate at which the planner prices a small model's weight
  traffic; :func:`matmul_costs`);
- ``host_device_bandwidth`` / ``host_device_latency``: pinned host-to-device copies on CUDA; on a CPU-only machine
  the memory copy the block streamer does instead, and then (without ``--no-fit``) the bandwidth those copies reach
  inside training, read off a model trained with every block offloaded and resident, in turn (into fresh pages
  they ran at a third to a fifth of the speed of a copy alone: :mod:`.offload_copies`);
- ``optimizer_seconds_per_param`` / ``host_optimizer_seconds_per_param``: fused ``torch.optim.AdamW`` steps on
  device and on host tensors;
- ``step_overhead``: the step of a ``Trainer`` with ``P2RStrategy`` on the same processes over a model too small
  to matter (the framework's fixed cost per step);
- ``batch_overhead``: the same ``Trainer`` accumulating 4 batches of the same size per step: the added step time,
  less the model work the cost model prices for the 3 added batches, per added batch (Lightning's batch loop);
- ``module_hook_overhead``: a stack of tiny blocks trained with and without FSDP2 over a mesh of each rank alone,
  per hooked module and micro-batch (:mod:`.module_hooks`);
- ``cpu_oversubscription`` (CPU only): training threads (processes x ``--threads``) per usable core, when above 1;
- ``intra_node_bandwidth``, ``collective_factors``: each collective kind (all-reduce, all-gather, reduce-scatter,
  all-to-all, broadcast) timed at three message sizes among ``--processes`` local processes (gloo on CPU, NCCL
  when as many GPUs exist); a line through its times gives its bus bandwidth (the slope), by the ring formula;
  all-reduce's is the link's, the other kinds' are kept relative to it;
- ``intra_node_latency``: the **mean** time of small all-reduces (1 and 16 KB) over rounds of back-to-back calls
  (the median round), in four windows spread over the collective timings (the median window), per ring step
  (:func:`latency_per_step`). A step pays the sum of its calls, so the mean,
  tail included, is what it pays; a single call's median and a line's intercept through larger sizes miss the
  calls that wait for a descheduled rank, which dominate on a CPU running more processes than cores;
- ``stage_overhead``, ``dtensor_overhead``, ``blocking_collective_overhead``, ``expert_wait_overhead`` (with
  ``--processes`` above one; ``--no-fit`` skips them): no microbenchmark isolates them, so a handful of small
  layouts that count them (pipeline, tensor, expert parallel, ZeRO) train for a few steps, as ``plan --trial`` runs
  a layout, each three times in turn (``--probe-rounds``), and the terms are fitted to their median steps;
  ``fitted_spread`` keeps each term's range over the fits that leave one layout out (:mod:`.fit_terms`).

While it times the device, each measuring process's share of its cores (CPU time over wall time) is watched: below
90% other work was running, and the command says so and writes it into the file (``BusyMachineWarning``).

One node is all this command sees: the inter-node constants are copied from the intra-node ones, and the file says
so.

With ``--processes`` above one, every measurement runs in all the processes at once, as training would load the
machine. On CPU every "device" is one training process with ``--threads`` threads (the benchmarks run one thread
per process); collectives and copies then share the cores with compute, so the file says they do not overlap it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..models.config import M6Config
from ..planning.cluster import (
    ELEMENTWISE_LARGE_BYTES,
    ELEMENTWISE_SMALL_BYTES,
    MEMORY_LARGE_BYTES,
    TOKEN_COSTS,
    Cluster,
    write_cluster,
)
from ..planning.network import ring_terms
from ..planning.probes import LAYER_PROBE, probe_config
from ..strategy.host_allocator import retain_freed_host_memory, wants_retained
from .fit_terms import describe_fit, fit_framework_terms
from .module_hooks import module_hook_seconds, own_rank_mesh
from .offload_copies import fit_copy_bandwidth
from .run import host_threads, median_seconds, usable_cores, worker_env
from .speed import machine_name, reference_step_seconds


def matmul_flops(device: torch.device, size: int, repeats: int) -> float:
    """FLOP/s of a linear layer's forward and backward (input and weight gradients: the transposed products
    training runs), on (4 size, size) inputs and a (4 size, size) weight, fp32 on CPU, bf16 on CUDA."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(4 * size, size, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(4 * size, size, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        torch.nn.functional.linear(x, weight).sum().backward()

    seconds = median_seconds(step, iters=repeats, device=device)
    return 3 * 2 * (4 * size) * size * (4 * size) / seconds


def attention_flops(device: torch.device, seq_len: int, repeats: int) -> float:
    """FLOP/s of causal scaled-dot-product attention forward and backward (8 sequences, 4 heads of 64), counted as
    the cost model counts it: 4 x keys attended x head size per query and head, times three."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(8, 4, seq_len, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    seconds = median_seconds(step, iters=repeats, device=device)
    return 3 * 8 * 4 * seq_len * 4 * (seq_len + 1) / 2 * 64 / seconds


ATTENTION_GRID = {"cpu": ((32, 64, 128, 256), (8, 16, 32, 64)), "cuda": ((256, 1024, 4096), (64, 128))}
"""Sequence lengths and head sizes of ``Cluster.attention_rates``, by device type: what models trained there use."""
ATTENTION_GRID_QUICK = {"cpu": ((32, 128), (8, 64)), "cuda": ((256, 1024), (64, 128))}
_RATE_KEY = "attention_rate@"


def attention_rate(device: torch.device, seq_len: int, head_dim: int, repeats: int) -> float:
    """Marginal FLOP/s of causal scaled-dot-product attention, forward and backward, at ``seq_len`` and
    ``head_dim``: the time 8 sequences of 4 heads take beyond 2 sequences, against the FLOPs the cost model counts
    for the 24 added sequence-heads. The difference leaves out the kernel's fixed cost per call, which the layer's
    fixed cost (``dense_layer_overhead``, timed on the model's own code) already holds. Each size keeps its faster
    of two rounds."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step_of(sequences: int) -> Callable[[], None]:
        q, k, v = (torch.randn(sequences, 4, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    seconds = fastest_medians({"few": step_of(2), "many": step_of(8)}, device, repeats, rounds=2)
    flops = 3 * seq_len * 4 * (seq_len + 1) / 2 * head_dim * 24
    added = seconds["many"] - seconds["few"]
    if added <= 0:  # timing noise: the average rate of the larger run instead
        added = seconds["many"] * 24 / 32
    return flops / added


def attention_rates(device: torch.device, quick: bool, repeats: int) -> dict[str, float]:
    """:func:`attention_rate` on the device's grid (``ATTENTION_GRID``), keyed ``attention_rate@SEQxHEAD`` so that
    the processes' values average like every other constant; :func:`rate_rows` turns them into the cluster's rows."""
    grid = (ATTENTION_GRID_QUICK if quick else ATTENTION_GRID)["cuda" if device.type == "cuda" else "cpu"]
    return {f"{_RATE_KEY}{seq}x{head}": attention_rate(device, seq, head, repeats)
            for seq in grid[0] for head in grid[1]}


def rate_rows(measured: dict[str, Any]) -> list[list[float]]:
    """Pop the ``attention_rate@SEQxHEAD`` entries of ``measured`` into ``Cluster.attention_rates`` rows."""
    rows = []
    for key in [k for k in measured if k.startswith(_RATE_KEY)]:
        seq, head = key[len(_RATE_KEY):].split("x")
        rows.append([int(seq), int(head), float(measured.pop(key))])
    return sorted(rows)


def memory_bandwidth(device: torch.device, elements: int, repeats: int) -> float:
    """Bytes/s of plain memory traffic: an add of large tensors (two read, one written)."""
    a, b = torch.randn(elements, device=device), torch.randn(elements, device=device)
    out = torch.empty_like(a)
    seconds = median_seconds(lambda: torch.add(a, b, out=out), iters=repeats, device=device)
    return 3 * elements * 4 / seconds


def elementwise_bandwidth(device: torch.device, rows: int, repeats: int) -> float:
    """Bytes/s of the elementwise operators of a layer, forward and backward: a LayerNorm, a GELU and a residual
    add over (rows, 1024), counted as the cost model counts them (3 + 2 + 3 elements moved per element in forward,
    three times that in all)."""
    x = torch.randn(rows, 1024, device=device, requires_grad=True)
    norm = torch.nn.LayerNorm(1024, device=device)

    def step() -> None:
        (torch.nn.functional.gelu(norm(x)) + x).sum().backward()

    seconds = median_seconds(step, iters=repeats, device=device)
    return 3 * 8 * rows * 1024 * 4 / seconds


def dropout_overheads(device: torch.device, repeats: int) -> dict[str, float]:
    """Seconds per element of a dropout in training (forward and backward, beyond a multiply of the same tensor:
    the random mask), and per attention probability of causal attention with dropout beyond the same without (the
    kernel that can drop probabilities materializes them)."""
    x = torch.randn(2**20, device=device, requires_grad=True)
    dropped = median_seconds(lambda: torch.nn.functional.dropout(x, 0.1, training=True).sum().backward(),
                             iters=repeats, device=device)
    scaled = median_seconds(lambda: (x * 1.1).sum().backward(), iters=repeats, device=device)
    sequences, heads, length = 16, 4, 64
    q = torch.randn(sequences, heads, length, 16, device=device, requires_grad=True)

    def attention(p: float) -> Callable[[], None]:
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True,
                                                                       dropout_p=p).sum().backward()

    added = (median_seconds(attention(0.1), iters=repeats, device=device)
             - median_seconds(attention(0.0), iters=repeats, device=device))
    return {"dropout_element_overhead": max(dropped - scaled, 0.0) / x.numel(),
            "attention_dropout_element_overhead": max(added, 0.0) / (sequences * heads * length * length)}


def fastest_medians(steps: dict[str, Callable[[], None]], device: torch.device, repeats: int,
                    rounds: int) -> dict[str, float]:
    """Each step's median time, the steps timed in turn ``rounds`` times, keeping each one's fastest round: a
    difference of two timings is otherwise at the mercy of one slow moment on a shared machine."""
    seconds = dict.fromkeys(steps, math.inf)
    for _ in range(rounds):
        for name, step in steps.items():
            seconds[name] = min(seconds[name], median_seconds(step, iters=repeats, device=device))
    return seconds


TOKEN_PROBE_SEQUENCES = 16
"""Sequences per batch of the layer probes' second token count (``LAYER_PROBE``'s are one): the per-token terms
come from the growth between the two."""
TOKEN_PROBE_WIDTHS = (16, 64)
"""Widths at which the per-token terms are measured (heads of 8 at both): the first is ``LAYER_PROBE``'s; a token's
unpriced work grows with the width, and the planner prices it on the line through the two."""


def priced_probe(config: M6Config, cluster: Cluster, sequences: int) -> float:
    """The cost model's compute seconds of ``config`` on one device of ``cluster`` for ``sequences`` sequences of
    ``LAYER_PROBE``'s length (forward and backward, no optimizer: what the probes time)."""
    from ..planning import Workload
    from ..planning.layout import Layout
    from ..planning.share import rank_share
    from ..planning.step_time import compute_seconds

    workload = Workload(global_batch=sequences, seq_len=LAYER_PROBE["max_seq_len"])
    one = cluster.with_devices(1)
    return compute_seconds(config, Layout(), one, workload, rank_share(config, Layout(), one, workload, 0))


def layer_overheads(device: torch.device, repeats: int) -> dict[str, float]:
    """``dense_layer_overhead``, ``moe_layer_overhead`` and ``moe_expert_overhead``: the package's own transformer at a
    negligible size (``LAYER_PROBE``), forward and backward, with 1 and 5 layers (the difference over 4 is one layer's
    fixed cost) and with MoE layers of 2 and 16 experts (the difference over 5 x 14 is one expert's), in the precision
    training uses on the device (bf16 autocast on CUDA, fp32 on CPU) and with the expert kernel it picks there. The
    models are timed in turn, three rounds, each keeping its fastest round's median (:func:`fastest_medians`).
    The same five models with each layer checkpointed as a pipeline stage with recompute runs it give
    ``dense_checkpoint_overhead`` and the MoE pair: what checkpointing adds to each fixed cost.

    The dense and MoE models are timed again on ``TOKEN_PROBE_SEQUENCES`` sequences, and both token counts at the
    second of ``TOKEN_PROBE_WIDTHS`` too; one layer's time at each is returned under its ``LAYER_SECONDS`` name, from
    which :func:`token_overheads` takes what each token costs beyond the priced terms."""
    from ..models.transformer import M6Transformer

    def step_of(layers: int, experts: int, sequences: int = 1, width: int = LAYER_PROBE["dim"],
                checkpointed: bool = False) -> Callable[[], None]:
        config = probe_config(layers, experts, width)
        model = M6Transformer(config).to(device)
        tokens = torch.randint(0, config.vocab_size, (sequences, config.max_seq_len), device=device)

        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = checkpointed_forward(model, tokens) if checkpointed else model(tokens)
            (out.logits.float().mean() + out.aux_loss + out.z_loss).backward()

        return step

    wide = TOKEN_PROBE_WIDTHS[-1]
    shapes: dict[str, tuple[int, ...]] = {**FIXED_COST_PROBES, "moe5_wide": (5, 2, 1, wide),
                                          "experts_wide": (5, 16, 1, wide),
                                          **{f"{name}_checkpointed": (layers, experts, 1, LAYER_PROBE["dim"], True)
                                             for name, (layers, experts) in FIXED_COST_PROBES.items()}}
    for kind, experts in PROBE_KINDS:
        for layers in (1, 5):
            for size, sequences in PROBE_SIZES:
                for width in TOKEN_PROBE_WIDTHS:
                    shapes[f"{kind}{layers}_{size}_{width}"] = (layers, experts, sequences, width)
    seconds = fastest_medians({name: step_of(*shape) for name, shape in shapes.items()}, device, repeats, rounds=3)
    dense, moe, expert = fixed_layer_costs(seconds)
    checkpointed = fixed_layer_costs({name: seconds[f"{name}_checkpointed"] for name in FIXED_COST_PROBES})
    # A floor of one operator's cost: 0 would read as "unmeasured" and fall back to counting operators.
    floor = 1e-6
    return {"dense_layer_overhead": max(dense, floor), "moe_layer_overhead": max(moe, floor),
            "moe_expert_overhead": expert,
            "dense_checkpoint_overhead": max(checkpointed[0] - dense, floor),
            "moe_checkpoint_overhead": max(checkpointed[1] - moe, floor),
            "moe_expert_checkpoint_overhead": max(checkpointed[2] - expert, 0.0),
            "expert_seconds_narrow": expert,
            "expert_seconds_wide": max(seconds["experts_wide"] - seconds["moe5_wide"], 0.0) / (5 * 14),
            **{layer_seconds_name(kind, size, width): (seconds[f"{kind}5_{size}_{width}"]
                                                       - seconds[f"{kind}1_{size}_{width}"]) / 4
               for kind, _ in PROBE_KINDS for size, _ in PROBE_SIZES for width in TOKEN_PROBE_WIDTHS}}


FIXED_COST_PROBES = {"dense1": (1, 0), "dense5": (5, 0), "moe1": (1, 2), "moe5": (5, 2), "experts": (5, 16)}
"""The layer probes (layers, experts) whose differences give a layer's and an expert's fixed cost
(:func:`fixed_layer_costs`); they are timed plain and with each layer checkpointed."""


def hf_layer_overheads(device: torch.device, repeats: int) -> dict[str, Any]:
    """``hf_layer_overheads``: one layer of each Hugging Face family the planner prices, dense and MoE
    (``planning.hf_decoder.layer_kinds``), at the size of the M6 layer probe, forward and backward, from models of 1
    and 5 layers timed as :func:`layer_overheads` times M6's. The kinds of ``TOKEN_PROBES`` are timed again on
    ``TOKEN_PROBE_SEQUENCES`` sequences and at the wider of ``TOKEN_PROBE_WIDTHS``: one layer's time at each
    (``HF_LAYER_SECONDS``), from which :func:`hf_token_overheads` takes what a token costs. About 15 s on a CPU.
    Nothing without ``transformers`` (the ``[hf]`` extra): the planner then prices Hugging Face layers from M6's."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {}
    from ..planning.hf_decoder import TOKEN_PROBES, build_probe, layer_kind_key, layer_kinds, probe_hf_config

    def step_of(family: str, moe: bool, layers: int, sequences: int = 1,
                width: int = LAYER_PROBE["dim"]) -> Callable[[], None]:
        torch.manual_seed(0)
        config = probe_hf_config(family, layers, moe=moe, shared_expert=family == "qwen2_moe", width=width)
        model = build_probe(config).to(device)
        tokens = torch.randint(0, 64, (sequences, LAYER_PROBE["max_seq_len"]), device=device)

        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(input_ids=tokens, use_cache=False).logits
            logits.float().mean().backward()

        return step

    steps = {f"{layer_kind_key(family, moe)}/{layers}": step_of(family, moe, layers) for family, moe in layer_kinds()
             for layers in (1, 5)}
    for kind, family in TOKEN_PROBES.items():
        for size, sequences in PROBE_SIZES:
            for width in TOKEN_PROBE_WIDTHS:
                for layers in (1, 5):
                    steps[f"{kind}/{size}/{width}/{layers}"] = step_of(family, kind == "moe", layers, sequences,
                                                                       width)
    seconds = fastest_medians(steps, device, repeats, rounds=3)
    floor = 1e-6  # the planner reads a missing kind as "price it from M6's layer"
    overheads = {key: max((seconds[f"{key}/5"] - seconds[f"{key}/1"]) / 4, floor)
                 for key in (layer_kind_key(family, moe) for family, moe in layer_kinds())}
    return {"hf_layer_overheads": overheads, **{
        f"hf_{layer_seconds_name(kind, size, width)}": (seconds[f"{kind}/{size}/{width}/5"]
                                                       - seconds[f"{kind}/{size}/{width}/1"]) / 4
        for kind in TOKEN_PROBES for size, _ in PROBE_SIZES for width in TOKEN_PROBE_WIDTHS}}


def hf_token_overheads(cluster: Cluster, layer_seconds: dict[str, float]) -> dict[str, float]:
    """``hf_dense_token_overhead`` and the rest: :func:`token_overheads` on the Hugging Face probe layers'
    timings (``HF_LAYER_SECONDS``, present when ``transformers`` is), priced as the planner prices their models."""
    from ..planning.cluster import HF_TOKEN_COSTS
    from ..planning.hf_decoder import TOKEN_PROBES, hf_decoder_of, probe_hf_config

    if not all(name in layer_seconds for name in HF_LAYER_SECONDS):
        return {}
    unpriced = dataclasses.replace(cluster, **dict.fromkeys(HF_TOKEN_COSTS, 0.0))

    def priced_layer(kind: str, sequences: int, width: int) -> float:
        def probe(layers: int) -> float:
            config = probe_hf_config(TOKEN_PROBES[kind], layers, moe=kind == "moe", width=width)
            return priced_probe(hf_decoder_of(config), unpriced, sequences)

        return (probe(5) - probe(1)) / 4

    out = {}
    for kind in TOKEN_PROBES:
        out[f"hf_{kind}_token_overhead"], out[f"hf_{kind}_token_width_overhead"] = per_token_line(
            lambda width, kind=kind: (layer_seconds[f"hf_{layer_seconds_name(kind, 'many', width)}"]
                                      - layer_seconds[f"hf_{layer_seconds_name(kind, 'one', width)}"]),
            lambda width, kind=kind: (priced_layer(kind, TOKEN_PROBE_SEQUENCES, width)
                                      - priced_layer(kind, 1, width)))
    return out


def fixed_layer_costs(seconds: dict[str, float]) -> tuple[float, float, float]:
    """(dense layer, MoE layer without its experts, one expert): the fixed costs in the timings of
    ``FIXED_COST_PROBES``: 1 and 5 layers differ by 4 layers, MoE layers of 2 and 16 experts by 5 x 14 experts."""
    dense = max(seconds["dense5"] - seconds["dense1"], 0.0) / 4
    expert = max(seconds["experts"] - seconds["moe5"], 0.0) / (5 * 14)
    moe = max(seconds["moe5"] - seconds["moe1"], 0.0) / 4 - 2 * expert
    return dense, moe, expert


def checkpointed_forward(model: torch.nn.Module, tokens: torch.Tensor) -> Any:
    """``model(tokens)`` with each layer checkpointed by the call a pipeline stage with recompute makes
    (``run_checkpointed``): its outputs (logits, balance and z losses) as the model's forward returns them."""
    from types import SimpleNamespace

    from ..strategy.pipeline.stage import run_checkpointed

    hidden, context = model.embed(tokens)
    aux, z = [], []
    for layer in range(model.num_layers):
        hidden, moe = run_checkpointed(model.run_layer, layer, hidden, context)
        if moe is not None:
            aux.append(moe.aux_loss)
            z.append(moe.z_loss)
    zero = hidden.new_zeros((), dtype=torch.float32)
    return SimpleNamespace(logits=model.head(hidden), aux_loss=sum(aux, zero), z_loss=sum(z, zero))


PROBE_KINDS = (("dense", 0), ("moe", 2))
"""The layer kinds the per-token terms are measured for, with the probe's experts."""
PROBE_SIZES = (("one", 1), ("many", TOKEN_PROBE_SEQUENCES))
"""The two token counts (sequences of ``LAYER_PROBE``'s length) of the per-token probes."""


def layer_seconds_name(kind: str, size: str, width: int) -> str:
    return f"{kind}_layer_seconds_{size}_{width}"


LAYER_SECONDS = (*(layer_seconds_name(kind, size, width) for kind, _ in PROBE_KINDS for size, _ in PROBE_SIZES
                    for width in TOKEN_PROBE_WIDTHS), "expert_seconds_narrow", "expert_seconds_wide")
"""The raw layer timings :func:`layer_overheads` passes to :func:`token_overheads` (not cluster fields)."""
HF_LAYER_SECONDS = tuple(f"hf_{layer_seconds_name(kind, size, width)}" for kind, _ in PROBE_KINDS
                         for size, _ in PROBE_SIZES for width in TOKEN_PROBE_WIDTHS)
"""The same for the Hugging Face probe layers (:func:`hf_layer_overheads`, :func:`hf_token_overheads`)."""


def token_overheads(cluster: Cluster, layer_seconds: dict[str, float]) -> dict[str, float]:
    """``dense_token_overhead`` / ``dense_token_width_overhead`` and the MoE pair: how much more one probe layer's
    forward and backward took on ``TOKEN_PROBE_SEQUENCES`` sequences than on one, less the growth the cost model
    prices with ``cluster`` (its FLOPs, attention and elementwise traffic), per added token, at each of
    ``TOKEN_PROBE_WIDTHS``; the line through the two (never below 0: timing noise) gives the seconds per token at
    width 0 and per unit of width."""
    unpriced = dataclasses.replace(cluster, **dict.fromkeys(TOKEN_COSTS, 0.0))

    def priced_layer(experts: int, sequences: int, width: int) -> float:
        return (priced_probe(probe_config(5, experts, width), unpriced, sequences)
                - priced_probe(probe_config(1, experts, width), unpriced, sequences)) / 4

    out = {}
    for kind, experts in PROBE_KINDS:
        out[f"{kind}_token_overhead"], out[f"{kind}_token_width_overhead"] = per_token_line(
            lambda width, kind=kind: (layer_seconds[layer_seconds_name(kind, "many", width)]
                                      - layer_seconds[layer_seconds_name(kind, "one", width)]),
            lambda width, experts=experts: (priced_layer(experts, TOKEN_PROBE_SEQUENCES, width)
                                            - priced_layer(experts, 1, width)))
    return out


def per_token_line(measured_growth: Callable[[int], float], priced_growth: Callable[[int], float]
                   ) -> tuple[float, float]:
    """(seconds per token at width 0, seconds per token and unit of width): how much more a probe layer took on
    ``TOKEN_PROBE_SEQUENCES`` sequences than on one (``measured_growth(width)``) beyond the growth the cost model
    prices (``priced_growth(width)``), per added token, at each of ``TOKEN_PROBE_WIDTHS``, on the line through the two
    (never below 0: timing noise)."""
    added_tokens = (TOKEN_PROBE_SEQUENCES - 1) * LAYER_PROBE["max_seq_len"]
    narrow, wide = (max(measured_growth(width) - priced_growth(width), 0.0) / added_tokens
                    for width in TOKEN_PROBE_WIDTHS)
    low, high = TOKEN_PROBE_WIDTHS
    slope = max(wide - narrow, 0.0) / (high - low)
    return max(narrow - slope * low, 0.0), slope


def expert_weight_overhead(cluster: Cluster, layer_seconds: dict[str, float]) -> dict[str, float]:
    """``moe_expert_weight_overhead``: how much more each expert of the probe's MoE layers cost at the wider of
    ``TOKEN_PROBE_WIDTHS`` than at ``LAYER_PROBE``'s, less the difference the cost model prices with ``cluster`` (the
    weights' traffic, the matmuls), per element of one expert's two weight matrices; never below 0. On a CPU the loop
    kernel's backward stacks every expert's weight gradients into the stacked weights' gradient, a copy that runs
    slower per byte than plain traffic."""
    unpriced = dataclasses.replace(cluster, moe_expert_weight_overhead=0.0)

    def priced_expert(width: int) -> float:
        return (priced_probe(probe_config(5, 16, width), unpriced, 1)
                - priced_probe(probe_config(5, 2, width), unpriced, 1)) / (5 * 14)

    def elements(width: int) -> int:
        config = probe_config(1, 2, width)
        return 2 * config.dim * config.routed_hidden_dim

    narrow, wide = LAYER_PROBE["dim"], TOKEN_PROBE_WIDTHS[-1]
    measured = layer_seconds["expert_seconds_wide"] - layer_seconds["expert_seconds_narrow"]
    priced = priced_expert(wide) - priced_expert(narrow)
    return {"moe_expert_weight_overhead": max(measured - priced, 0.0) / (elements(wide) - elements(narrow))}


def operator_overhead(device: torch.device, chain: int, repeats: int) -> float:
    """Seconds per operator: a chain of tiny ops run forward and backward, divided by three times its length (the
    cost model counts a layer's forward operators and prices forward + backward as three times them)."""
    x = torch.ones(4, device=device, requires_grad=True)

    def step() -> None:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    return median_seconds(step, iters=repeats, device=device) / (3 * chain)


MATMUL_PROBE_DIMS = (32, 64, 128, 256)
"""Widths of the (4 dim, dim) linear layer the CPU's matmul costs are read from: weights of 16 KiB to 1 MiB, whose
weight and gradient (``MEMORY_SMALL_BYTES`` at the widest) a CPU's caches hold."""


def linear_intercept(device: torch.device, dim: int, repeats: int) -> tuple[float, int]:
    """(seconds, weight bytes): the intercept in the rows of a (4 dim, dim) linear layer's forward and backward timed
    at 16 to 128 rows (:func:`line_fit`), and its weight's bytes: what a call costs at any row count."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight = torch.randn(4 * dim, dim, device=device, dtype=dtype, requires_grad=True)
    rows = [16, 32, 64, 128]
    seconds = []
    # Several calls per timing, as training queues them: on CUDA a timing of one call would be mostly the host's
    # wait for the device (measured on an H100: 0.2 ms per call, which priced small MoE models 4x too slow).
    calls = 8

    def linear_calls(x: torch.Tensor) -> None:
        for _ in range(calls):
            torch.nn.functional.linear(x, weight).sum().backward()
    for count in rows:
        x = torch.randn(count, dim, device=device, dtype=dtype, requires_grad=True)
        seconds.append(median_seconds(lambda x=x: linear_calls(x), iters=repeats, device=device) / calls)
    intercept, _ = line_fit(rows, seconds)
    return intercept, weight.numel() * weight.element_size()


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("the fit needs points at two or more different x")
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


WEIGHT_PASSES = 5
"""Passes over a linear layer's weight per forward and backward that the cost model prices: read by the forward and
by the input's gradient, its gradient written, then read and written by the accumulation."""


def matmul_costs(weight_bytes: list[int], intercepts: list[float], operator_seconds: float,
                 bandwidth: float) -> dict[str, float]:
    """``matmul_overhead`` and ``memory_small_bandwidth`` from a linear layer's fixed cost per call at several weight
    sizes, all held by the caches: a line in the weight's bytes, whose value at no weight is the call's three
    launches and three matmul calls, and whose slope is ``WEIGHT_PASSES`` passes over the weight. The cache's
    bandwidth is never taken below ``bandwidth`` (memory's, beyond the caches); a slope of 0 or less (noise: the
    traffic too small to see) leaves it unmeasured (0), and the call's cost is then read as before, against the
    weight's traffic at ``bandwidth``."""
    fixed, per_byte = line_fit(weight_bytes, intercepts)
    if per_byte <= 0:
        middle = len(weight_bytes) // 2
        return against_memory(intercepts[middle], weight_bytes[middle], operator_seconds, bandwidth)
    return {"matmul_overhead": max(fixed - 3 * operator_seconds, 0.0) / 3,
            "memory_small_bandwidth": max(WEIGHT_PASSES / per_byte, bandwidth)}


def against_memory(intercept: float, weight_bytes: int, operator_seconds: float, bandwidth: float) -> dict[str, float]:
    """``matmul_overhead`` from one layer's fixed cost per call, less its three launches and ``WEIGHT_PASSES`` passes
    over its weight at ``bandwidth`` (never negative), and no cache rate."""
    return {"matmul_overhead": max(intercept - 3 * operator_seconds - WEIGHT_PASSES * weight_bytes / bandwidth,
                                   0.0) / 3,
            "memory_small_bandwidth": 0.0}


def measure_matmul_costs(device: torch.device, repeats: int, operator_seconds: float,
                         bandwidth: float) -> dict[str, float]:
    """``matmul_overhead``: what a linear layer's forward and backward cost per matmul call at few rows beyond their
    launches and weight traffic (where its cost stops scaling with the rows), and on a CPU ``memory_small_bandwidth``
    (:func:`matmul_costs` over ``MATMUL_PROBE_DIMS``). On CUDA one (4096, 1024) layer, against its weight's traffic
    at ``bandwidth``: a small copy there is bound by its launch, which ``operator_overhead`` prices, not by a faster
    memory."""
    if device.type == "cuda":
        return against_memory(*linear_intercept(device, 1024, repeats), operator_seconds, bandwidth)
    measured = [linear_intercept(device, dim, repeats) for dim in MATMUL_PROBE_DIMS]
    return matmul_costs([size for _, size in measured], [seconds for seconds, _ in measured], operator_seconds,
                        bandwidth)


def host_device_copy(device: torch.device, elements: int, repeats: int) -> tuple[float, float]:
    """(bytes/s, seconds of a tiny copy): pinned host -> device on CUDA, a host memory copy on CPU."""
    pin = device.type == "cuda"
    source = torch.randn(elements, pin_memory=pin)
    target = torch.empty(elements, device=device)
    tiny_source, tiny_target = torch.randn(1, pin_memory=pin), torch.empty(1, device=device)
    seconds = median_seconds(lambda: target.copy_(source, non_blocking=pin), iters=repeats, device=device)
    latency = median_seconds(lambda: tiny_target.copy_(tiny_source, non_blocking=pin), iters=repeats, device=device)
    return elements * 4 / max(seconds - latency, 1e-12), latency


def adam_seconds_per_param(device: torch.device, elements: int, repeats: int) -> float:
    """A step of AdamW as the package builds it (fused where torch has a fused kernel for the device)."""
    param = torch.nn.Parameter(torch.randn(elements, device=device))
    param.grad = torch.randn(elements, device=device)
    optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
    return median_seconds(optimizer.step, iters=repeats, device=device) / elements


def device_constants(device: torch.device, quick: bool) -> dict[str, float]:
    """Everything measured on one device (see the module docstring), as :class:`Cluster` fields. On a CPU this
    process's malloc first keeps what it frees below 32 MiB, as a training process's does
    (``P2RStrategy(host_allocator="auto")``), so that each probe pays for memory what training pays: nothing again
    below that size, and a fault per page of the tensors from 32 MiB on (the large elementwise probe's)."""
    if wants_retained("auto", device.type):  # allocate as a training process under the default does
        retain_freed_host_memory()
    repeats = 3 if quick else 20
    size = (1024 if device.type == "cuda" else 128) if quick else (4096 if device.type == "cuda" else 256)
    copy_bandwidth, copy_latency = host_device_copy(device, 2**20 if quick else 2**23, repeats)
    operator_seconds = operator_overhead(device, 50 if quick else 200, repeats)
    # Always far beyond a CPU's caches (``MEMORY_LARGE_BYTES``: three fp32 tensors): the planner interpolates from
    # the caches' rate to it.
    bandwidth = memory_bandwidth(device, MEMORY_LARGE_BYTES // (3 * 4), repeats)
    return {"device_flops": matmul_flops(device, size, repeats),
            "attention_flops": attention_flops(device, 128 if quick or device.type != "cuda" else 2048, repeats),
            "memory_bandwidth": bandwidth,
            "elementwise_bandwidth": elementwise_bandwidth(device, ELEMENTWISE_LARGE_BYTES // 4096, repeats),
            "elementwise_small_bandwidth": elementwise_bandwidth(device, ELEMENTWISE_SMALL_BYTES // 4096,
                                                                 repeats * 5),
            "operator_overhead": operator_seconds,
            **layer_overheads(device, repeats),
            **hf_layer_overheads(device, repeats),
            **dropout_overheads(device, repeats),
            **attention_rates(device, quick, 3 if quick else 10),
            **measure_matmul_costs(device, repeats, operator_seconds, bandwidth),
            "host_device_bandwidth": copy_bandwidth, "host_device_latency": copy_latency,
            "optimizer_seconds_per_param": adam_seconds_per_param(device, 2**18 if quick else 2**22, repeats),
            "host_optimizer_seconds_per_param": adam_seconds_per_param(torch.device("cpu"), 2**18 if quick
                                                                       else 2**22, repeats)}


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
"""The collective kinds ``calibrate`` times (``send`` is priced at all-reduce's bandwidth)."""


def collective_fit(kind: str, ranks: int, payloads: list[float], seconds: list[float]) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency per ring step in s) of one collective kind among ``ranks`` ranks, from its
    times at several payloads: a least-squares line through (payload, seconds), whose slope is the ring's share of
    the payload over the bandwidth and whose intercept is its latency steps times the latency. Noise never makes
    the latency negative; times that do not grow with the payload give the fastest time as latency and the largest
    payload's time as its bandwidth's bound."""
    if len(payloads) != len(seconds) or len(set(payloads)) < 2:
        raise ValueError("the fit needs times at two or more different payloads")
    share, steps = ring_terms(kind, ranks)
    mean_p, mean_s = sum(payloads) / len(payloads), sum(seconds) / len(seconds)
    slope = (sum((p - mean_p) * (t - mean_s) for p, t in zip(payloads, seconds))
             / sum((p - mean_p) ** 2 for p in payloads))
    intercept = max(mean_s - slope * mean_p, 0.0)
    if slope <= 0:  # times that do not grow with the payload: latency-bound, bandwidth no better than the largest's
        largest = max(range(len(payloads)), key=payloads.__getitem__)
        intercept, slope = min(seconds), seconds[largest] / payloads[largest]
    return share / slope, intercept / steps


def measure_processes(processes: int, threads: int, quick: bool) -> dict[str, float]:
    """:func:`device_constants` measured in ``processes`` local processes at once (on a CPU-only machine they share
    memory bandwidth and caches, as training processes do), averaged, plus each collective kind's bus bandwidth
    among them (:func:`collective_fit` over several message sizes; all-reduce's is the link's, the other kinds' are
    kept relative to it in ``collective_factors``) and the link's latency per ring step, from the mean of small
    all-reduces (:func:`latency_per_step`). Every kind is priced at that latency: pricing each at its own fitted
    latency made the cross-validation's held-out errors larger (docs/planning.md)."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(processes, _free_port(), threads, quick, queue), nprocs=processes, join=True)
    measured = queue.get()
    payloads = [4.0 * elements for elements in collective_sizes(quick, processes)]
    fits = {}
    for kind in COLLECTIVES:
        times = [measured.pop(f"{kind}@{index}") for index in range(len(payloads))]
        fits[kind] = collective_fit(kind, processes, payloads, times)
    bandwidth, _ = fits.pop("all_reduce")
    latency = latency_per_step(measured.pop("small_all_reduce_mean"), "all_reduce", processes)
    return measured | {
        "intra_node_bandwidth": bandwidth, "intra_node_latency": latency,
        "collective_factors": {kind: round(fit[0] / bandwidth, 3) for kind, fit in fits.items()}}


def collective_sizes(quick: bool, processes: int) -> list[int]:
    """Elements per collective: a tiny message (latency), a medium one and a large one (bandwidth), each a multiple
    of ``processes`` so that every rank's part of a gather or reduce-scatter is whole."""
    large = 2**18 if quick else 2**22
    return [-(-elements // processes) * processes for elements in (1, large // 64, large)]


def _worker(rank: int, processes: int, port: int, threads: int, quick: bool, queue: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= processes
    device = torch.device("cuda", rank) if use_nccl else torch.device("cpu")
    if use_nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=processes)
    try:
        dist.barrier()
        constants, constants["core_share"] = core_share(lambda: device_constants(device, quick), threads)
        constants["module_hook_overhead"] = module_hook_seconds(device, own_rank_mesh(device), 5 if quick else 15)
        repeats = 3 if quick else 20
        rounds = LATENCY_ROUNDS_QUICK if quick else LATENCY_ROUNDS
        # The latency is timed in windows spread over the collective timings and their median kept: on a 2-core
        # CPU one window's mean ranged over 0.2-0.56 ms within a run, and one window per calibration gave 0.22 to
        # 0.80 ms from one run to the next.
        windows = [small_all_reduce_mean(device, rounds)]
        for index, elements in enumerate(collective_sizes(quick, processes)):
            # Tiny messages are noisier: more repetitions where they cost little.
            times = _time_collectives(elements, processes, device, repeats * (5 if index == 0 else 1))
            constants |= {f"{kind}@{index}": seconds for kind, seconds in times.items()}
            windows.append(small_all_reduce_mean(device, rounds))
        constants["small_all_reduce_mean"] = statistics.median(windows)
        flat = flat_constants(constants)  # the ranks' values are averaged as one tensor
        names = sorted(flat)
        values = torch.tensor([flat[name] for name in names], dtype=torch.float64, device=device)
        dist.all_reduce(values)
        if rank == 0:
            queue.put(nested_constants({name: float(value) / processes for name, value in zip(names, values.tolist())}))
    finally:
        dist.destroy_process_group()


def flat_constants(constants: dict[str, Any]) -> dict[str, float]:
    """``constants`` with each mapping of timings (``hf_layer_overheads``) spread into ``name/key`` entries."""
    flat: dict[str, float] = {}
    for name, value in constants.items():
        if isinstance(value, dict):
            flat |= {f"{name}/{key}": seconds for key, seconds in value.items()}
        else:
            flat[name] = value
    return flat


def nested_constants(flat: dict[str, float]) -> dict[str, Any]:
    """The inverse of :func:`flat_constants`."""
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        outer, _, key = name.partition("/")
        if key:
            nested.setdefault(outer, {})[key] = value
        else:
            nested[name] = value
    return nested


def small_all_reduce_mean(device: torch.device, rounds: int) -> float:
    """One window of the latency measurement: the mean call of ``LATENCY_CALLS`` back-to-back all-reduces of each of
    ``LATENCY_ELEMENTS``, the median of ``rounds`` rounds per size, averaged over the sizes."""
    return sum(statistics.median(mean_call_seconds(_all_reduce_of(elements, device), calls=LATENCY_CALLS,
                                                   device=device) for _ in range(rounds))
               for elements in LATENCY_ELEMENTS) / len(LATENCY_ELEMENTS)


LATENCY_ELEMENTS = (256, 4096)
"""fp32 elements of the all-reduces timed for the latency: small enough that bandwidth adds little (16 KB at most),
not so small that gloo takes its path for a few elements, which is faster than what training's messages see."""
LATENCY_CALLS = 50
"""Back-to-back calls per timed round of the latency: about what a training step issues."""
LATENCY_ROUNDS = 7
"""Rounds per size; their median counts, as the benchmarks' median step does (``--quick``: 3)."""
LATENCY_ROUNDS_QUICK = 3


def latency_per_step(seconds_per_call: float, kind: str, ranks: int) -> float:
    """The latency per ring step of a collective whose small calls take ``seconds_per_call`` on average among
    ``ranks`` ranks: that time over its latency steps (:func:`~lightning_p2r.planning.network.ring_terms`)."""
    if seconds_per_call < 0:
        raise ValueError(f"seconds_per_call must be >= 0, got {seconds_per_call}")
    return seconds_per_call / max(1, ring_terms(kind, ranks)[1])


def mean_call_seconds(fn: Any, *, calls: int, device: torch.device, warmup: int = 10) -> float:
    """The mean wall time of ``calls`` back-to-back calls of ``fn`` (after ``warmup``): every call counts, the
    slow ones too."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls


def _all_reduce_of(elements: int, device: torch.device) -> Any:
    import torch.distributed as dist

    tensor = torch.ones(elements, device=device)
    return lambda: dist.all_reduce(tensor)


def _time_collectives(elements: int, processes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """The median seconds of each collective kind over a message of ``elements`` fp32 values."""
    import torch.distributed as dist

    # The names torch 2.13 prefers, where it has them (the older ones warn).
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    whole = torch.ones(elements, device=device)
    part, gathered = torch.ones(elements // processes, device=device), torch.empty(elements, device=device)
    times = {}
    for kind, run in (("all_reduce", lambda: dist.all_reduce(whole)),
                      ("all_gather", lambda: gather(gathered, part)),
                      ("reduce_scatter", lambda: scatter(part, whole)),
                      ("all_to_all", lambda: dist.all_to_all_single(gathered, whole)),
                      ("broadcast", lambda: dist.broadcast(whole, 0))):
        dist.barrier()
        times[kind] = median_seconds(run, iters=repeats, device=device)
    return times


def _one_process_hooks(device: torch.device, quick: bool) -> float:
    """:func:`module_hook_seconds` in this process, inside a process group of its own for the while (FSDP2 needs
    one), or the one it already runs in."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    repeats = 5 if quick else 15
    if dist.is_initialized():
        return module_hook_seconds(device, own_rank_mesh(device), repeats)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    try:
        return module_hook_seconds(device, init_device_mesh(device.type, (1,)), repeats)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


STEP_OVERHEAD_MODEL = {"vocab_size": 64, "max_seq_len": 8, "num_layers": 1, "dim": 16, "num_heads": 2,
                       "moe_layers": [], "init_seed": 0}


ACCUMULATED_BATCHES = 4
"""Lightning batches per step of the run that measures ``batch_overhead``."""


def step_overhead(processes: int, threads: int, quick: bool, accumulate: int = 1) -> float:
    """Seconds a training step costs beyond its model's work: a ``Trainer`` with ``P2RStrategy`` on ``processes``
    ranks stepping a model too small to matter (hooks, logging, the loss's cross-rank check, the launcher's
    processes sharing the machine), the median optimizer-step interval after warm-up. ``accumulate``: Lightning
    batches per step (``accumulate_grad_batches``), each of the same size as the single batch's."""
    import json
    import subprocess
    import sys
    import tempfile

    steps = 8 if quick else 30
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "overhead.json")
        spec = {"processes": processes, "threads": threads, "steps": steps, "out": out, "accumulate": accumulate}
        result = subprocess.run([sys.executable, "-m", "lightning_p2r.measure.calibrate", "--overhead-worker",
                                 json.dumps(spec)], capture_output=True, text=True, env=worker_env(threads),
                                timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"the step-overhead run failed: {result.stderr[-2000:]}")
        with open(out, encoding="utf-8") as file:
            return float(json.load(file)["step_s"])


def _overhead_worker(spec: dict[str, Any]) -> None:
    import json

    from ..strategy import P2RStrategy
    from .run import fit_on_random_tokens

    torch.set_num_threads(spec["threads"])
    accumulate = spec.get("accumulate", 1)
    run = {"model": STEP_OVERHEAD_MODEL, "devices": spec["processes"], "steps": spec["steps"],
           "global_batch": 2 * spec["processes"] * accumulate, "accumulate_grad_batches": accumulate,
           "accelerator": "auto"}
    trainer, _, step_s = fit_on_random_tokens(run, P2RStrategy(), warmup=min(5, spec["steps"] // 2))
    if trainer.global_rank == 0:
        with open(spec["out"], "w", encoding="utf-8") as file:
            json.dump({"step_s": step_s}, file)


def batch_call_overhead(one_batch_s: float, accumulated_s: float, batches: int, modelled_extra_s: float) -> float:
    """Seconds per Lightning batch beyond the first: the step of ``batches`` accumulated batches (``accumulated_s``)
    less the step of one (``one_batch_s``) and the model work the cost model prices for the added batches
    (``modelled_extra_s``), over the added batches; never below 0 (timing noise)."""
    if batches < 2:
        raise ValueError(f"the added batches' cost needs at least 2 batches per step, got {batches}")
    return max(accumulated_s - one_batch_s - modelled_extra_s, 0.0) / (batches - 1)


def modelled_added_batches(cluster: Cluster, batches: int) -> float:
    """Seconds the cost model prices for the step-overhead model's ``batches - 1`` added batches (with the
    framework terms at their values in ``cluster``, 0 in a fresh calibration)."""
    from ..planning import Workload, estimate_step
    from ..planning.layout import Layout

    config = M6Config(**STEP_OVERHEAD_MODEL)
    seq_len = config.max_seq_len

    def step(micro_batches: int) -> float:
        workload = Workload(global_batch=2 * cluster.devices * micro_batches, seq_len=seq_len)
        return estimate_step(config, Layout(micro_batches=micro_batches), cluster, workload).total

    return step(batches) - step(1)


def cpu_oversubscription(processes: int, threads: int, cores: int) -> float:
    """Training threads per core when they outnumber the cores (1 otherwise): each process's share of a core is one
    over it."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    return max(1.0, processes * threads / cores)


def host_memory_bytes() -> float:
    try:
        with open("/proc/meminfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


class BusyMachineWarning(UserWarning):
    """Other work shared the machine while ``calibrate`` measured it."""


BUSY_SHARE = 0.9
"""The share of its cores below which a measuring process is taken to have shared the machine with other work."""


def core_share(fn: Callable[[], Any], threads: int) -> tuple[Any, float]:
    """``fn()``'s result and the share of its ``threads`` cores the process got while it ran: its CPU time over the
    wall time and the threads (1 when nothing else ran on the machine and every thread stayed busy)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9) / threads


def busy_warnings(share: float) -> list[str]:
    """What to tell the user when other work shared the machine with the measurement (a CPU run's constants are then
    slower and noisier than the machine's, and the planner's figures with them), from the measuring processes'
    share of their cores while they timed the device. (The load average is no such sign: it stays high for a minute
    after the user's previous ``calibrate``.)"""
    if share >= BUSY_SHARE:
        return []
    return [f"the measuring processes got {share:.0%} of their cores while timing this machine: other work was "
            "running, and the constants are slower and noisier than the machine's; calibrate again with nothing else "
            "running"]


SPEED_MOVED = 0.10
"""How far the reference step may move between a calibration's start and end before the command says the machine's
speed changed while it measured."""


def speed_moved(before: float, after: float) -> str | None:
    """A warning when the reference step (``lightning_p2r.measure.speed``) timed before and after the calibration
    differs by more than ``SPEED_MOVED``: the constants then mix two speeds of the machine."""
    change = after / before - 1
    if abs(change) <= SPEED_MOVED:
        return None
    return (f"the machine's speed moved while it was measured: the reference step took {1e3 * before:.3g} ms before "
            f"and {1e3 * after:.3g} ms after ({100 * change:+.0f}%); the constants mix both speeds: calibrate again "
            "with nothing else running")


def calibrate(*, processes: int = 2, threads: int = 1, quick: bool = False, name: str = "this-machine") -> Cluster:
    """Measure this machine (see the module docstring) and return its :class:`Cluster`."""
    if processes < 1 or threads < 1:
        raise ValueError(f"processes and threads must be >= 1, got {processes} and {threads}")
    cuda = torch.cuda.is_available()
    if processes > 1:
        measured = measure_processes(processes, threads, quick)
    else:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        device = torch.device("cuda") if cuda else torch.device("cpu")
        try:
            measured, measured["core_share"] = core_share(lambda: device_constants(device, quick), threads)
            measured["module_hook_overhead"] = _one_process_hooks(device, quick)
        finally:
            torch.set_num_threads(previous)
        # Nothing to communicate with: the collective constants are unused on one device.
        measured |= {"intra_node_bandwidth": measured["memory_bandwidth"], "intra_node_latency": 0.0}
    share = measured.pop("core_share")
    if not cuda:  # beside a GPU the device's timings do not hang on the host's cores
        for message in busy_warnings(share):
            warnings.warn(message, BusyMachineWarning, stacklevel=2)
    measured["attention_rates"] = rate_rows(measured)
    layer_seconds = {name: measured.pop(name) for name in (*LAYER_SECONDS, *HF_LAYER_SECONDS) if name in measured}
    measured["step_overhead"] = step_overhead(processes, threads, quick)
    accumulated = step_overhead(processes, threads, quick, accumulate=ACCUMULATED_BATCHES)
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else host_memory_bytes() / processes
    cluster = Cluster(name=name, accelerator="cuda" if cuda else "cpu", devices=processes,
                      devices_per_node=processes, device_memory=float(memory),
                      host_memory_per_node=host_memory_bytes(), inter_node_bandwidth=measured["intra_node_bandwidth"],
                      inter_node_latency=measured["intra_node_latency"], overlap_collectives=cuda,
                      overlap_copies=cuda, cpu_oversubscription=1.0 if cuda else cpu_oversubscription(
                          processes, threads, usable_cores()), **measured)
    cluster = dataclasses.replace(cluster, **token_overheads(cluster, layer_seconds),
                                  **expert_weight_overhead(cluster, layer_seconds))
    cluster = dataclasses.replace(cluster, **hf_token_overheads(cluster, layer_seconds))
    extra = modelled_added_batches(cluster, ACCUMULATED_BATCHES)
    return dataclasses.replace(cluster, batch_overhead=batch_call_overhead(
        measured["step_overhead"], accumulated, ACCUMULATED_BATCHES, extra))


def main(argv: list[str]) -> None:
    if argv[:1] == ["--overhead-worker"]:
        import json

        _overhead_worker(json.loads(argv[1]))
        return
    parser = argparse.ArgumentParser(prog="lightning-p2r calibrate",
                                     description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--out", required=True, help="the cluster YAML to write (replaced atomically)")
    parser.add_argument("--processes", type=int, default=2,
                        help="training processes (devices) on this machine; collectives are timed among them")
    parser.add_argument("--threads", type=int,
                        help="torch threads per process (default: 1 on CPU, where each process is a device; beside "
                             "GPUs the usable cores divided among the processes, as a run's host work uses them)")
    parser.add_argument("--name", default="this-machine")
    parser.add_argument("--quick", action="store_true", help="smaller, fewer measurements (seconds, noisier)")
    parser.add_argument("--probe-rounds", type=int, default=None,
                        help="times each probe layout of the fits is timed, the probes in turn; the fits read "
                             "medians (default: 3 for the framework waits and for the offload copies; "
                             "--quick: 1)")
    parser.add_argument("--no-fit", action="store_true",
                        help="skip the fits from timed probe layouts: the framework waits (their terms stay 0; the "
                             "planner warns where a layout counts one) and, on CPU, the offloaded copies' "
                             "bandwidth inside training (the copy alone stands)")
    args = parser.parse_args(argv)
    if args.probe_rounds is not None and args.probe_rounds < 1:
        parser.error(f"--probe-rounds must be at least 1, got {args.probe_rounds}")
    if args.probe_rounds is not None and args.no_fit:
        parser.error("--probe-rounds shapes the fits from timed probe layouts, which --no-fit skips")
    if args.threads is None:
        args.threads = host_threads("cuda" if torch.cuda.is_available() else "cpu", args.processes, usable_cores())
    reference_device = "cuda" if torch.cuda.is_available() else "cpu"
    reference_before = reference_step_seconds(reference_device)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", BusyMachineWarning)
            cluster = calibrate(processes=args.processes, threads=args.threads, quick=args.quick, name=args.name)
    except ValueError as error:
        parser.error(str(error))
    busy = []
    for warning in caught:
        if issubclass(warning.category, BusyMachineWarning):
            busy.append(f"Warning: {warning.message}.")
            print(f"warning: {warning.message}", file=sys.stderr)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    copies = ""
    if not args.no_fit:
        cluster, copies = fit_copy_bandwidth(cluster, quick=args.quick, threads=args.threads,
                                             rounds=args.probe_rounds)
    if args.processes > 1 and not args.no_fit:
        cluster, _ = fit_framework_terms(cluster, quick=args.quick, threads=args.threads,
                                         rounds=args.probe_rounds)
    reference_after = reference_step_seconds(reference_device)
    cluster = dataclasses.replace(cluster, reference_step_seconds=(reference_before + reference_after) / 2,
                                  calibrated_on=machine_name(cluster.accelerator))
    if moved := speed_moved(reference_before, reference_after):
        busy.append(f"Warning: {moved}.")
        print(f"warning: {moved}", file=sys.stderr)
    comment = (f"Measured by `lightning-p2r calibrate` on {time.strftime('%Y-%m-%d')} with {args.processes} "
               f"process(es) of {args.threads} thread(s).\nOne node was measured: inter-node constants repeat the "
               f"intra-node ones; edit them for a multi-node cluster.\n{describe_fit(cluster)}"
               + "".join(f"\n{line}" for line in (copies, *busy) if line))
    write_cluster(cluster, args.out, comment)
    for key, value in cluster.to_dict().items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
