"""Tensor parallelism of a Hugging Face decoder as the strategy applies it (``strategy.parallel.hf_plan`` and
``tensor``): the collectives each layer issues and the modules that go through DTensor, read from the family's own
plan (``base_model_tp_plan``; GPT-2's from the package's, ``models.gpt2_plan``) and the layer's modules on the meta
device.

An M6 layer splits fused projections: one column and one row layer in each half. A Hugging Face layer splits each
projection apart (q, k and v; gate and up), and torch's column style sums the input gradient of each column layer on
its own, so a Llama layer issues seven all-reduces per micro-batch where M6's issues four (a Qwen3 layer adds two
per step: its per-head norms' gradients). What each style issues per micro-batch of T tokens of width d, in one line:

- column layer (its input whole): an all-reduce of the input gradient (T d) in backward;
- row layer: an all-reduce of its partial output (T d) in forward; under sequence parallelism a reduce-scatter in
  forward and an all-gather in backward, and a transposed row layer's bias (GPT-2) its gradient all-reduced;
- per-head norm (Qwen3's q_norm and k_norm, "replicated_with_grad_allreduce"): its weight gradient all-reduced, once
  per step (a replicated weight's partial gradients add up over the micro-batches and are summed over the ranks
  when the optimizer reads them), as every parameter gradient below;
- packed column layer (GPT-2's ``c_attn``): its weight and bias gathered whole in forward, their gradients
  reduce-scattered in backward, and the input gradient all-reduced;
- MoE layer, its experts split by expert over the tensor-parallel ranks: the output all-reduced in forward, the
  input gradient (T d) and the gate weights' (T k) in backward (under expert parallelism the experts' rows, T k of
  width d, as the all-to-all brought them); under sequence parallelism its input gathered in forward and its output
  cut (an all-gather of the gradient in backward);
- sequence parallelism: each module holding column layers gathers the sequence at its entry (an all-gather in
  forward; its backward keeps the rank's positions, no collective), and each parameter of the block's norms has its
  gradient all-reduced.

Outside the layers: an embedding split by vocabulary (GPT-2's, or one tied to the split head) all-reduces its output;
under sequence parallelism the first block cuts the sequence (an all-gather in backward) and the final norm's
parameters' gradients are all-reduced (GPT-2's final norm gathers the sequence instead); the head's input gradient is
all-reduced, or, after a final norm on the rank's positions, its input gathered in forward and its gradient
reduce-scattered in backward; the vocabulary-parallel loss adds three all-reduces of one fp32 number per token.
Recompute repeats every collective a layer issues in forward. Under mixed precision the residual stream stays at the
parameters' width (fp32): the sums of a column layer's input gradient, an MoE layer's input and output, the gathers
of the sequence, the embedding's and the head's move 4 bytes an element; a row layer's output and its gradient, and
the gate weights, the activations' 2; parameters and their gradients (the packed weights, the norms', the biases')
the parameters'. Counted with ``bf16-mixed`` on 2 gloo processes for a Llama and a Qwen3-MoE (sequence parallel,
layered, recompute; ``tests/distributed/test_mixed_precision_counts.py``), in fp32 for twenty-one runs.

Waits (``Transfer.waits``, priced by ``framework.blocking_collective_calls``): a collective waits for the slowest rank
when compute ran since the last one (ranks drift apart over compute, not over a call). So each row layer's sum, an
MoE layer's three, and the input-gradient sums of one module's column layers (q, k and v, or gate and up: a matmul
apart) once together, as an M6 layer's two halves wait; under sequence parallelism a row layer's reduce-scatter and
the next module's gather (only a residual add and a norm between them) once for the pair. The parameter gradients'
collectives (norms, biases, the packed weights) come right after other collectives: none of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..layout.names import HF_STYLES
from .hf_decoder import HFDecoder, hf_block_plan, meta_model


@dataclass(frozen=True)
class SplitLayer:
    """What tensor parallelism splits in one layer of a Hugging Face decoder."""

    columns: int
    """Column layers that take the hidden state whole (packed ones included)."""
    rows: int
    packed_elements: int
    """Parameter elements of packed column layers (gathered whole every forward)."""
    packed_params: int
    """Their parameters (one gather and one reduce-scatter each)."""
    head_norms: tuple[int, ...]
    """The per-head norms' weight elements."""
    row_bias_elements: tuple[int, ...]
    """The biases of transposed row layers (their gradients summed under sequence parallelism)."""
    norm_params: tuple[int, ...]
    """Elements of each parameter of the block's own norms."""
    norms: int
    """The block's own norms (modules)."""
    column_groups: int
    """Modules that hold column layers (the attention, the MLP): the column layers of one take the same input, so the
    sums of their input gradients come a matmul apart and wait once; under sequence parallelism each such module
    gathers the sequence at its entry."""
    experts: bool
    """An MoE layer whose experts split by expert."""

    @property
    def modules(self) -> int:
        """Modules a forward pass runs through DTensor: each split layer and per-head norm, and an MoE layer's three
        conversions (the input's gradient sum, the output's sum, the gate weights' gradient sum)."""
        return self.columns + self.rows + len(self.head_norms) + (3 if self.experts else 0)

    def sequence_parallel_modules(self) -> int:
        """Modules sequence parallelism adds: the norms, the gathering modules, an MoE layer's gather and cut."""
        return self.norms + self.column_groups + (2 if self.experts else 0)


