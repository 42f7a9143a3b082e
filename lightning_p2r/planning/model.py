"""What an M6 model is made of, counted from its :class:`~lightning_p2r.models.M6Config` alone: every parameter's
shape and how the strategy splits it, the FLOPs and the operator launches of one token's forward pass, and the
activations one token leaves for backward.

Pure arithmetic (no torch): the planner prices layouts of models far larger than any machine here.

Conventions, chosen to match what the package runs:

- A matmul of (m, k) by (k, n) is 2 m k n FLOPs; backward is twice the forward; recompute adds one forward of the
  blocks.
- Dense causal attention averages (s + 1) / 2 keys per query (a memory-efficient kernel skips the masked half); a
  banded layer ``min(window, s)`` at most, counted as the band's mean length.
- An MoE layer computes ``num_prototypes x moe_top_k`` expert assignments per token (one FFN while a single FFN is
  shared by every expert, before upcycling: ``routed_ffn_runs``; dropless; with a capacity
  factor fewer may be kept, so this is the upper bound the planner budgets for).
- Activations assume a memory-efficient attention kernel (no (s, s) score matrix is saved).
"""

from __future__ import annotations

from ..models.config import M6Config
from .hf_decoder import HFDecoder, hf_operators
from .hf_decoder import layer_activation_elements as hf_activation_elements
from .hf_decoder import layer_elementwise_elements as hf_elementwise_elements
from .hf_decoder import layer_forward_flops as hf_forward_flops
from .hf_decoder import layer_matmuls as hf_matmuls
from .param_spec import ParamSpec

PricedModel = M6Config | HFDecoder
"""What the planner prices: the package's M6 model, or a Hugging Face decoder of a family it counts."""


def block_params(config: M6Config, block: int) -> list[ParamSpec]:
    """The parameters of one unique block (the split dimensions follow ``M6Transformer.parallel_plan``)."""
    d, h, e = config.dim, config.hidden_dim, config.num_experts
    he = config.routed_hidden_dim
    prefix = f"blocks.{block}."
    specs = [ParamSpec(prefix + "attn_norm.weight", (d,), "block", block),
             ParamSpec(prefix + "attn_norm.bias", (d,), "block", block),
             ParamSpec(prefix + "attn.qkv.weight", (3 * d, d), "block", block, tensor_dim=0),
             ParamSpec(prefix + "attn.out.weight", (d, d), "block", block, tensor_dim=1),
             ParamSpec(prefix + "ffn_norm.weight", (d,), "block", block),
             ParamSpec(prefix + "ffn_norm.bias", (d,), "block", block)]
    if is_moe_block(config, block):
        specs += [ParamSpec(prefix + "ffn.router.weight", (e, d), "block", block),
                  ParamSpec(prefix + "ffn.experts.w_in", (e, d, he), "expert", block, tensor_dim=2),
                  ParamSpec(prefix + "ffn.experts.w_out", (e, he, d), "expert", block, tensor_dim=1)]
        if config.always_on_experts:
            always = config.always_on_experts * he
            specs += [ParamSpec(prefix + "ffn.always_on.fc_in.weight", (always, d), "block", block),
                      ParamSpec(prefix + "ffn.always_on.fc_out.weight", (d, always), "block", block)]
    else:
        specs += [ParamSpec(prefix + "ffn.fc_in.weight", (h, d), "block", block, tensor_dim=0),
                  ParamSpec(prefix + "ffn.fc_out.weight", (d, h), "block", block, tensor_dim=1)]
    return specs


def root_params(config: M6Config) -> list[ParamSpec]:
    """The parameters outside the blocks (a tied head shares the embedding: counted once)."""
    d = config.dim
    specs = [ParamSpec("tok_embeddings.weight", (config.vocab_size, d), "root", tensor_dim=0)]
    if config.position_embedding == "learned":
        specs.append(ParamSpec("pos_embeddings.weight", (config.max_seq_len, d), "root"))
    specs += [ParamSpec("norm.weight", (d,), "root"), ParamSpec("norm.bias", (d,), "root")]
    if not config.tie_embeddings:
        specs.append(ParamSpec("lm_head.weight", (config.vocab_size, d), "root", tensor_dim=0))
    return specs


