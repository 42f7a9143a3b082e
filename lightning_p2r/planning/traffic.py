"""Bytes each tensor / expert parallel collective moves in one training step, from the model's sizes (analytic).

Counted the way :class:`~lightning_p2r.strategy.accounting.CollectiveCounter` counts them: an all-reduce's payload
is the tensor reduced, a gather's the whole tensor assembled, an all-to-all's what this rank sends. (A ring
all-reduce then puts about ``2 (n - 1) / n`` times its payload on each rank's link, an all-gather ``(n - 1) / n``.)
One forward and one backward of ``tokens`` tokens per rank; with recompute (``forward_passes=2``) the layers'
forward runs twice, and every collective a layer's forward issues moves again (the embedding, the head and the
loss are not recomputed, and nothing of the backward repeats).

Under mixed precision a row-parallel layer's output and its gradient are bf16 (``element_bytes``), while the residual
stream, a norm's output and their gradients stay at the parameters' width (``residual_bytes``, fp32): the sums of a
column-parallel layer's input gradient, the embedding's output, the head's input, the sequence parallel gathers of a
norm's output, an MoE layer's input and its experts' input gradients move 4 bytes an element (counted on gloo runs
under ``bf16-mixed``: tests/distributed/test_mixed_precision_counts.py). Below, ``x dim`` counts elements at the
width of what moves.

Tensor parallel (Megatron-LM's f and g: one all-reduce of (tokens, dim) in forward where a row-parallel layer
ends, one in backward where a column-parallel layer begins):

- every layer's attention, and every dense FFN: 2 x tokens x dim,
- every MoE layer: 2 x rows x dim, rows = the assignments the rank computes (tokens x prototypes x top_k when
  dropless, without expert parallelism),
- the vocabulary-parallel embedding (forward) and the head's input (backward): 2 x tokens x dim,
- with sequence parallelism, every one of those activation all-reduces becomes a reduce-scatter plus an
  all-gather of tokens x dim, an MoE layer adds an all-gather in forward and one in backward (it gathers the
  sequence and cuts its output back), and the norms' weight gradients are all-reduced once per step
  (4 x dim per block plus 2 x dim for the final norm, in a model whose blocks are not shared and with standard
  accumulation),
- the vocabulary-parallel cross-entropy (loss parallel): 3 x tokens (the maximum, the sum of exponentials and the
  target logit, fp32, forward only); without loss parallel, the logits gathered whole instead: an all-gather of
  tokens x vocab.

Expert parallel, per MoE layer: the counts (num_experts int64), then the rows out to their experts and back, in
forward and in backward: 2 x (tokens x k + received) x dim. Over an expert group the received rows sum to the sent
ones, so the group's mean is 4 x tokens x k x dim + 8 x num_experts, in 5 all-to-alls per micro-batch (forward:
the counts, the rows out, the rows back; backward: the two exchanges of rows reversed).

Data parallel (FSDP2 over the data ranks), from the bytes of the parameter parts (after the tensor / expert split)
that more than one data rank holds, per FSDP2 unit: the replicate mode all-reduces their gradients once; ZeRO-2
gathers them once (forward) and reduce-scatters the gradients once; ZeRO-3 gathers each block (and each experts
unit) again in backward, while the root unit (embedding, final norm, head) stays gathered from forward to backward.

Gradient clipping (``gradient_clip_val``) under tensor / expert parallelism: one all-reduce of the 8-byte sum of
squares (``parallel/clipping.py``) per step.

The balance loss over all data ranks, per MoE layer: the router probabilities' sums, the counts and the token count
packed in one float64 all-reduce in forward, and its gradient in backward: 2 x 8 x (2 x num_experts + 1) bytes in 2
all-reduces; on gloo (a CPU cluster) a sum of at most ``GATHERED_SUM_BYTES`` is an all-gather of every rank's
tensor and a local sum (``strategy/parallel/differentiable.py``), whose payload is the ranks times the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    """What one rank runs in one step."""

    tokens: int
    """Tokens this rank processes (its data shard: batch x sequence)."""
    dim: int
    vocab_size: int
    num_layers: int
    """Layer applications (a shared block counts once per layer it runs)."""
    moe_layers: int
    num_experts: int
    assignments_per_token: int
    """num_prototypes x moe_top_k."""
    element_bytes: int = 4
    num_blocks: int | None = None
    """Unique blocks (the norms' weights are per block); None: one per layer."""
    residual_bytes: int | None = None
    """Bytes per element of the residual stream, a norm's output and parameter gradients: the parameters' (fp32
    under mixed precision, where only a linear layer's output and its gradient are at ``element_bytes``); None: the
    same as ``element_bytes``."""

    @property
    def stream_bytes(self) -> int:
        return self.element_bytes if self.residual_bytes is None else self.residual_bytes


def tensor_parallel_bytes(shape: StepShape, tensor_parallel: int, *, moe_rows_per_layer: float | None = None,
                          loss_parallel: bool = True, sequence_parallel: bool = False, first_stage: bool = True,
                          last_stage: bool = True, forward_passes: int = 1) -> dict[str, float]:
    """{"all_reduce": ..., "all_gather": ...} of tensor parallelism in one step (zero without it).
    ``moe_rows_per_layer``: the rows an MoE layer computes on this rank (default tokens x k, dropless).
    ``loss_parallel``: the loss is computed from the logits' vocabulary shards (else they are gathered).
    ``first_stage`` / ``last_stage``: this rank runs the embedding / the final norm, head and loss (a pipeline's
    middle ranks run neither). ``forward_passes``: 2 under recompute (the layers' forward collectives again)."""
    if tensor_parallel == 1:
        return {"all_reduce": 0.0, "all_gather": 0.0}
    b, p, t, d, f = shape.element_bytes, shape.stream_bytes, shape.tokens, shape.dim, forward_passes
    rows = shape.tokens * shape.assignments_per_token if moe_rows_per_layer is None else moe_rows_per_layer
    dense_ffn = shape.num_layers - shape.moe_layers
    ends = int(first_stage) + int(last_stage)  # the embedding's output, the head's input
    split = t * d * (shape.num_layers + dense_ffn)  # elements: one per row layer's output, one per column's input
    # A row layer's output (recompute sums it again) at the activations' width; a column layer's input gradient, the
    # embedding's output and the head's input at the residual stream's. An MoE layer's experts: their partial outputs
    # (forward, again under recompute) and their input gradients (backward), over the rows they compute.
    row_sums, column_sums, end_sums = f * split * b, split * p, ends * t * d * p
    experts = rows * d * shape.moe_layers * (f * b + p)
    loss = 3 * 4 * t if last_stage else 0
    if sequence_parallel:
        # Each activation all-reduce becomes a reduce-scatter and an all-gather of the same (tokens, dim): a row
        # layer's output reduce-scattered and its gradient gathered, a column layer's input (a norm's output)
        # gathered and its gradient reduce-scattered; an MoE layer gathers its input (forward, again under recompute)
        # and cuts its output (its gradient gathered in backward), both at the residual stream's width.
        blocks = shape.num_layers if shape.num_blocks is None else shape.num_blocks
        norms = p * (4 * d * blocks + (2 * d if last_stage else 0))  # the norms' weight and bias gradients, once
        moe_gathers = t * d * shape.moe_layers * (f + 1) * p
        gathers = f * split * p + split * b + end_sums + moe_gathers
        return {"all_reduce": float(experts + loss + norms), "all_gather": float(gathers),
                "reduce_scatter": float(row_sums + column_sums + end_sums)}
    activations = row_sums + column_sums + end_sums
    if loss_parallel:
        return {"all_reduce": float(activations + experts + loss), "all_gather": 0.0}
    return {"all_reduce": float(activations + experts),
            "all_gather": float(b * t * shape.vocab_size) if last_stage else 0.0}


def expert_parallel_bytes(shape: StepShape, expert_parallel: int, micro_batches: int = 1,
                          forward_passes: int = 1, *, rows_back_bytes: int | None = None,
                          sent_columns: int = 0) -> dict[str, float]:
    """{"all_to_all": ...}: an expert group's mean per rank in one step (zero without expert parallelism); the
    counts are exchanged once per micro-batch and forward pass (``forward_passes``: 2 under recompute).
    ``rows_back_bytes``: the width of the experts' output rows (default the activations': M6's experts compute in
    bf16 under mixed precision; a Hugging Face MoE's write into an fp32 buffer of the hidden states' dtype);
    ``sent_columns``: elements each row carries out beyond the width (a Hugging Face MoE's gate weight)."""
    if expert_parallel == 1:
        return {"all_to_all": 0.0}
    # Rows out (a norm's output: the residual stream's width) and back, in each forward, and their gradients the
    # other way in backward.
    rows = shape.tokens * shape.assignments_per_token
    back = shape.element_bytes if rows_back_bytes is None else rows_back_bytes
    per_row = (shape.dim + sent_columns) * shape.stream_bytes + shape.dim * back
    per_layer = ((1 + forward_passes) * rows * per_row
                 + 8 * shape.num_experts * micro_batches * forward_passes)
    return {"all_to_all": float(per_layer * shape.moe_layers)}


GATHERED_SUM_BYTES = 64 << 10
"""The largest sum over a gloo group the strategy gathers instead of all-reducing (the strategy's own constant,
``strategy.parallel.differentiable.GATHERED_SUM_BYTES``; a test keeps them equal)."""


def balance_loss_bytes(shape: StepShape, data_parallel: int, forward_passes: int = 1,
                       gloo: bool = False) -> dict[str, float]:
    """{"all_reduce": ...} of the balance loss over all data ranks in one step (zero on one data rank), or
    {"all_gather": ...} where ``gloo`` gathers its small sums; ``forward_passes``: 2 under recompute."""
    if data_parallel == 1:
        return {"all_reduce": 0.0}
    per_call = 8 * (2 * shape.num_experts + 1)
    total = float(per_call * (forward_passes + 1) * shape.moe_layers)
    if gloo and per_call <= GATHERED_SUM_BYTES:
        return {"all_gather": data_parallel * total}
    return {"all_reduce": total}


def data_parallel_bytes(mode: str, *, block_bytes: float, root_bytes: float) -> dict[str, float]:
    """{"all_reduce", "all_gather", "reduce_scatter": ...} of FSDP2 in one step in ``mode`` ("replicate", "zero2"
    or "zero3", as ``layout.fsdp_mode_for`` names them): ``block_bytes`` are the blocks' (and experts') parameter
    bytes held by more than one data rank, ``root_bytes`` those of the parameters outside the blocks."""
    total = block_bytes + root_bytes
    if mode == "replicate":
        return {"all_reduce": total, "all_gather": 0.0, "reduce_scatter": 0.0}
    if mode == "zero2":
        return {"all_reduce": 0.0, "all_gather": total, "reduce_scatter": total}
    if mode == "zero3":
        return {"all_reduce": 0.0, "all_gather": 2 * block_bytes + root_bytes, "reduce_scatter": total}
    raise ValueError(f"the FSDP2 mode must be 'replicate', 'zero2' or 'zero3', got {mode!r}")


def clipping_bytes(clipping: bool) -> dict[str, float]:
    """{"all_reduce": ...} of gradient-norm clipping in one step under tensor / expert parallelism."""
    return {"all_reduce": 8.0 if clipping else 0.0}