@dataclass(frozen=True)
class SplitModel:
    """A Hugging Face decoder's tensor-parallel structure: each layer's, and what lies outside them."""

    layers: tuple[SplitLayer, ...]
    embedding_split: bool
    """Whether the embedding splits by vocabulary (GPT-2's; a head tied to it splits it too)."""
    final_norm_params: tuple[int, ...]
    final_norm_gathers: bool
    """GPT-2's final norm gathers the sequence (its model views the output by the whole length)."""


def split_model(config: HFDecoder) -> SplitModel:
    """``config``'s tensor-parallel structure (cached per model)."""
    return _split_model(config.model_type, config.fields)


@lru_cache(maxsize=16)
def _split_model(model_type: str, fields: str) -> SplitModel:
    from ..models.decoders import KNOWN_DECODERS
    from ..models.gpt2_plan import BLOCK_PLAN

    model = meta_model(model_type, fields)
    parts = KNOWN_DECODERS[model_type]
    if model_type == "gpt2":
        plan = dict(BLOCK_PLAN)
    else:
        # As the strategy reads the family's plan; the experts ("moe_tp_experts" and their stacked weights) split by
        # expert, whatever their styles.
        plan = {name: HF_STYLES.get(style, style) for name, style in hf_block_plan(model, model_type).items()}
    layers = tuple(_split_layer(layer, plan, transposed=model_type == "gpt2")
                   for layer in model.get_submodule(parts.blocks))
    norm = model.get_submodule(parts.norm)
    ties = bool(getattr(model.config, "tie_word_embeddings", False))
    return SplitModel(layers=layers, embedding_split=model_type == "gpt2" or ties,
                      final_norm_params=tuple(p.numel() for p in norm.parameters()),
                      final_norm_gathers=model_type == "gpt2")


def _split_layer(layer: object, plan: dict[str, str], *, transposed: bool) -> SplitLayer:
    present = {name: kind for name, kind in plan.items() if _has(layer, name)}
    experts = any(name == "mlp.experts" or name.startswith("mlp.experts.") for name in present)
    split = {name: kind for name, kind in present.items() if not name.startswith("mlp.experts")}
    columns = [name for name, kind in split.items() if kind in ("column", "packed_column")]
    rows = [name for name, kind in split.items() if kind == "row"]
    packed = [p.numel() for name, kind in split.items() if kind == "packed_column"
              for p in layer.get_submodule(name).parameters()]
    row_biases = tuple(layer.get_submodule(name).bias.numel() for name in rows
                       if transposed and getattr(layer.get_submodule(name), "bias", None) is not None)
    norm_modules = [child for _, child in layer.named_children() if type(child).__name__.endswith("Norm")]
    norms = tuple(p.numel() for child in norm_modules for p in child.parameters())
    return SplitLayer(columns=len(columns), rows=len(rows), packed_elements=sum(packed), packed_params=len(packed),
                      head_norms=tuple(layer.get_submodule(name).weight.numel() for name, kind in split.items()
                                       if kind == "heads"),
                      row_bias_elements=row_biases, norm_params=norms, norms=len(norm_modules),
                      column_groups=len({name.rpartition(".")[0] for name in columns} - {""}), experts=experts)