def all_params(config: PricedModel) -> tuple[ParamSpec, ...]:
    """Every parameter, the root's first (memoized: the search prices thousands of layouts of one model)."""
    if isinstance(config, HFDecoder):
        return config.params
    key = repr(config)
    if key not in _PARAMS:
        _PARAMS[key] = tuple(root_params(config)) + tuple(p for block in range(config.num_blocks)
                                                          for p in block_params(config, block))
    return _PARAMS[key]


_PARAMS: dict[str, tuple[ParamSpec, ...]] = {}


def is_moe_block(config: PricedModel, block: int) -> bool:
    return config.is_moe_layer(config.layers_of_block(block)[0])


def parameter_count(config: PricedModel) -> int:
    """Unique parameters (a shared block counted once, a tied head not at all)."""
    return sum(p.numel for p in all_params(config))


def attended_keys(config: PricedModel, layer: int, seq_len: int) -> float:
    """Mean number of keys a query attends to in ``layer`` (causal, or banded)."""
    window = config.attention_window(layer)
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    # The first window - 1 queries see fewer keys than the band.
    ramp = window - 1
    return (ramp * (ramp + 1) / 2 + (seq_len - ramp) * window) / seq_len


def layer_attention_flops(config: PricedModel, layer: int, seq_len: int) -> float:
    """FLOPs of one token's attention scores and weighted sum in one layer's forward (the attention kernel's)."""
    width = config.attention_width if isinstance(config, HFDecoder) else config.dim
    return 2 * 2 * attended_keys(config, layer, seq_len) * width


def routed_ffn_runs(config: PricedModel) -> int:
    """Routed FFNs an MoE layer runs per token: one per assignment (``num_prototypes x moe_top_k``), or one when a
    single FFN is shared by every expert before upcycling (the layer weighs it by the token's gates; with tensor or
    expert parallelism it runs per assignment, which this count does not follow)."""
    return 1 if config.num_unique_experts == 1 else config.num_prototypes * config.moe_top_k


def layer_forward_flops(config: PricedModel, layer: int, seq_len: int) -> float:
    """FLOPs of one token through one layer's forward pass (matmuls, the attention kernel's included)."""
    if isinstance(config, HFDecoder):
        return hf_forward_flops(config, layer, seq_len, layer_attention_flops(config, layer, seq_len))
    d, h = config.dim, config.hidden_dim
    attention = 2 * 4 * d * d + layer_attention_flops(config, layer, seq_len)
    if config.is_moe_layer(layer):
        assignments = routed_ffn_runs(config) + config.always_on_experts
        ffn = 2 * d * config.num_experts + assignments * 2 * 2 * d * config.routed_hidden_dim
    else:
        ffn = 2 * 2 * d * h
    return attention + ffn


def head_forward_flops(config: PricedModel) -> float:
    """FLOPs of one token through the LM head (the embedding lookup is a gather, not a matmul)."""
    return 2 * config.dim * config.vocab_size


def head_elementwise_elements(config: PricedModel) -> float:
    """Elements the loss's forward reads and writes per token beyond the head's matmul: the log-softmax reads the
    logits and writes the log-probabilities, one row of the vocabulary each (backward moves about twice as much, as
    for a layer). On a CPU this was 7 ms of the quickstart's 103 ms step (2,048 words, 1,024 tokens), unpriced."""
    return 2 * config.vocab_size


def model_forward_flops(config: PricedModel, seq_len: int) -> float:
    """FLOPs of one token's forward pass through the whole model: the layers a forward runs (``run_depth``: a shallow
    pseudo model runs one layer per block until it grows) and the head."""
    return sum(layer_forward_flops(config, layer, seq_len) for layer in range(config.run_depth)) + \
        head_forward_flops(config)


