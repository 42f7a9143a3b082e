"""The fixed and per-token costs of a transformer layer for ``lightning-p2r calibrate``: the package's own model and
one layer of each Hugging Face family, at negligible sizes, dense and MoE, with and without checkpointing, whose
differences give what a layer costs beyond the work the cost model prices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..models.config import M6Config
from ..planning.cluster import TOKEN_COSTS, Cluster
from ..planning.probes import LAYER_PROBE, probe_config
from .run import fastest_medians

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


