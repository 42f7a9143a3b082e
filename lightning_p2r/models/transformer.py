"""The M6 decoder: pre-LN blocks with dense or MoE FFNs, and cross-layer weight sharing.

Sharing is structural. ``M6Transformer.blocks`` holds ``num_unique_blocks`` Block modules and
``layer_to_block[layer]`` says which one each layer runs, so ``parameters()`` and the state dict hold a shared
tensor once. This pair (``blocks`` + ``layer_to_block``) is the contract that ``lightning_p2r.delink`` and the
strategy rely on; any model that declares it can be delinked and offloaded block by block.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..protocols import ParallelPlan, SplitKind, StackedExperts
from .attention import Band, CausalSelfAttention, choose_bands, rotary_tables
from .cache import KVCache, LayerKV
from .config import M6Config
from .init import InitRule, draw_seed, fill_parameters
from .moe import MoEFeedForward, MoEOutput, RoutingStats


class DenseFeedForward(nn.Module):
    def __init__(self, config: M6Config) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.fc_out = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class Block(nn.Module):
    """Pre-LN decoder block: ``h = x + attn(ln(x))``, ``out = h + ffn(ln(h))``.

    A token the MoE dropped gets a zero FFN output, so it leaves the block as ``h``: it passes on the residual.
    """

    def __init__(self, config: M6Config, moe: bool) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ffn_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.ffn: MoEFeedForward | DenseFeedForward = MoEFeedForward(config) if moe else DenseFeedForward(config)
        self.dropout = nn.Dropout(config.dropout)
        # Set by M6Transformer: the init rule of the whole model and this block's name in it ("blocks.3."), so a
        # block materialized on its own gets exactly the values it would get inside the model.
        self.init_rule = init_rule(config, config.init_seed if config.init_seed is not None else draw_seed())
        self.name_in_model = ""

    def init_weights(self) -> None:
        """Write this block's initial values (a pure function of the model's init seed and parameter names)."""
        fill_parameters(self, self.init_rule, self.name_in_model)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoEFeedForward)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                window: int | None = None, cache: LayerKV | None = None,
                dropless: bool = False, band: Band | None = None) -> tuple[torch.Tensor, MoEOutput | None]:
        """``cache`` (incremental decoding) and ``dropless`` (an MoE FFN drops no token) are the inference path's;
        training calls neither. ``band``: the attention kernel of a banded window (:class:`LayerContext`)."""
        h = x + self.dropout(self.attn(self.attn_norm(x), rotary=rotary, window=window, cache=cache, band=band))
        ffn_in = self.ffn_norm(h)
        ffn_out = self.ffn(ffn_in, dropless=True) if dropless and self.is_moe else self.ffn(ffn_in)
        if isinstance(ffn_out, MoEOutput):
            return h + self.dropout(ffn_out.output), ffn_out
        return h + self.dropout(ffn_out), None


@dataclass
class M6Output:
    logits: torch.Tensor
    """(batch, seq, vocab_size)."""
    aux_loss: torch.Tensor
    """Load-balancing loss, computed per MoE layer and summed over MoE layers, as Switch and ST-MoE apply their
    coefficient per layer (0 for a dense model)."""
    z_loss: torch.Tensor
    """Router z-loss, summed over MoE layers (0 for a dense model)."""
    routing: dict[int, RoutingStats] = field(default_factory=dict)
    """Routing statistics per MoE layer index."""


@dataclass(frozen=True)
class LayerContext:
    """What every layer of one forward call needs besides the hidden states; holds no tensor that needs grad, so
    the hidden state is the only thing a stage-by-stage executor has to carry gradients across."""

    rotary: tuple[torch.Tensor, torch.Tensor] | None
    """cos and sin tables (seq, head_dim // 2) for rotary positions, or None with learned positions."""
    seq_len: int
    """Length of the sequences in this call."""
    cache: KVCache | None = None
    """Inference only: the keys and values of the positions before this call's (see :class:`KVCache`)."""
    dropless: bool = False
    """Inference only: MoE layers keep every token whatever their capacity factor."""
    bands: dict[int, Band] = field(default_factory=dict)
    """The attention kernel of each banded window this call (``M6Config.attention_kernel``), chosen here, outside
    any compiled block, with flex's block mask built once per length."""


def _compute_dtype(parameter_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention will run in: autocast's where it is on, else the parameters'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return parameter_dtype


def init_rule(config: M6Config, seed: int) -> InitRule:
    """The M6 init distribution for ``config`` (see :class:`InitRule`)."""
    residual_std = config.init_std / math.sqrt(2 * residual_count(config))
    return InitRule(seed=seed, std=config.init_std, residual_std=residual_std)


def residual_count(config: M6Config) -> int:
    """How many residual layers the output-projection init divides by (``M6Config.residual_init``)."""
    applications_per_block = config.run_depth // config.num_blocks  # 1 for a shallow pseudo model
    return {"depth": config.num_layers, "applications": config.num_layers * applications_per_block,
            "blocks": config.num_blocks}[config.residual_init]


class M6Transformer(nn.Module):
    """GPT-like decoder of M6 / M6-T with optional cross-layer sharing (M6-10T's pseudo model).

    Construct it under ``torch.device("meta")`` to allocate nothing, then ``to_empty(device=...)`` and
    ``init_weights()`` (or ``initial_value(name)`` per parameter, for a strategy that places each tensor itself):
    the values are the same as the eager constructor's, bit for bit, whatever the placement.
    """

    def __init__(self, config: M6Config) -> None:
        super().__init__()
        self.config = config
        self._init_seed = config.init_seed if config.init_seed is not None else draw_seed()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = (
            nn.Embedding(config.max_seq_len, config.dim) if config.position_embedding == "learned" else None
        )
        # A shallow pseudo model runs only its first run_depth layers (block i at layer i under the cycle layout).
        self._layer_to_block: list[int] = config.layer_to_block[:config.run_depth]
        self.blocks = nn.ModuleList(
            Block(config, moe=config.is_moe_layer(config.layers_of_block(block)[0]))
            for block in range(config.num_blocks)
        )
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self._tie_embeddings()
        self._name_blocks()
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @property
    def num_layers(self) -> int:
        """Layers a forward pass runs (fewer than ``config.num_layers`` for a shallow pseudo model)."""
        return len(self.layer_to_block)

    @property
    def full_depth(self) -> int:
        """The real model's depth, which delinking grows a shallow pseudo model to (``config.num_layers``)."""
        return self.config.num_layers

    @property
    def growth_init(self) -> str:
        """How layers gained at growth start ("copy" or "zero_outputs"); ``delink`` reads it."""
        return self.config.growth_init

    @property
    def sharing(self) -> str:
        """The sharing layout ("sequence" or "cycle"): ``delink`` keeps it."""
        return self.config.sharing

    @property
    def layer_to_block(self) -> list[int]:
        """Which block each layer runs (the sharing map); ``delink`` sets it together with ``blocks``."""
        return self._layer_to_block

    @layer_to_block.setter
    def layer_to_block(self, value: list[int]) -> None:
        blocks = len(set(value))
        expected = blocks if self.config.pseudo_depth == "shallow" else self.config.num_layers
        if len(value) != expected:
            raise ValueError(f"layer_to_block needs one entry per layer run ({expected}), got {len(value)}")
        self._layer_to_block = list(value)
        # Keep the config truthful, so what is saved or logged describes the structure actually trained.
        self.config.num_unique_blocks = blocks
        self._name_blocks()

    # ----------------------------------------------------------------------------------------------- init
    @property
    def init_seed(self) -> int:
        """The seed the initial values come from (``config.init_seed``, or the one drawn at construction)."""
        return self._init_seed

    @init_seed.setter
    def init_seed(self, value: int) -> None:
        # A strategy hands rank 0's draw to every rank, so each rank materializes its part of the same model.
        self._init_seed = int(value)
        self._name_blocks()

    @property
    def init_rule(self) -> InitRule:
        return init_rule(self.config, self.init_seed)

    def _name_blocks(self) -> None:
        """Give every block the model's init rule and its current name (delinking renumbers blocks)."""
        for index, block in enumerate(self.blocks):
            block.init_rule, block.name_in_model = self.init_rule, f"blocks.{index}."

    def initial_value(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The initial value of parameter ``name`` (as ``named_parameters()`` names it), full shape: a new fp32 CPU
        tensor, or written into ``out`` (a plain tensor of that shape, on any device). Reads only the parameter's
        shape, so it works on meta, sharded or offloaded parameters."""
        if out is not None:
            return self.init_rule.fill_(name, out)
        return self.init_rule.value(name, self.get_parameter(name).shape)

    def _tie_embeddings(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    def init_weights(self) -> None:
        """Write every parameter's initial value (plain tensors on any device). Ties the LM head to the embedding
        again first: ``to_empty`` gives each module a tensor of its own."""
        self._tie_embeddings()
        self._name_blocks()
        self.init_non_block_weights()
        for block in self.blocks:
            block.init_weights()

    def init_non_block_weights(self) -> None:
        """Write the initial values of the parameters outside the blocks (embeddings, final norm, head)."""
        self._tie_embeddings()
        in_blocks = {id(p) for p in self.blocks.parameters()}
        with torch.no_grad():
            for name, param in self.named_parameters():
                if id(param) not in in_blocks:
                    self.initial_value(name, out=param)

    # ------------------------------------------------------------------------------------------------ stages
    # forward() is embed -> run_layer for each layer -> head. The stages are public so an executor outside the
    # model (layered gradient accumulation, lightning_p2r.strategy.layered) can run every micro-batch through one
    # layer before the next, without the model knowing about micro-batches.
    def parallel_plan(self) -> ParallelPlan:
        """How tensor / expert parallelism splits this model (Megatron-LM): per block the fused qkv projection by
        columns (its rows are head-major, so each rank gets whole heads) and the attention output by rows, a dense
        FFN's pair the same way or an MoE layer's experts, the norms by sequence under sequence parallelism; outside
        the blocks the embedding by vocabulary rows and the head by vocabulary columns. Norms, the router and
        position embeddings otherwise stay whole: their inputs are the same on every tensor-parallel rank."""
        attention: dict[str, SplitKind] = {"attn.qkv": "column", "attn.out": "row", "attn_norm": "sequence",
                                           "ffn_norm": "sequence"}
        dense: dict[str, SplitKind] = {"ffn.fc_in": "column", "ffn.fc_out": "row"}
        config = self.config
        # Experts that share one FFN (before upcycling) are not split: each rank runs the whole shared FFN on its
        # own tokens, and its gradient is reduced with the dense weights'. (The rulebook refuses tensor parallelism
        # over them, whose sequence-split activations would need a reduction of their own.)
        split_experts = config.unique_experts == config.num_experts
        # From the config, not the modules: a pipeline rank holds stand-ins for the blocks of other stages.
        blocks = tuple(attention | (({"ffn": "expert"} if split_experts else {})
                                    if config.is_moe_layer(config.layers_of_block(b)[0]) else dense)
                       for b in range(len(self.blocks)))
        # The experts' weights are stacked (experts x dim x hidden, experts x hidden x dim); the module is called with
        # rows sorted by expert and their counts, and records its number of experts twice (the unique FFNs too).
        experts = StackedExperts({"w_in": 2, "w_out": 1}, call="sorted", counts=("num_experts", "num_unique"))
        return ParallelPlan(blocks, {"tok_embeddings": "vocabulary", "lm_head": "output", "norm": "sequence"},
                            experts={"ffn.experts": experts} if split_experts else {})

    def embed(self, input_ids: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, LayerContext]:
        """input_ids: LongTensor (batch, seq) at positions ``[start, start + seq)`` (``start`` > 0 after cached
        positions) -> hidden states (batch, seq, dim) and the per-call layer context."""
        if input_ids.dim() != 2:
            raise ValueError(f"M6Transformer expects input_ids of shape (batch, seq), got {tuple(input_ids.shape)}")
        seq_len = input_ids.shape[1]
        if start + seq_len > self.config.max_seq_len:
            where = f"sequence length {seq_len}" if start == 0 else f"positions up to {start + seq_len}"
            raise ValueError(f"{where} exceeds M6Config.max_seq_len={self.config.max_seq_len}")
        x = self.tok_embeddings(input_ids)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(torch.arange(start, start + seq_len, device=input_ids.device))
        return x, self.layer_context(input_ids, start)

    def layer_context(self, input_ids: torch.Tensor, start: int = 0) -> LayerContext:
        """The per-call layer context of ``input_ids`` (batch, seq) at positions from ``start``, without running
        the embedding (a pipeline stage after the first rebuilds it from the micro-batch)."""
        seq_len = input_ids.shape[1]
        rotary = None
        if self.config.position_embedding != "learned":  # read from the config: a stage may lack the tables' owner
            rotary = rotary_tables(seq_len, self.config.head_dim, self.config.rope_theta, device=input_ids.device,
                                   start=start)
        windows = {self.config.attention_window(layer) for layer in range(self.config.run_depth)} - {None}
        bands = choose_bands(self.config.attention_kernel, windows,
                             (input_ids.shape[0], self.config.num_heads, seq_len, self.config.head_dim),
                             _compute_dtype(self.tok_embeddings.weight.dtype, input_ids.device), input_ids.device,
                             training=self.training and torch.is_grad_enabled(),
                             dropout=self.config.dropout) if windows else {}
        return LayerContext(rotary=rotary, seq_len=seq_len, bands=bands)

    def run_layer(self, layer: int, x: torch.Tensor, context: LayerContext) -> tuple[torch.Tensor, MoEOutput | None]:
        """Run layer ``layer`` (its block under the sharing map, with its own attention window) on x."""
        block = self.blocks[self.layer_to_block[layer]]
        window = self.config.attention_window(layer)
        band = context.bands.get(window) if window is not None else None
        if context.cache is None and not context.dropless:
            return block(x, rotary=context.rotary, window=window, band=band)  # training and evaluation
        cache = context.cache.layer(layer) if context.cache is not None else None
        return block(x, rotary=context.rotary, window=window, cache=cache, dropless=context.dropless, band=band)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden states (batch, seq, dim) -> logits (batch, seq, vocab_size)."""
        return self.lm_head(self.norm(x))

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty key/value cache for ``forward(..., cache=...)``, holding ``capacity`` positions (default and
        at most ``max_seq_len``: the model knows no position beyond it)."""
        capacity = self.config.max_seq_len if capacity is None else capacity
        if capacity > self.config.max_seq_len:
            raise ValueError(f"a KV cache of {capacity} positions exceeds M6Config.max_seq_len="
                             f"{self.config.max_seq_len}")
        return KVCache(self.num_layers, capacity)

    def forward(self, input_ids: torch.Tensor, *, cache: KVCache | None = None,
                dropless: bool = False) -> M6Output:
        """input_ids: LongTensor (batch, seq) -> :class:`M6Output` with logits (batch, seq, vocab_size).

        Inference: with a ``cache`` (see :meth:`new_cache`) input_ids are the tokens after the cached positions, whose
        keys and values every layer reads instead of recomputing them; the cache then holds these positions too.
        ``dropless`` makes MoE layers keep every token (no capacity), so the logits of a position are the same
        whether it runs with the whole sequence or one position at a time.
        """
        x, context = self.embed(input_ids, start=cache.length if cache is not None else 0)
        if cache is not None or dropless:
            context = dataclasses.replace(context, cache=cache, dropless=dropless)
        aux_losses, z_losses, routing = [], [], {}
        for layer in range(self.num_layers):
            x, moe = self.run_layer(layer, x, context)
            if moe is not None:
                aux_losses.append(moe.aux_loss)
                z_losses.append(moe.z_loss)
                routing[layer] = moe.stats
        if cache is not None:
            cache.advance(input_ids.shape[1])
        zero = x.new_zeros((), dtype=torch.float32)
        return M6Output(
            logits=self.head(x),
            # Per layer, then summed (Switch / ST-MoE: the coefficient weighs each layer's loss): balancing over the
            # concatenation of layers would let one layer's imbalance hide behind another's.
            aux_loss=torch.stack(aux_losses).sum() if aux_losses else zero,
            z_loss=torch.stack(z_losses).sum() if z_losses else zero,
            routing=routing,
        )