def layer_activation_elements(config: PricedModel, layer: int, *, tensor_parallel: int = 1,
                              sequence_parallel: bool = False) -> float:
    """Elements one token's pass through ``layer`` saves for backward (no recompute): the norms' inputs and
    outputs, q, k, v and the attention output, then the FFN's input and hidden activations (an MoE layer: the router
    probabilities and, per assignment, the gathered row, the hidden pre- and post-activation and the output row).
    Tensor parallelism splits what lives per head or per hidden unit; sequence parallelism splits the rest too."""
    if isinstance(config, HFDecoder):
        return hf_activation_elements(config, layer, tensor_parallel=tensor_parallel,
                                      sequence_parallel=sequence_parallel)
    d, h, t = config.dim, config.hidden_dim, tensor_parallel
    replicated = 4 * d  # two norms' inputs and outputs
    split = 4 * d  # q, k, v, attention output
    if config.is_moe_layer(layer):
        assignments = routed_ffn_runs(config)
        replicated += config.num_experts + assignments * 2 * d
        split += (assignments + config.always_on_experts) * 2 * config.routed_hidden_dim
    else:
        split += 2 * h
    return (replicated / (t if sequence_parallel else 1)) + split / t


def layer_elementwise_elements(config: PricedModel, layer: int) -> float:
    """Elements the non-matmul operators of one token's forward through ``layer`` read and write (norms, residual
    adds, rotary, softmax outputs, GELU, routing gathers and scatters): the memory traffic priced at the device's
    memory bandwidth. Backward moves about twice as much."""
    if isinstance(config, HFDecoder):
        return hf_elementwise_elements(config, layer)
    d, h = config.dim, config.hidden_dim
    elements = 2 * 3 * d + 2 * 3 * d + 4 * d + 4 * d  # two norms, two residual adds, rotary on q and k, attention io
    if config.is_moe_layer(layer):
        assignments = routed_ffn_runs(config)
        routed_hidden = config.routed_hidden_dim
        elements += 4 * config.num_experts + assignments * (4 * d + 2 * routed_hidden + 3 * d)  # router, gather, GELU
        elements += config.always_on_experts * 2 * routed_hidden
    else:
        elements += 2 * h
    return elements


def layer_dropout_elements(config: PricedModel, seq_len: int) -> tuple[float, float]:
    """Per token of one layer's forward in training: the elements its dropouts on the hidden states draw a mask for
    (one per unit of the width each), and the attention probabilities a dropping attention materializes and draws one
    for (one per head and key of the causal square: on a CPU the fused kernel cannot drop them). M6 drops both at
    ``dropout`` (two on the hidden states); a Hugging Face model where its config says (``HFDecoder``)."""
    if isinstance(config, HFDecoder):
        residual, attention = config.residual_dropouts, config.attention_dropout
    else:
        residual, attention = (2 if config.dropout > 0 else 0), config.dropout
    return float(residual * config.dim), float(config.num_heads * seq_len if attention > 0 else 0)


def embedding_dropout_elements(config: PricedModel) -> float:
    """Elements per token the embeddings' dropout draws in training (GPT-2's ``embd_pdrop``; none in M6)."""
    return float(config.dim) if isinstance(config, HFDecoder) and config.embedding_dropout > 0 else 0.0


def grouped_experts(config: PricedModel, accelerator: str, precision: str) -> bool:
    """Whether the MoE layers run their experts as two grouped GEMMs (else a loop of two matmuls per expert): the
    model's ``expert_kernel``, where "auto" picks grouped on a CUDA device computing in bf16, as the layer does
    (``lightning_p2r.models.moe.resolve_expert_kernel``); a Hugging Face model's experts run as its family's code
    runs them."""
    if isinstance(config, HFDecoder):
        return config.grouped
    if config.expert_kernel != "auto":
        return config.expert_kernel == "grouped"
    return accelerator == "cuda" and precision in ("bf16-mixed", "bf16-true")


