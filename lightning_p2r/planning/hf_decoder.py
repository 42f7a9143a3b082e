"""A Hugging Face decoder as the planner prices it: the recipe's ``hf_config`` read by ``transformers`` itself (its
defaults filled as ``CausalLMModule`` builds the model), its parameters listed from the model built on the meta
device (nothing allocated, any size), and its operators counted by running its own layer code once at a tiny width.

:class:`HFDecoder` answers the questions the cost model asks an ``M6Config`` (layers, blocks, MoE layers, attention
windows, experts, widths) for the families with a ready declaration (``models.decoders.KNOWN_DECODERS``): Llama,
Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE and GPT-2. What differs from M6 is priced from the model, not
assumed: grouped-query attention and explicit head widths (the projections' shapes), gated FFNs (three matrices),
biases and per-head norms (the parameter list), shared experts, the layers that stay dense, sliding windows, and the
fixed cost of a layer, which ``calibrate`` times for each family's layer kinds on the machine at a tiny width; a file
without them prices a layer from M6's by the operators its own code launches (:func:`layer_cost_scales`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

from ..models.hf_configs import read_hf_config
from .param_spec import ParamSpec

PRICED_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gpt2")
"""The ``model_type`` values ``lightning-p2r plan`` prices (those with a ready declaration)."""

_GPT2_NAMES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
               "max_position_embeddings": "n_positions"}


@dataclass(frozen=True)
class HFDecoder:
    """The sizes of a Hugging Face decoder the cost model reads (every layer its own block)."""

    model_type: str
    fields: str
    """The recipe's ``hf_config`` without ``model_type``, as sorted JSON (hashable, nested values kept): what a trial
    builds."""
    vocab_size: int
    max_seq_len: int
    num_layers: int
    dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_dim: int
    """A dense layer's FFN width (an MoE model's dense layers, where it has any)."""
    gated: bool
    """Whether the FFNs have a gate (SwiGLU: three matrices) or not (GPT-2: two)."""
    num_experts: int
    moe_top_k: int
    routed_hidden_dim: int
    shared_expert_dim: int
    """The width of the FFN every token also runs in an MoE layer (Qwen2-MoE's shared expert; 0 for none)."""
    moe_layer_indices: tuple[int, ...]
    windows: tuple[int | None, ...]
    """Each layer's sliding window (None: full causal attention)."""
    tie_embeddings: bool
    position_embedding: str
    grouped: bool
    """Whether the experts run as grouped matmuls (``transformers``' ``grouped_mm`` experts), else a loop."""
    residual_dropouts: int = 0
    """Dropouts in training on a layer's hidden states (GPT-2's two, ``resid_pdrop``; none in the Llama family)."""
    attention_dropout: float = 0.0
    """The probability with which the attention drops its probabilities in training (``attention_dropout``,
    GPT-2's ``attn_pdrop``)."""
    embedding_dropout: float = 0.0
    """GPT-2's dropout of the embeddings (``embd_pdrop``)."""
    params: tuple[ParamSpec, ...] = field(repr=False, compare=False, default=())

    # The M6Config questions the planner asks, answered for a model whose layers are each their own block.
    num_prototypes = 1

    @property
    def num_blocks(self) -> int:
        return self.num_layers

    @property
    def run_depth(self) -> int:
        return self.num_layers

    @property
    def layer_to_block(self) -> list[int]:
        return list(range(self.num_layers))

    def layers_of_block(self, block: int) -> list[int]:
        return [block]

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layer_indices

    def attention_window(self, layer: int) -> int | None:
        return self.windows[layer]

    @property
    def moe_layers(self) -> list[int]:
        return list(self.moe_layer_indices)

    @property
    def num_unique_experts(self) -> int:
        return self.num_experts

    @property
    def attention_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @cached_property
    def params_by_block(self) -> dict[int | None, list[ParamSpec]]:
        """``params`` by block (the search prices each layer of thousands of layouts)."""
        grouped: dict[int | None, list[ParamSpec]] = {}
        for spec in self.params:
            grouped.setdefault(spec.block, []).append(spec)
        return grouped

    def hf_config(self) -> dict[str, Any]:
        """The ``hf_config`` a ``CausalLMModule`` builds this model from."""
        return {"model_type": self.model_type, **json.loads(self.fields)}

    def describe(self) -> str:
        return f"Hugging Face {self.model_type}"


def hf_decoder_of(hf_config: dict[str, Any]) -> HFDecoder:
    """The :class:`HFDecoder` of a ``CausalLMModule`` ``hf_config`` (``model_type`` and the family's fields, the
    data's vocabulary already linked in). Raises ValueError naming a family the planner does not price or a field
    ``transformers`` refuses."""
    fields = dict(hf_config)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError("hf_config.model_type is missing (such as 'qwen3_moe')")
    if model_type not in PRICED_FAMILIES:
        raise ValueError(f"hf_config.model_type: `lightning-p2r plan` prices the Hugging Face families "
                         f"{', '.join(PRICED_FAMILIES)}, got {model_type!r}")
    try:
        items = json.dumps(fields, sort_keys=True)
    except TypeError as error:
        raise ValueError(f"hf_config: {error}") from None
    model = meta_model(model_type, items)
    sizes = _sizes(model_type, model.config)
    grouped = getattr(model.config, "_experts_implementation", None) not in (None, "eager")
    return HFDecoder(model_type=model_type, fields=items,
                     grouped=grouped and sizes["num_experts"] > 0, params=_param_specs(model, model_type),
                     **_dropouts(model, model_type), **sizes)


def _dropouts(model: Any, model_type: str) -> dict[str, Any]:
    """The dropouts training runs, from the built model: each layer's ``nn.Dropout`` modules with p > 0 on its hidden
    states (GPT-2's attention keeps its own, ``attn_dropout``, for the probabilities: the attention's rate, as the
    Llama family's ``attention_dropout``), and the embeddings' (GPT-2's ``drop``)."""
    from torch import nn

    from ..models.decoders import KNOWN_DECODERS

    parts = KNOWN_DECODERS[model_type]
    layer = model.get_submodule(parts.blocks)[0]
    residual = sum(isinstance(m, nn.Dropout) and m.p > 0 and not name.endswith("attn_dropout")
                   for name, m in layer.named_modules())
    config = model.config
    attention = float(getattr(config, "attn_pdrop" if model_type == "gpt2" else "attention_dropout", 0.0) or 0.0)
    embedding = float(getattr(config, "embd_pdrop", 0.0) or 0.0) if model_type == "gpt2" else 0.0
    return {"residual_dropouts": residual, "attention_dropout": attention, "embedding_dropout": embedding}


def _hf_config(model_type: str, fields: dict[str, Any]) -> Any:
    return read_hf_config(model_type, fields, "hf_config")


@lru_cache(maxsize=16)
def meta_model(model_type: str, items: str) -> Any:
    """The causal LM built on the meta device (shapes only: no memory, any size)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_hf_config(model_type, json.loads(items)))


def _sizes(model_type: str, config: Any) -> dict[str, Any]:
    def get(name: str, default: Any = None) -> Any:
        return getattr(config, _GPT2_NAMES.get(name, name) if model_type == "gpt2" else name, default)

    dim, layers, heads = get("hidden_size"), get("num_hidden_layers"), get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or dim // heads
    if model_type == "gpt2":
        hidden = config.n_inner or 4 * dim
    else:
        hidden = get("intermediate_size")
    experts = get("num_local_experts") or get("num_experts") or 0
    top_k = get("num_experts_per_tok") or 0
    routed = get("moe_intermediate_size") or (hidden if experts else 0)
    if experts:
        dense_only = set(get("mlp_only_layers") or ())
        step = get("decoder_sparse_step") or 1
        moe = tuple(layer for layer in range(layers) if layer not in dense_only and (layer + 1) % step == 0)
    else:
        moe = ()
    return {"vocab_size": get("vocab_size"), "max_seq_len": get("max_position_embeddings"), "num_layers": layers,
            "dim": dim, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "hidden_dim": hidden,
            "gated": model_type != "gpt2", "num_experts": experts, "moe_top_k": top_k, "routed_hidden_dim": routed,
            "shared_expert_dim": get("shared_expert_intermediate_size") or 0, "moe_layer_indices": moe,
            "windows": _windows(model_type, config, layers), "tie_embeddings": bool(config.tie_word_embeddings),
            "position_embedding": "learned" if model_type == "gpt2" else "rotary"}


def _windows(model_type: str, config: Any, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, as the family's attention reads the config."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    if model_type in ("mistral", "mixtral"):
        return (window,) * layers
    return (None,) * layers


def _param_specs(model: Any, model_type: str) -> tuple[ParamSpec, ...]:
    """Every parameter of ``model`` in the planner's terms: the root's under the planner's names (embedding,
    positions, final norm, head; a tied head once), each layer's as its block's, stacked expert weights owned by the
    experts (split by expert under tensor and expert parallelism, as the families' plans do), and the matrices the
    family's tensor-parallel plan splits (or GPT-2's, the package's plan) with a split dimension."""
    from ..models.decoders import KNOWN_DECODERS

    parts = KNOWN_DECODERS[model_type]
    blocks = model.get_submodule(parts.blocks)
    embed_names = {f"{parts.embed[0]}.weight": "tok_embeddings.weight"}
    if len(parts.embed) > 1:
        embed_names[f"{parts.embed[1]}.weight"] = "pos_embeddings.weight"
    embedding_split = model_type == "gpt2" or bool(getattr(model.config, "tie_word_embeddings", False))
    root: list[ParamSpec] = []
    for name, param in model.named_parameters():  # a tied head is the embedding's tensor: listed once
        if name.startswith(parts.blocks + "."):
            continue
        renamed = embed_names.get(name) or (f"lm_head.{name.rsplit('.', 1)[-1]}" if name.startswith(parts.head)
                                            else f"norm.{name.rsplit('.', 1)[-1]}" if name.startswith(parts.norm)
                                            else name)
        # The head splits by vocabulary; the embedding only where it is split with it (tied) or by the plan (GPT-2's):
        # a Llama's own embedding stays whole on every tensor-parallel rank.
        split = 0 if renamed == "lm_head.weight" or (renamed == "tok_embeddings.weight" and embedding_split) else None
        root.append(ParamSpec(renamed, tuple(param.shape), "root", tensor_dim=split))
    plan = hf_block_plan(model, model_type)
    specs: list[ParamSpec] = []
    for block, layer in enumerate(blocks):
        for name, param in layer.named_parameters():
            expert = ".experts." in f".{name}" and param.dim() == 3
            split = 0 if expert else _split_dim(name, param.dim(), model_type, plan)
            specs.append(ParamSpec(f"blocks.{block}.{name}", tuple(param.shape), "expert" if expert else "block",
                                   block, tensor_dim=split))
    return tuple(root + specs)


_GPT2_PLAN = {"attn.c_attn": "colwise", "mlp.c_fc": "colwise", "attn.c_proj": "rowwise", "mlp.c_proj": "rowwise"}
"""GPT-2 has no plan of its own: the package's (``models.gpt2_plan``), its ``Conv1D`` weights stored transposed."""


def _split_dim(name: str, dims: int, model_type: str, plan: dict[str, str]) -> int | None:
    """The dimension tensor parallelism splits (None: replicated), from the family's plan (``base_model_tp_plan``,
    whose ``layers.*.`` entries name a block's modules): column-wise weights and biases along their outputs, row-wise
    weights along their inputs; a module the plan leaves out (Qwen2-MoE's shared expert, the norms) stays whole."""
    module, _, kind = name.rpartition(".")
    style = plan.get(module, "")
    transposed = model_type == "gpt2"
    if style == "colwise":
        return 1 if transposed and dims == 2 else 0
    if style == "rowwise" and kind == "weight":
        return 0 if transposed else 1
    return None


def hf_block_plan(model: Any, model_type: str) -> dict[str, str]:
    """The family's tensor-parallel styles of a layer's modules, by name inside the layer."""
    if model_type == "gpt2":
        return _GPT2_PLAN
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    return {key.removeprefix("layers.*."): style for key, style in plan.items() if key.startswith("layers.*.")}


def layer_matmul_weights(config: HFDecoder, layer: int) -> tuple[int, int, int]:
    """One layer's (dense matrix elements, stacked expert elements, matrices): the 2-D weights every token multiplies
    (attention, FFN, router, shared expert) and the 3-D expert stacks a token multiplies ``top_k`` of."""
    dense = experts = matrices = 0
    for spec in _layer_params(config, layer):
        if spec.owner == "expert":
            experts += spec.numel
        elif len(spec.shape) == 2:
            dense += spec.numel
            matrices += 1
    return dense, experts, matrices


def _layer_params(config: HFDecoder, layer: int) -> list[ParamSpec]:
    return config.params_by_block.get(layer, [])


def layer_forward_flops(config: HFDecoder, layer: int, seq_len: int, attention_flops: float) -> float:
    dense, experts, _ = layer_matmul_weights(config, layer)
    routed = experts * config.moe_top_k / config.num_experts if config.num_experts else 0.0
    return 2 * (dense + routed) + attention_flops


def layer_activation_elements(config: HFDecoder, layer: int, *, tensor_parallel: int = 1,
                              sequence_parallel: bool = False) -> float:
    """Elements one token's pass through ``layer`` saves for backward: the two RMSNorms' inputs and outputs (in
    float32 inside the norm: counted twice), q, k, v before and after rotary and the attention output, then a gated
    FFN's input, gate, up, activation and product (GPT-2: input, pre- and post-GELU); an MoE layer: the router's
    probabilities and, per assignment, the gathered row and its gated hidden tensors, and the shared expert's."""
    d, t = config.dim, tensor_parallel
    ffn = 4 if config.gated else 2
    replicated = 8 * d
    split = 2 * config.attention_width + 4 * config.kv_width
    if config.is_moe_layer(layer):
        replicated += config.num_experts + config.moe_top_k * 2 * d
        split += config.moe_top_k * ffn * config.routed_hidden_dim + ffn * config.shared_expert_dim
    else:
        split += ffn * config.hidden_dim
    return replicated / (t if sequence_parallel else 1) + split / t


def layer_elementwise_elements(config: HFDecoder, layer: int) -> float:
    """Elements the non-matmul operators of one token's forward read and write: two RMSNorms (a float32 pass of
    square, mean, scale and weight: about four reads and writes of the row each), two residual adds, rotary on q and k
    (rotate-half, two products and a sum), the attention kernel's input and output, and the FFN's activation and
    gate product (an MoE layer: per assignment, plus routing's gathers and the combine)."""
    d = config.dim
    ffn = 5 if config.gated else 2
    elements = 2 * 8 * d + 2 * 3 * d + 8 * (config.attention_width + config.kv_width) + 2 * config.attention_width \
        + 2 * config.kv_width
    if config.is_moe_layer(layer):
        elements += 4 * config.num_experts + config.moe_top_k * (4 * d + ffn * config.routed_hidden_dim + 3 * d)
        elements += ffn * config.shared_expert_dim
    else:
        elements += ffn * config.hidden_dim
    return elements


def layer_matmuls(config: HFDecoder, layer: int) -> int:
    """Matmul calls of one layer's forward: each 2-D weight once, and the experts' two grouped matmuls (a loop: two
    per expert)."""
    _, _, matrices = layer_matmul_weights(config, layer)
    if not config.is_moe_layer(layer):
        return matrices
    return matrices + (2 if config.grouped else 2 * config.num_experts)


# --- fixed costs: operators counted on the model's own code ----------------------------------------------------------

TOKEN_PROBES = {"dense": "llama", "moe": "qwen3_moe"}
"""The families whose layers ``calibrate`` times at more tokens and a wider width for the per-token costs of every
Hugging Face layer of their kind (``Cluster.hf_dense_token_overhead`` and the rest)."""


def layer_kinds() -> list[tuple[str, bool]]:
    """(family, MoE) of every layer kind the planner prices: each family's dense layer (Mixtral has none) and the
    MoE families' MoE layer; ``calibrate`` times each (``Cluster.hf_layer_overheads``)."""
    return [(family, moe) for family in PRICED_FAMILIES for moe in (False, True)
            if (moe and family in MOE_FAMILIES) or (not moe and family != "mixtral")]


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def layer_kind_key(family: str, moe: bool) -> str:
    """The key of a layer kind in ``Cluster.hf_layer_overheads``."""
    return f"{family}:moe" if moe else family


def probe_hf_config(model_type: str, layers: int, *, moe: bool = True, shared_expert: bool = False,
                    experts: int = 4, width: int = 16) -> dict[str, Any]:
    """A tiny ``hf_config`` of ``model_type`` (by default width 16, two heads of 8 sharing one key/value head, 64
    words: the size of ``calibrate``'s M6 layer probe; ``width`` adds heads of 8): for counting a layer's operators
    and timing its costs. ``moe`` False makes a Qwen-MoE's layers dense (``mlp_only_layers``); ``shared_expert``
    gives Qwen2-MoE's layers one."""
    heads = width // 8
    config: dict[str, Any] = {"model_type": model_type, "vocab_size": 64}
    if model_type == "gpt2":
        # Its special tokens default to 50256, outside the probe's words (transformers warns of it).
        return config | {"n_embd": width, "n_layer": layers, "n_head": heads, "n_positions": 32, "bos_token_id": 0,
                         "eos_token_id": 0}
    config |= {"hidden_size": width, "num_hidden_layers": layers, "num_attention_heads": heads,
               "num_key_value_heads": max(heads // 2, 1), "head_dim": 8, "intermediate_size": width,
               "max_position_embeddings": 32}
    if model_type == "mixtral":
        config |= {"num_local_experts": min(experts, 4), "num_experts_per_tok": 2}
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        config |= {"num_experts": min(experts, 4), "num_experts_per_tok": 2, "moe_intermediate_size": width // 2,
                   "decoder_sparse_step": 1, "mlp_only_layers": [] if moe else list(range(layers))}
        if model_type == "qwen2_moe":
            config["shared_expert_intermediate_size"] = width if shared_expert else 0
    return config


def layer_cost_scales(config: HFDecoder, cluster: Any) -> tuple[float, float]:
    """Factors on ``cluster``'s measured M6 layer costs (``dense_layer_overhead``, ``moe_layer_overhead``) that give
    one dense and one MoE layer of ``config``: its family's layer as ``calibrate`` timed it
    (``Cluster.hf_layer_overheads``), times the ratio of ``config``'s operators to the timed probe's (a Qwen2-MoE
    without a shared expert launches fewer); a family the file lacks, M6's layer times the ratio of their operators
    (M6's operators cost more each than a Hugging Face layer's small elementwise ones: on a CPU a Llama layer then
    comes out about a third dearer than it is)."""
    dense_ops, moe_ops = hf_operators(config)
    m6_dense, m6_moe = _m6_operators("grouped" if cluster.accelerator == "cuda" else "loop")
    scales = [dense_ops / m6_dense, moe_ops / m6_moe if moe_ops else 0.0]
    for index, (moe, ops, m6_cost) in enumerate(((False, dense_ops, cluster.dense_layer_overhead),
                                                 (True, moe_ops, cluster.moe_layer_overhead))):
        timed = cluster.hf_layer_overheads.get(layer_kind_key(config.model_type, moe))
        if ops and timed and m6_cost > 0:
            probe = _hf_layer_operators(config.model_type, moe, config.model_type == "qwen2_moe", config.grouped, 4)
            scales[index] = timed * ops / probe / m6_cost
    return scales[0], scales[1]


def hf_operators(config: HFDecoder) -> tuple[int, int]:
    """Operators one dense and one MoE layer of ``config``'s family launch, forward and backward (views excluded),
    counted on its code at a tiny width (0 for a kind it has none of)."""
    kinds = (False, True) if config.num_experts else (False,)
    if config.num_experts and config.model_type == "mixtral":
        kinds = (True,)  # every Mixtral layer is MoE
    counts = {kind: _hf_layer_operators(config.model_type, kind, config.shared_expert_dim > 0, config.grouped,
                                        config.num_experts) for kind in kinds}
    dense = counts.get(False) or counts[True]
    return dense, counts.get(True, 0)


@lru_cache(maxsize=32)
def _hf_layer_operators(model_type: str, moe: bool, shared_expert: bool, grouped: bool, experts: int) -> int:
    def build(layers: int) -> Any:
        return build_probe(probe_hf_config(model_type, layers, moe=moe, shared_expert=shared_expert,
                                           experts=experts or 4), grouped)

    return _per_layer(build, lambda model, ids: model(input_ids=ids, use_cache=False).logits)


def build_probe(hf_config: dict[str, Any], grouped: bool = True) -> Any:
    """The causal LM of a probe config, its experts run grouped (``transformers``' default) or in a loop."""
    from transformers import AutoModelForCausalLM

    fields = dict(hf_config)
    model = AutoModelForCausalLM.from_config(_hf_config(fields.pop("model_type"), fields))
    if not grouped and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model


@lru_cache(maxsize=4)
def _m6_operators(kernel: str) -> tuple[int, float]:
    """Operators of ``calibrate``'s probe layers: a dense one, and an MoE one less its experts' (the per-expert part
    found from 2 and 4 experts, as ``calibrate`` fits ``moe_expert_overhead`` apart)."""
    from ..models.transformer import M6Transformer
    from .probes import probe_config

    def builder(experts: int) -> Any:
        return lambda layers: M6Transformer(probe_config(layers, experts).replace(expert_kernel=kernel))

    def run(model: Any, ids: Any) -> Any:
        out = model(ids)
        return out.logits + 0 * (out.aux_loss + out.z_loss)

    dense = _per_layer(builder(0), run)
    two, four = _per_layer(builder(2), run), _per_layer(builder(4), run)
    per_expert = 0 if kernel == "grouped" else (four - two) / 2
    return dense, two - 2 * per_expert


def _per_layer(build: Any, run: Any) -> int:
    """Operators (forward and backward, views excluded) a model of 2 layers launches beyond one of 1 layer."""
    import torch

    counts = []
    for layers in (1, 2):
        torch.manual_seed(0)
        model = build(layers)
        ids = torch.randint(0, 64, (2, 16))
        run(model, ids).float().sum().backward()  # warm: lazily built buffers (rotary tables) are not counted
        model.zero_grad(set_to_none=True)
        counts.append(_count_operators(lambda model=model, ids=ids: run(model, ids).float().sum().backward()))
    return max(counts[1] - counts[0], 1)


_VIEWS = frozenset({"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze",
                    "slice", "select", "detach", "alias", "as_strided", "split", "chunk", "unbind", "split_with_sizes",
                    "lift_fresh", "_reshape_alias"})


def _count_operators(step: Any) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Counting() as counting:
        step()
    return sum(n for name, n in counting.ops.items() if name not in _VIEWS)
