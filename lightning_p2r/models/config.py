"""The one typed configuration of the M6 transformer.

Every field has a docstring right under it: jsonargparse (LightningCLI) turns them into ``--help`` text and YAML
comments, and ``docs/configuration.md`` is generated from them (``python -m lightning_p2r.cli.docs``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

AttentionPattern = Literal["dense", "alternating", "local"]
SharingLayout = Literal["sequence", "cycle"]
PositionEmbedding = Literal["rotary", "learned"]
PseudoDepth = Literal["shared", "shallow"]
GrowthInit = Literal["copy", "zero_outputs"]
UpcycleRouter = Literal["keep", "reinit"]
ExpertKernel = Literal["auto", "grouped", "loop"]
AttentionKernel = Literal["auto", "masked", "chunked", "flex"]
RouterBalance = Literal["aux_loss", "bias"]


def _choice(name: str, value: object, allowed: tuple[object, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"M6Config.{name} must be one of {list(allowed)}, got {value!r}")


def _at_least(name: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ValueError(f"M6Config.{name} must be >= {minimum}, got {value!r}")


def sharing_map(num_layers: int, num_blocks: int, layout: str) -> list[int]:
    """The block each of ``num_layers`` layers runs when ``num_blocks`` blocks are shared in ``layout``."""
    if layout == "cycle":
        return [layer % num_blocks for layer in range(num_layers)]
    group = num_layers // num_blocks
    return [layer // group for layer in range(num_layers)]


@dataclass(kw_only=True)
class M6Config:
    """Shape and behaviour of an M6 Mixture-of-Experts decoder (M6, M6-T, M6-10T)."""

    vocab_size: int = 4096
    """Number of token ids the embedding and the LM head cover (at least the tokenizer's vocabulary)."""

    max_seq_len: int = 128
    """Longest sequence the model accepts; sizes the learned position table."""

    num_layers: int = 4
    """Depth: how many decoder layers a token passes through."""

    num_unique_blocks: int | None = None
    """Distinct sets of block weights. 1 is the fully shared "pseudo" model of M6-10T, ``num_layers`` (or None) the
    "real" model; values between share each block among several layers, as ``sharing`` says. Must divide
    num_layers."""

    sharing: SharingLayout = "sequence"
    """How layers share the unique blocks: "sequence" gives each block a run of consecutive layers (1,1,2,2,3,3);
    "cycle" runs the blocks in turn through the depth (1,2,3,1,2,3), as stacking studies found better. Delinking
    keeps the layout: each new block copies the old block its layers ran."""

    pseudo_depth: PseudoDepth = "shared"
    """Depth of the pseudo model (issue 30). "shared": every one of num_layers layers runs, sharing the blocks (M6-10T:
    sharing saves memory, not compute). "shallow": while the model has fewer blocks than layers it runs only
    num_unique_blocks layers, block i at layer i, so a step costs about num_unique_blocks / num_layers of the real
    step; delinking *grows* it (staged: U -> 2U -> ... -> num_layers), layer i running a copy of block i mod U.
    Growth changes the function (the model gets deeper) unless ``growth_init`` is "zero_outputs". Needs
    sharing="cycle"."""

    growth_init: GrowthInit = "copy"
    """How the layers a shallow pseudo model gains at delinking start: "copy" (exact copies of the blocks they
    cycle to: the function changes), or "zero_outputs" (the copies' attention output and FFN / expert output
    projections are zero, so each new layer adds nothing to the residual stream and the loss is unchanged at
    growth; their optimizer state starts fresh)."""

    num_unique_experts: int | None = None
    """Distinct expert FFNs per MoE layer. None (or num_experts) gives each expert its own; 1 makes all experts of
    a layer run one shared FFN (the memory and optimizer state of one expert), and delinking upcycles them into
    num_experts copies (Komatsuzaki et al. 2022, sparse upcycling); expert e runs FFN e mod num_unique_experts.
    Must divide num_experts. Expert parallelism keeps a shared FFN whole on every rank until upcycling splits the
    copies; tensor parallelism over shared experts is refused: upcycle first."""

    upcycle_router: UpcycleRouter = "keep"
    """At upcycling, keep the router as trained ("keep": with upcycle_noise=0 every expert is the same FFN, so the
    function is unchanged) or draw it afresh from the init ("reinit")."""

    upcycle_noise: float = 0.0
    """At upcycling, Gaussian noise of this standard deviation relative to each expert tensor's RMS on every expert
    copy, to break their symmetry (0: exact copies)."""

    upcycle_drop: float = 0.0
    """Drop-Upcycling (Nakamura et al., ICLR 2025): at upcycling, re-draw this fraction of every expert copy's hidden
    units (their input-projection columns and output-projection rows) from a normal distribution with the shared
    FFN's mean and standard deviation, so the experts start diverse; the paper uses 0.5 (0: exact copies). The
    re-drawn units keep the shared FFN's optimizer state, like the rest of the copy."""

    dim: int = 128
    """Hidden size of the residual stream."""

    num_heads: int = 4
    """Attention heads; must divide dim."""

    ffn_hidden_dim: int | None = None
    """Hidden size of a dense FFN and of each expert; None means 4 * dim."""

    dropout: float = 0.0
    """Dropout on attention probabilities and on the residual branches."""

    position_embedding: PositionEmbedding = "rotary"
    """How positions enter: rotary (RoPE on queries and keys) or a learned absolute table."""

    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""

    attention: AttentionPattern = "dense"
    """Attention pattern: dense causal everywhere; "alternating" dense and locally banded sparse layers as in GPT-3
    (even layers dense, odd layers banded); or "local" banded in every layer."""

    sparse_window: int = 64
    """Band width of the locally banded attention: a query attends to itself and the window - 1 tokens before it."""

    attention_kernel: AttentionKernel = "auto"
    """How banded layers attend (dense layers always use the fused causal kernel): "masked" (fused kernel, dense
    band mask), "chunked" (cost seq_len x window), "flex" (``flex_attention`` with a block mask, compiled; no
    backward on CPU, no attention dropout), or "auto": on CPU the rule measured there (chunked once the band is
    under half the causal keys), on an accelerator the fastest of the three timed once per shape in the process."""

    tie_embeddings: bool = True
    """Share the token embedding matrix with the LM head."""

    norm_eps: float = 1e-5
    """Epsilon of the LayerNorms."""

    init_std: float = 0.02
    """Standard deviation of the normal weight init; residual output projections get a smaller one, as
    ``residual_init`` says."""

    residual_init: Literal["depth", "applications", "blocks"] = "depth"
    """Std of the residual output projections (attention out, FFN out, experts' w_out), by what it counts: "depth"
    std / sqrt(2 * num_layers) (GPT-2; every layer adds two branches); "applications" std / sqrt(2 * num_layers * g)
    with g = num_layers / num_unique_blocks (1 for a shallow pseudo model: its blocks run once), for a shared block
    whose g applications add correlated, not independent, branches to the residual stream (equal to "depth" for the
    real model); "blocks" std / sqrt(2 * num_unique_blocks), treating a shared block as one layer. Only the init
    differs: delinking copies weights."""

    init_seed: int | None = None
    """Seed of the weight init. Each parameter's initial value is drawn from a generator seeded by (init_seed, the
    parameter's name), so the same seed gives bit-identical weights however the model is built and placed (eagerly,
    on the meta device then materialized, block by block, sharded over ranks or offloaded to host memory). None
    draws the seed from torch's global generator when the model is built (``seed_everything`` then decides it;
    P2RStrategy hands rank 0's draw to every rank)."""

    moe_layers: list[int] | None = None
    """Layers whose FFN is a Mixture of Experts; None means every layer, [] a dense model. Layers that share a
    block must agree (a shared block is either MoE or dense)."""

    num_experts: int = 8
    """Experts in each MoE layer."""

    moe_top_k: int = 1
    """Experts each token picks (token-choice top-k); with prototyping, picks inside each prototype. Gates are the
    router's softmax probabilities, renormalized over the k picks only with ``normalize_gates``."""

    normalize_gates: bool = False
    """With ``moe_top_k > 1``: divide each token's k gates (per prototype) by their sum, so they add up to 1 as in
    GShard and Mixtral. False keeps the raw softmax probabilities (Switch's convention; at k = 1 the two differ:
    a normalized single gate is always 1, which stops the router learning from the expert output)."""

    num_prototypes: int = 1
    """M6-T expert prototyping: experts are split into this many equal groups, each routes top-k on its own and the
    gated outputs are summed. 1 is plain top-k routing; k with moe_top_k=1 is M6-T's "k top-1"."""

    capacity_factor: float | None = 1.25
    """Each expert takes at most capacity_factor * (its fair share of the token assignments); assignments beyond
    that are dropped and pass through on the residual. Priority is by position across the batch (every sequence's
    position 0, then position 1, ...), so dropping stays causal in every sequence and spreads evenly over the batch.
    None means dropless (no token is ever dropped)."""

    router_aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss of each MoE layer; the layers' weighted losses are summed, as in
    Switch Transformer (0.01 there) and ST-MoE, so the value means what the papers' does whatever the depth."""

    router_z_loss_coef: float = 0.001
    """Weight of the router z-loss (ST-MoE, 0.001 there) of each MoE layer: mean squared log-sum-exp of the router
    logits, summed over MoE layers like the balancing loss."""

    router_jitter: float = 0.0
    """Multiplicative uniform noise on the router input during training (Switch): the input times a factor drawn
    from [1 - router_jitter, 1 + router_jitter], which stays positive because router_jitter must be below 1; 0 turns
    it off."""

    expert_hidden_dim: int | None = None
    """Hidden size of each routed expert; None uses the FFN's (``ffn_hidden_dim``). Fine-grained experts
    (DeepSeek-MoE) split each expert m ways: ``expert_hidden_dim = hidden / m``, ``num_experts`` and ``moe_top_k``
    times m, the same active compute spread over more, smaller experts."""

    always_on_experts: int = 0
    """Experts every token runs beside its routed ones: DeepSeek-MoE's "shared experts" (named apart here from
    ``num_unique_experts``' experts that share one FFN). Every token runs one dense GELU MLP of hidden
    ``always_on_experts * expert hidden`` whose output is added to the routed experts' with weight 1. 0: none.
    Tensor and expert parallelism refuse it for now."""

    router_balance: RouterBalance = "aux_loss"
    """How routing is balanced. "aux_loss": the Switch load-balancing loss (``router_aux_loss_coef``). "bias":
    auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the router's probabilities for choosing
    the top-k only (the gates stay the probabilities), moves by ``router_bias_rate`` after every optimizer step,
    up for the experts loaded below the mean, down for those above, from the load of the whole step (every
    micro-batch and every process). The bias is a buffer: checkpoints carry it. The aux loss is still computed and
    logged; set ``router_aux_loss_coef=0`` to train without it, as DeepSeek-V3 nearly does."""

    router_bias_rate: float = 0.001
    """"bias" balancing: how far each expert's bias moves per optimizer step (DeepSeek-V3's gamma, 0.001)."""

    expert_kernel: ExpertKernel = "auto"
    """How the experts' matmuls run. "grouped": one ``torch._grouped_mm`` per projection over the rows sorted by
    expert, with the segment offsets on the device (no host synchronization; bf16 on CUDA). "loop": two matmuls per
    expert over its segment, sizes read on the host once per layer. "auto" takes "grouped" on a CUDA device computing
    in bf16 and "loop" elsewhere: on CPU the loop measured 10-20% faster at dim 256 x hidden 1024 (docs/performance.md).
    Both give the same outputs within the compute dtype's rounding."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "num_layers", "dim", "num_heads", "num_experts", "moe_top_k",
                     "num_prototypes", "sparse_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"M6Config.{name} must be an integer, got {value!r}")
            _at_least(name, value, 1)
        if self.num_unique_blocks is not None:
            _at_least("num_unique_blocks", self.num_unique_blocks, 1)
        if self.num_layers % self.num_blocks:
            raise ValueError(
                f"M6Config.num_unique_blocks ({self.num_unique_blocks}) must divide num_layers ({self.num_layers})"
            )
        if self.dim % self.num_heads:
            raise ValueError(f"M6Config.num_heads ({self.num_heads}) must divide dim ({self.dim})")
        if self.position_embedding == "rotary" and (self.dim // self.num_heads) % 2:
            raise ValueError(f"M6Config.position_embedding='rotary' needs an even head size, got {self.head_dim}")
        if self.ffn_hidden_dim is not None:
            _at_least("ffn_hidden_dim", self.ffn_hidden_dim, 1)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"M6Config.dropout must be in [0, 1), got {self.dropout!r}")
        _choice("position_embedding", self.position_embedding, ("rotary", "learned"))
        _choice("attention", self.attention, ("dense", "alternating", "local"))
        _choice("sharing", self.sharing, ("sequence", "cycle"))
        _choice("pseudo_depth", self.pseudo_depth, ("shared", "shallow"))
        _choice("growth_init", self.growth_init, ("copy", "zero_outputs"))
        _choice("upcycle_router", self.upcycle_router, ("keep", "reinit"))
        _choice("expert_kernel", self.expert_kernel, ("auto", "grouped", "loop"))
        _choice("attention_kernel", self.attention_kernel, ("auto", "masked", "chunked", "flex"))
        _choice("router_balance", self.router_balance, ("aux_loss", "bias"))
        if self.expert_hidden_dim is not None:
            _at_least("expert_hidden_dim", self.expert_hidden_dim, 1)
        if not isinstance(self.always_on_experts, int) or isinstance(self.always_on_experts, bool):
            raise ValueError(f"M6Config.always_on_experts must be an integer, got {self.always_on_experts!r}")
        _at_least("always_on_experts", self.always_on_experts, 0)
        if self.router_bias_rate < 0:
            raise ValueError(f"M6Config.router_bias_rate must be >= 0, got {self.router_bias_rate!r}")
        if self.pseudo_depth == "shallow" and self.sharing != "cycle":
            raise ValueError("M6Config.pseudo_depth='shallow' grows layer i from block i mod num_unique_blocks: "
                             "set sharing='cycle'")
        if not 0.0 <= self.upcycle_noise < 1.0:
            raise ValueError(f"M6Config.upcycle_noise must be in [0, 1), got {self.upcycle_noise!r}")
        if not 0.0 <= self.upcycle_drop <= 1.0:
            raise ValueError(f"M6Config.upcycle_drop must be in [0, 1], got {self.upcycle_drop!r}")
        _choice("residual_init", self.residual_init, ("depth", "applications", "blocks"))
        if self.rope_theta <= 0:
            raise ValueError(f"M6Config.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.norm_eps <= 0:
            raise ValueError(f"M6Config.norm_eps must be > 0, got {self.norm_eps!r}")
        if self.init_std <= 0:
            raise ValueError(f"M6Config.init_std must be > 0, got {self.init_std!r}")
        if self.init_seed is not None and (not isinstance(self.init_seed, int) or isinstance(self.init_seed, bool)
                                           or self.init_seed < 0):
            raise ValueError(f"M6Config.init_seed must be a non-negative integer or None, got {self.init_seed!r}")
        self._validate_moe()

    def _validate_moe(self) -> None:
        if self.moe_layers is not None:
            bad = [layer for layer in self.moe_layers if not 0 <= layer < self.num_layers]
            if bad:
                raise ValueError(f"M6Config.moe_layers has layer indices outside [0, {self.num_layers}): {bad}")
            if len(set(self.moe_layers)) != len(self.moe_layers):
                raise ValueError(f"M6Config.moe_layers lists a layer twice: {self.moe_layers}")
            for block in range(self.num_blocks):
                kinds = {layer in self.moe_layers for layer in self.layers_of_block(block)}
                if len(kinds) > 1:
                    raise ValueError(
                        f"M6Config.moe_layers mixes MoE and dense layers {self.layers_of_block(block)} that share "
                        f"block {block}; list all or none of them"
                    )
        if self.num_unique_experts is not None and (
                isinstance(self.num_unique_experts, bool) or not isinstance(self.num_unique_experts, int)
                or self.num_unique_experts < 1 or self.num_experts % self.num_unique_experts):
            raise ValueError(f"M6Config.num_unique_experts must divide num_experts ({self.num_experts}) or be None, "
                             f"got {self.num_unique_experts!r}")
        if self.num_experts % self.num_prototypes:
            raise ValueError(
                f"M6Config.num_prototypes ({self.num_prototypes}) must divide num_experts ({self.num_experts})"
            )
        if self.moe_top_k > self.experts_per_prototype:
            raise ValueError(
                f"M6Config.moe_top_k ({self.moe_top_k}) must be <= experts per prototype ({self.experts_per_prototype})"
            )
        if not isinstance(self.normalize_gates, bool):
            raise ValueError(f"M6Config.normalize_gates must be True or False, got {self.normalize_gates!r}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"M6Config.capacity_factor must be > 0 or None (dropless), got {self.capacity_factor!r}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_jitter"):
            _at_least(name, getattr(self, name), 0.0)
        if self.router_jitter >= 1:  # the factor uniform(1 - j, 1 + j) could reach 0 or flip the input's sign
            raise ValueError(f"M6Config.router_jitter must be in [0, 1) (Switch uses 0.01), got {self.router_jitter!r}")

    # ----------------------------------------------------------------------------------------------- derived
    @property
    def num_blocks(self) -> int:
        """Resolved num_unique_blocks: None means one block per layer (the real model)."""
        return self.num_layers if self.num_unique_blocks is None else self.num_unique_blocks

    @property
    def run_depth(self) -> int:
        """Layers a forward pass runs: num_layers, or the number of blocks for a shallow pseudo model."""
        return self.num_blocks if self.pseudo_depth == "shallow" else self.num_layers

    @property
    def unique_experts(self) -> int:
        """Resolved num_unique_experts: None means one FFN per expert."""
        return self.num_experts if self.num_unique_experts is None else self.num_unique_experts

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim or 4 * self.dim

    @property
    def routed_hidden_dim(self) -> int:
        """Hidden size of one routed expert (``expert_hidden_dim``, else the FFN's)."""
        return self.expert_hidden_dim or self.hidden_dim

    @property
    def experts_per_prototype(self) -> int:
        return self.num_experts // self.num_prototypes

    @property
    def layer_to_block(self) -> list[int]:
        """Which block each layer runs, under the ``sharing`` layout."""
        return sharing_map(self.num_layers, self.num_blocks, self.sharing)

    def layers_of_block(self, block: int) -> list[int]:
        return [layer for layer, b in enumerate(self.layer_to_block) if b == block]

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layers is None or layer in self.moe_layers

    def attention_window(self, layer: int) -> int | None:
        """The band width for this layer, or None for dense causal attention."""
        if self.attention == "local" or (self.attention == "alternating" and layer % 2 == 1):
            return self.sparse_window
        return None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> M6Config:
        return dataclasses.replace(self, **changes)