def looped_experts(config: PricedModel, local_experts: int | None) -> int:
    """Expert FFNs the loop kernel runs in one MoE layer: each expert the rank holds (``local_experts`` on an
    expert-parallel rank), or the one FFN they all share before upcycling."""
    experts = 1 if config.num_unique_experts == 1 else config.num_experts
    return experts if local_experts is None else min(local_experts, experts)


def layer_operator_launches(config: PricedModel, layer: int, local_experts: int | None = None, *,
                            grouped: bool = False) -> int:
    """Operators one layer's forward launches on any batch (the fixed per-call cost the device or the host's
    dispatcher pays); backward about twice as many. An MoE layer pays its routing bookkeeping and, with the loop
    kernel, two matmuls and a GELU per expert (``local_experts`` of them on an expert-parallel rank); the grouped
    kernel's launches do not grow with the experts. A Hugging Face layer: a third of the operators its forward and
    backward were counted to launch."""
    if isinstance(config, HFDecoder):
        dense, moe = hf_operators(config)
        return round((moe if config.is_moe_layer(layer) else dense) / 3)
    launches = 30
    if config.is_moe_layer(layer):
        launches += 40 + (6 if grouped else 4 * looped_experts(config, local_experts))
    return launches


def layer_matmuls(config: PricedModel, layer: int, local_experts: int | None = None, *, grouped: bool = False) -> int:
    """Matmul calls of one layer's forward (backward runs two per forward matmul: the input's and the weight's
    gradient): attention's qkv and output projections, then a dense FFN's two, or the router's one and two per
    expert the rank computes (``local_experts`` on an expert-parallel rank; two in all with the grouped kernel)."""
    if isinstance(config, HFDecoder):
        return hf_matmuls(config, layer)
    if config.is_moe_layer(layer):
        return 2 + 1 + (2 if grouped else 2 * looped_experts(config, local_experts))
    return 4


def pseudo_of(config: PricedModel, depth: str | None = None) -> PricedModel:
    """The pseudo model of ``config`` (M6-10T): the fewest shared blocks it allows. One block, unless MoE and dense
    layers alternate, which then share one block of each kind in a cycle. ``depth`` (default: the config's
    ``pseudo_depth``) "shallow" gives the shallow pseudo model of issue 30, which runs only its blocks, one layer
    each (so the planner CLI and the projections price it when the config asks for it). A Hugging Face model is
    priced as given (``CausalLMModule``'s sharing is not priced)."""
    if isinstance(config, HFDecoder):
        return config
    depth = config.pseudo_depth if depth is None else depth
    layouts = ("cycle",) if depth == "shallow" else ("sequence", "cycle")
    for blocks in (b for b in range(1, config.num_layers + 1) if config.num_layers % b == 0):
        for sharing in layouts:
            try:
                return config.replace(num_unique_blocks=blocks, sharing=sharing, pseudo_depth=depth)
            except ValueError:
                continue
    return config


def as_run(config: PricedModel) -> PricedModel:
    """The model a forward pass runs. A shallow pseudo model (``pseudo_depth="shallow"``) of U blocks runs U layers,
    block i at layer i: it is priced as the real model of depth U (about U / num_layers of the real step's layer
    compute and activations, and the U blocks' parameters). Any other config is returned as it is: a shared-depth
    pseudo model runs every layer."""
    if isinstance(config, HFDecoder) or config.pseudo_depth != "shallow" or config.num_blocks == config.num_layers:
        return config
    blocks = config.num_blocks
    moe_layers = None if config.moe_layers is None else [layer for layer in range(blocks) if config.is_moe_layer(layer)]
    return config.replace(num_layers=blocks, num_unique_blocks=None, pseudo_depth="shared", sharing="sequence",
                          moe_layers=moe_layers)