def _has(module: object, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


@dataclass
class Collectives:
    """Tensor-parallel collectives of one step: bytes, calls and waits by kind."""

    payload: dict[str, float]
    calls: dict[str, int]
    waits: dict[str, int]

    def add(self, kind: str, payload: float, calls: int, *, waits: int | None = None) -> None:
        self.payload[kind] = self.payload.get(kind, 0.0) + payload
        self.calls[kind] = self.calls.get(kind, 0) + calls
        self.waits[kind] = self.waits.get(kind, 0) + (calls if waits is None else waits)


def step_collectives(config: HFDecoder, layers: list[int], *, tokens: int, micro_batches: int, element_bytes: int,
                     residual_bytes: int, sequence_parallel: bool, forward_passes: int, first_stage: bool,
                     last_stage: bool, expert_parallel: int = 1) -> Collectives:
    """The tensor-parallel collectives one rank issues in one step over its ``layers`` (``tokens``: the rank's tokens
    in the step, over ``micro_batches``; a linear layer's output at ``element_bytes``, the residual stream and the
    parameters' gradients at ``residual_bytes``); see the module docstring for each. Under expert parallelism an
    MoE layer's experts run on the rows the all-to-all brought (``tokens x top_k`` on average, balanced), and its
    sums carry those."""
    model = split_model(config)
    out = Collectives({}, {}, {})
    m, f, e, p = micro_batches, forward_passes, element_bytes, residual_bytes
    # (T, d) over the step: a linear layer's output (and its gradient) at the activations' width; the residual stream
    # (and a norm's output, and their gradients) at the parameters' (mixed precision casts only inside the matmuls).
    hidden, residual = tokens * config.dim * e, tokens * config.dim * p
    expert_rows = tokens * (config.moe_top_k if expert_parallel > 1 else 1)
    for index in layers:
        layer = model.layers[index]
        out.add("all_reduce", layer.columns * residual, m * layer.columns, waits=m * layer.column_groups)
        if sequence_parallel:
            # Forward: each row layer's reduce-scatter meets the next module's gather (one wait for the pair).
            out.add("reduce_scatter", f * layer.rows * hidden, f * m * layer.rows)
            out.add("all_gather", f * layer.column_groups * residual, f * m * layer.column_groups,
                    waits=f * m * max(layer.column_groups - layer.rows, 0))
            out.add("all_gather", layer.rows * hidden, m * layer.rows)  # the rows' backward
            norms = layer.norm_params + layer.row_bias_elements
            out.add("all_reduce", sum(norms) * p, len(norms), waits=0)
        else:
            out.add("all_reduce", f * layer.rows * hidden, f * m * layer.rows)
        if layer.head_norms:
            out.add("all_reduce", sum(layer.head_norms) * p, len(layer.head_norms), waits=0)
        if layer.packed_params:
            out.add("all_gather", f * layer.packed_elements * p * m, f * m * layer.packed_params, waits=0)
            out.add("reduce_scatter", layer.packed_elements * p * m, m * layer.packed_params, waits=0)
        if layer.experts:  # the input and the combined output at the residual's width, the gate weights at theirs
            # (under expert parallelism the column the rows carried, at the rows' width)
            gates = tokens * config.moe_top_k * (p if expert_parallel > 1 else e)
            out.add("all_reduce", (f + 1) * expert_rows * config.dim * p + gates, m * (f + 2))
            if sequence_parallel:  # gathered after the attention's reduce-scatter (one wait); cut back
                out.add("all_gather", f * residual, f * m, waits=0)
                out.add("all_gather", residual, m)
    if sequence_parallel and first_stage:
        out.add("all_gather", residual, m)  # the first block's cut, in backward
    if last_stage:
        if sequence_parallel and model.final_norm_gathers:
            out.add("all_gather", residual, m)
        elif sequence_parallel:
            out.add("all_reduce", sum(model.final_norm_params) * p, len(model.final_norm_params), waits=0)
        if sequence_parallel and not model.final_norm_gathers:
            out.add("all_gather", residual, m)
            out.add("reduce_scatter", residual, m)
        else:
            out.add("all_reduce", residual, m)
        # The vocabulary-parallel loss (fp32), its three sums a few operators apart: one wait.
        out.add("all_reduce", 3 * 4 * tokens, 3 * m, waits=m)
    if first_stage and model.embedding_split:
        out.add("all_reduce", residual, m)
    return out


def module_passes(config: HFDecoder, layers: list[int], *, sequence_parallel: bool, first_stage: bool,
                  last_stage: bool) -> tuple[int, int]:
    """(modules in the layers, modules outside them) that one forward pass runs through DTensor."""
    model = split_model(config)
    inside = sum(model.layers[index].modules + (model.layers[index].sequence_parallel_modules()
                                                if sequence_parallel else 0) for index in layers)
    # The embedding split by vocabulary; the head, and under sequence parallelism the final norm and the first block's
    # cut of the sequence.
    ends = (int(first_stage and model.embedding_split) + int(last_stage) * (2 if sequence_parallel else 1)
            + int(first_stage and sequence_parallel))
    return inside, ends
