"""Mixture-of-Experts FFN: token-choice top-k routing, M6-T expert prototyping, capacity and dropless dispatch.

The routing mechanics are module-level pure functions (``route_tokens``, ``expert_positions``,
``expert_capacity``) so tests can check each invariant on its own; ``MoEFeedForward`` strings them together.

Dispatch is vectorized: assignments are ranked inside their expert by a stable sort (the rank decides who is
dropped at capacity) and gathered in expert order, dropped ones last; the experts run over their contiguous segments
(:func:`expert_mlps`) and the outputs are added back with their gates (a dropped assignment's gate is zero and its
row's output is zero). Segments carry no padding: a padded (experts, capacity, dim) buffer with batched matmuls
measured 25-35% slower on CPU (zero-filling, the extra index copies and the padded rows). Every expert's weights take
part in the graph, even with an empty segment, so an expert that received no token still gets a (zero) gradient and
DDP / FSDP never see an unused parameter.

Routing and dispatch read nothing on the host: no boolean-mask indexing, ``.item()`` or ``.tolist()``, so the
"grouped" kernel (segment offsets on the device) runs a whole MoE layer without a device synchronization. The "loop"
kernel reads the segment sizes on the host once per layer (and runs outside a compiled block's graph); expert
parallelism needs them for the all-to-all's splits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ExpertKernel, M6Config


@dataclass(frozen=True)
class RoutingStats:
    """What one MoE layer did with one batch (detached, for logging)."""

    tokens_per_expert: torch.Tensor
    """(experts,) assignments each expert was picked for, before capacity dropping."""
    dropped_fraction: torch.Tensor
    """Scalar: share of the token-to-expert assignments dropped for lack of capacity."""

    @property
    def load_max_over_mean(self) -> torch.Tensor:
        """1.0 is perfect balance; num_experts means one expert took every token."""
        counts = self.tokens_per_expert.float()
        return counts.max() / counts.mean().clamp_min(1e-9)


@dataclass(frozen=True)
class MoEOutput:
    output: torch.Tensor
    """Same shape as the input; zero for a token whose every assignment was dropped."""
    aux_loss: torch.Tensor
    """Switch load-balancing loss of this layer (1.0 when perfectly balanced)."""
    z_loss: torch.Tensor
    """Router z-loss of this layer."""
    stats: RoutingStats


def route_tokens(logits: torch.Tensor, num_prototypes: int, top_k: int, normalize: bool = False,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick experts for each token.

    ``logits`` (tokens, experts) are split into ``num_prototypes`` equal groups of consecutive experts (M6-T);
    inside each group a softmax gives probabilities and the top-k of them are the token's picks there. With one
    prototype this is ordinary top-k routing.

    Returns ``(gates, experts, probs)``: gates and global expert ids of shape (tokens, prototypes, top_k), and the
    per-group probabilities (tokens, prototypes, experts_per_prototype) in fp32.

    ``bias`` (experts,), auxiliary-loss-free balancing (DeepSeek-V3), is added to the probabilities for *choosing*
    the top-k only; the gates stay the probabilities themselves, so the bias steers load, not the mix.
    """
    tokens, num_experts = logits.shape
    per_group = num_experts // num_prototypes
    probs = logits.float().view(tokens, num_prototypes, per_group).softmax(dim=-1)
    if bias is None:
        gates, local = probs.topk(top_k, dim=-1)  # (tokens, prototypes, top_k)
    else:
        _, local = (probs + bias.float().view(1, num_prototypes, per_group)).topk(top_k, dim=-1)
        gates = probs.gather(-1, local)
    if normalize:  # GShard / Mixtral: the k picks' gates sum to 1 within each prototype
        gates = gates / gates.sum(dim=-1, keepdim=True)
    offsets = torch.arange(num_prototypes, device=logits.device).view(1, num_prototypes, 1) * per_group
    return gates, local + offsets, probs


def count_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(num_experts,) int64 counts of the ids in ``experts`` (all in [0, num_experts)). ``torch.bincount`` would give
    the same, but on CUDA it reads the largest id on the host to size its output: a device synchronization."""
    return torch.zeros(num_experts, dtype=torch.long, device=experts.device).scatter_add_(
        0, experts, torch.ones_like(experts, dtype=torch.long))


def expert_positions(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank of each assignment inside its expert, in the order given (earlier assignments win capacity).

    ``experts`` is a flat (assignments,) tensor of expert ids. Returns ``(positions, counts)``: positions
    (assignments,) from 0 up, and counts (experts,) of assignments per expert.
    """
    counts = count_per_expert(experts, num_experts)
    sorted_experts, order = torch.sort(experts, stable=True)
    starts = counts.cumsum(0) - counts
    ranks_sorted = torch.arange(experts.numel(), device=experts.device) - starts[sorted_experts]
    positions = torch.empty_like(ranks_sorted)
    positions[order] = ranks_sorted
    return positions, counts


def position_major_assignments(shape: torch.Size, per_token: int, device: torch.device) -> torch.Tensor:
    """The token-major assignment indices of a (batch, seq, dim) input in capacity priority order: position-major
    (every sequence's position 0 first), each token's ``per_token`` picks together. A (tokens, dim) input is one
    sequence: its order is already by position."""
    batch, seq = (shape[0], shape[1]) if len(shape) == 3 else (1, shape[0])
    tokens = torch.arange(batch * seq, device=device).view(batch, seq).t().reshape(-1)
    picks = torch.arange(per_token, device=device)
    return (tokens[:, None] * per_token + picks).reshape(-1)


def expert_capacity(num_assignments: int, num_experts: int, capacity_factor: float | None,
                    counts: torch.Tensor, num_tokens: int | None = None) -> int:
    """Slots per expert: capacity_factor times the fair share, or (dropless) the busiest expert's load; never more
    than the number of tokens (an expert gets at most one assignment per token)."""
    if capacity_factor is None:
        return max(1, int(counts.max().item()))
    capacity = max(1, math.ceil(capacity_factor * num_assignments / num_experts))
    return min(capacity, num_tokens) if num_tokens is not None else capacity


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer loss ``E * sum_e f_e * P_e`` per prototype group, averaged over groups.

    ``probs`` (tokens, groups, per_group) are router probabilities, ``counts`` (experts,) the assignments per
    expert. f_e is the share of the group's assignments that went to e (not differentiable), P_e the mean router
    probability of e. Uniform routing gives exactly 1.0, whatever the tie-breaking.
    """
    return balance_loss_from_means(probs.mean(dim=0), counts)


def balance_loss_from_means(mean_prob: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`load_balancing_loss` from the mean router probabilities (groups, per_group) and the counts (experts,)
    (summed over processes, when a strategy computes it over every process's tokens)."""
    groups, per_group = mean_prob.shape
    fraction = counts.view(groups, per_group).float()
    fraction = fraction / fraction.sum(dim=-1, keepdim=True).clamp_min(1.0)
    return (per_group * (fraction * mean_prob).sum(dim=-1)).mean()


def router_z_loss(logits: torch.Tensor, num_prototypes: int) -> torch.Tensor:
    """ST-MoE z-loss: mean over tokens (and groups) of logsumexp(logits)^2, keeping router logits small."""
    tokens, num_experts = logits.shape
    grouped = logits.float().view(tokens, num_prototypes, num_experts // num_prototypes)
    return grouped.logsumexp(dim=-1).square().mean()


class Router(nn.Linear):
    """The gate's linear map, computed in fp32 even under autocast (which would cast it to bf16): small logit
    differences decide the routing. An ``nn.Linear`` like any other, so hooks and parallel plans that handle linear
    layers (the gradient-agreement probe, tensor-parallel styles) see it as one."""

    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__(dim, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


class Experts(nn.Module):
    """``num_experts`` two-layer GELU MLPs held as stacked weights.

    With ``num_unique`` < num_experts the weights hold only ``num_unique`` FFNs and expert e runs FFN
    e mod num_unique (``M6Config.num_unique_experts``): the memory and optimizer state of ``num_unique`` experts,
    until ``sharing.upcycle_experts`` gives every expert its own copy.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, num_unique: int | None = None,
                 kernel: ExpertKernel = "auto") -> None:
        super().__init__()
        self.num_experts = num_experts
        # Recorded, not read from the weights' shape: a placed weight (sharded, expert-parallel) may be a local part.
        self.num_unique = num_experts if num_unique is None else num_unique
        self.kernel = kernel
        self.w_in = nn.Parameter(torch.empty(self.num_unique, dim, hidden_dim))
        self.w_out = nn.Parameter(torch.empty(self.num_unique, hidden_dim, dim))
        self.reset_parameters()

    @property
    def is_shared(self) -> bool:
        """Whether several experts run one FFN (not yet upcycled)."""
        return self.num_unique < self.num_experts

    def reset_parameters(self) -> None:
        # Each expert like an nn.Linear of its own (fan-in scaling); M6Transformer re-initializes the whole model.
        nn.init.normal_(self.w_in, std=self.w_in.shape[1] ** -0.5)
        nn.init.normal_(self.w_out, std=self.w_out.shape[1] ** -0.5)

    @property
    def runs_one_ffn(self) -> bool:
        """Whether every expert runs the same FFN (one shared before upcycling), on weights this module holds whole
        (not split by expert or tensor parallelism, whose dispatch replaces ``forward``)."""
        return (self.num_unique == 1 and "forward" not in vars(self)
                and type(self.w_in) is nn.Parameter and type(self.w_in.data) is torch.Tensor)

    def one_ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The one shared FFN on every row of x (rows, dim) -> (rows, dim): ``runs_one_ffn`` models only."""
        counts = torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device)
        return expert_mlps(x, counts, self.w_in, self.w_out, kernel=self.kernel)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (rows, dim) sorted by expert, ``counts[e]`` rows for expert e ((experts,) integers on x's device); rows
        past ``counts.sum()`` (dropped assignments) give zeros -> (rows, dim)."""
        w_in, w_out = self.w_in, self.w_out
        if self.is_shared:  # expert e runs FFN e mod unique; repeat's backward sums the experts' gradients
            copies = self.num_experts // self.num_unique
            w_in, w_out = w_in.repeat(copies, 1, 1), w_out.repeat(copies, 1, 1)
        return expert_mlps(x, counts, w_in, w_out, kernel=self.kernel)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` computes in: autocast's when it is on for x's device, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def resolve_expert_kernel(kernel: ExpertKernel, x: torch.Tensor) -> str:
    """"auto" -> "grouped" on a CUDA device computing in bf16 (the only dtype CUDA's grouped GEMM takes), else
    "loop" (on CPU the loop measured faster, docs/performance.md). An explicit choice is returned as given."""
    if kernel != "auto":
        return kernel
    usable = (x.device.type == "cuda" and compute_dtype(x) == torch.bfloat16 and hasattr(torch, "_grouped_mm")
              and torch.cuda.get_device_capability(x.device) >= (9, 0) and x.shape[-1] % 8 == 0)
    return "grouped" if usable else "loop"


def expert_mlps(x: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                kernel: ExpertKernel = "auto") -> torch.Tensor:
    """Each expert's GELU MLP on its segment: x (rows, dim) sorted by expert, ``counts`` (experts,) rows per expert
    (a tensor on x's device), weights (experts, dim, hidden) and (experts, hidden, dim) -> (rows, dim).
    Rows past the counts' sum get zeros and no gradient."""
    if resolve_expert_kernel(kernel, x) == "grouped":
        return grouped_expert_mlps(x, counts, w_in, w_out)
    return _eager_looped_expert_mlps(x, counts, w_in, w_out)


@torch.compiler.disable
def _eager_looped_expert_mlps(x: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor
                              ) -> torch.Tensor:
    """The loop kernel outside any compiled graph. It reads the segment sizes on the host, which is a graph break
    whatever is done; traced, each new set of sizes would also be a new graph (a recompile per step until dynamo
    gives up on the sizes). Left to run eagerly, a compiled block breaks here once and compiles the rest once."""
    return looped_expert_mlps(x, counts.tolist(), w_in, w_out)


def looped_expert_mlps(x: torch.Tensor, counts: list[int], w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """:func:`expert_mlps` with two matmuls per expert over its segment (host-side sizes)."""
    total = sum(counts)
    # unbind, not w_in[e]: each indexing's backward would allocate and fill a zero tensor of the whole stacked weight
    # and add it up, once per expert (measured: a fifth of a CPU step); unbind's backward stacks the parts once.
    segments, ins, outs = x[:total].split(counts), w_in.unbind(0), w_out.unbind(0)
    out = torch.cat([F.gelu(segment @ ins[e]) @ outs[e] for e, segment in enumerate(segments)])
    if total < x.shape[0]:
        out = torch.cat([out, out.new_zeros(x.shape[0] - total, out.shape[1])])
    return out


def grouped_expert_mlps(x: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor
                        ) -> torch.Tensor:
    """:func:`expert_mlps` as two grouped GEMMs with the segment offsets on the device: no host synchronization."""
    rows = x.shape[0]
    ends = counts.cumsum(0)
    # The last segment is stretched to the end so that every output row is computed (the kernel leaves rows past the
    # last offset unset on CUDA); the dropped rows it picks up are zeroed below, which also stops their gradient.
    offsets = torch.cat([ends[:-1], ends.new_full((1,), rows)]).to(torch.int32)
    dtype = compute_dtype(x)
    if dtype != torch.bfloat16 and x.device.type == "cuda":
        raise ValueError(f"M6Config.expert_kernel='grouped' computes in bf16 on CUDA, and this layer computes in "
                         f"{dtype}: train with precision='bf16-mixed', or use expert_kernel='auto' (the loop where "
                         "grouped cannot run)")
    with torch.autocast(device_type=x.device.type, enabled=False):  # cast here: autocast has no rule for it
        hidden = F.gelu(torch._grouped_mm(x.to(dtype), w_in.to(dtype), offs=offsets))
        out = torch._grouped_mm(hidden, w_out.to(dtype), offs=offsets)
    kept = torch.arange(rows, device=x.device) < ends[-1]
    return torch.where(kept.unsqueeze(-1), out, out.new_zeros(()))


class AlwaysOnExperts(nn.Module):
    """The experts every token runs beside its routed ones (DeepSeek-MoE's shared experts), fused into one GELU MLP
    of their summed hidden size: the same function as several MLPs whose outputs are added."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(dim, hidden_dim, bias=False)
        self.fc_out = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


def update_routing_bias(bias: torch.Tensor, load: torch.Tensor, rate: float, groups: int = 1) -> None:
    """DeepSeek-V3's rule, in place: each expert's bias moves by ``rate`` towards balance, up when its ``load`` (the
    step's assignments, at any common scale) is below the mean of its routing group (prototype), down when above,
    not at all when equal."""
    grouped = load.float().view(groups, -1)
    step = torch.sign(grouped.mean(dim=-1, keepdim=True) - grouped)
    bias.add_((rate * step).view_as(bias).to(bias.dtype))


def update_routing_biases(model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """After an optimizer step: move every loss-free-balanced MoE layer's bias by the load its routing saw since the
    last step (every micro-batch), summed over processes by ``reduce`` (one collective for all layers, so every
    rank applies the same update), and start the next step's count."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward) and m.bias_rate is not None]
    if not layers:
        return
    loads = torch.cat([layer.step_load for layer in layers])
    if reduce is not None:
        loads = reduce(loads)
    for layer, load in zip(layers, loads.split([layer.step_load.numel() for layer in layers])):
        update_routing_bias(layer.routing_bias, load, layer.bias_rate, layer.num_prototypes)
        layer.step_load.zero_()


class MoEFeedForward(nn.Module):
    """Router + experts. Input (batch, seq, dim) or (tokens, dim); returns an :class:`MoEOutput`.

    ``forward(x, dropless=True)`` keeps every assignment whatever ``capacity_factor`` says: the inference path
    (generation). Capacity is a training device (it bounds each expert's work in a balanced batch); at inference it
    would make a token's output depend on how many other tokens run in the same call (the whole prompt, or one new
    token per step), so the cached decode would disagree with the full forward.
    """

    def __init__(self, config: M6Config) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.num_prototypes = config.num_prototypes
        self.top_k = config.moe_top_k
        self.normalize_gates = config.normalize_gates
        self.capacity_factor = config.capacity_factor
        self.jitter = config.router_jitter
        self.router = Router(config.dim, config.num_experts)
        self.experts = Experts(config.num_experts, config.dim, config.routed_hidden_dim, config.num_unique_experts,
                               kernel=config.expert_kernel)
        self.always_on = (AlwaysOnExperts(config.dim, config.always_on_experts * config.routed_hidden_dim)
                          if config.always_on_experts else None)
        self.bias_rate = config.router_bias_rate if config.router_balance == "bias" else None
        if self.bias_rate is not None:
            # Loss-free balancing: the routing bias (kept in checkpoints) and the load of the current optimizer
            # step, summed over its micro-batches and forwards (not kept: a step never spans a checkpoint).
            self.register_buffer("routing_bias", torch.zeros(config.num_experts))
            self.register_buffer("step_load", torch.zeros(config.num_experts), persistent=False)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> MoEFeedForward:
        """Moves and casts as any module, but the routing buffers stay float32 under a bf16/fp16 model
        (``precision="bf16-true"``): in bf16 a bias near 1 cannot take a 0.001 step, and a step's load above 256
        assignments would be rounded before the comparison that moves the bias."""
        super()._apply(fn, recurse)
        for name in ("routing_bias", "step_load"):
            buffer = self._buffers.get(name)
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        return self

    def reset_parameters(self) -> None:
        """The routing buffers' initial values (a model built on the meta device gets them here; the weights have
        their own rules): no bias, no load counted."""
        if self.bias_rate is not None:
            self.routing_bias.zero_()
            self.step_load.zero_()

    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
    """A differentiable sum over the processes that see different batches, which the load-balancing loss then
    counts as one process given all their tokens would (None: this call's tokens only); a strategy that splits the
    model hands it over (:meth:`balance_over`). The layer itself knows no process group."""

    def balance_over(self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Count every data rank's tokens in the load-balancing loss (``protocols.BalancesOverRanks``)."""
        self.sum_over_ranks = sum_over_ranks

    def balance_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss of this call's tokens (:func:`load_balancing_loss`), or of every data rank's
        tokens when :attr:`sum_over_ranks` is set, as one process given their batches would compute it."""
        total = self.sum_over_ranks
        if total is None:
            return load_balancing_loss(probs, counts)
        # One sum over the ranks for all three: the probabilities' sums, the counts and the token count, packed in
        # float64 (exact for counts below 2**53). Each sum is a call of a few bytes whose cost is all latency: three
        # calls per layer and micro-batch cost three times one on a CPU's gloo (about 1 ms each on 2 vCPUs).
        prob_sums = probs.sum(dim=0)
        with torch.no_grad():  # the fractions are counts: no gradient through them
            tallies = torch.cat([counts.reshape(-1).to(torch.float64),
                                 torch.full((1,), float(probs.shape[0]), dtype=torch.float64, device=probs.device)])
        # The differentiable sum's backward sums every rank's gradient for this rank's probabilities, which the
        # data-parallel gradient average then divides back to one process's gradient.
        summed = total(torch.cat([prob_sums.reshape(-1).to(torch.float64), tallies]))
        width = prob_sums.numel()
        summed_probs = summed[:width].view_as(prob_sums).to(prob_sums.dtype)
        summed_counts, tokens = summed[width:-1].detach(), summed[-1:].detach().to(prob_sums.dtype)
        return balance_loss_from_means(summed_probs / tokens, summed_counts)

    def forward(self, x: torch.Tensor, dropless: bool = False) -> MoEOutput:
        shape = x.shape
        capacity_factor = None if dropless else self.capacity_factor
        x = x.reshape(-1, shape[-1])  # (tokens, dim)
        num_tokens = x.shape[0]
        router_input = x
        if self.training and self.jitter > 0:
            router_input = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        logits = self.router(router_input)  # (tokens, experts), fp32
        bias = self.routing_bias if self.bias_rate is not None else None
        gates, experts, probs = route_tokens(logits, self.num_prototypes, self.top_k, self.normalize_gates, bias)

        # Assignments are flattened token-major (a token's picks together). Capacity goes by priority, position-major
        # over the batch: every sequence's position 0, then every sequence's position 1, ... A token then competes
        # only with tokens at earlier positions (or the same position in earlier sequences), so dropping never lets
        # a later position change an earlier one's output in any sequence, and drops spread evenly over the batch
        # instead of falling on its last rows. (GShard's choice-major order, every first choice before any second,
        # would let future tokens' first choices push out a token's second choice: a causality leak.)
        experts_flat = experts.reshape(-1)  # (assignments,) = (tokens * prototypes * top_k,)
        gates_flat = gates.reshape(-1)
        token_ids = torch.arange(num_tokens, device=x.device).view(num_tokens, 1, 1)
        tokens_flat = token_ids.expand(num_tokens, self.num_prototypes, self.top_k).reshape(-1)

        if capacity_factor is None:  # dropless: every assignment is kept, no ranking needed
            counts = count_per_expert(experts_flat, self.num_experts)
            kept = None
        else:
            priority = position_major_assignments(shape, self.num_prototypes * self.top_k, x.device)
            ranked, counts = expert_positions(experts_flat[priority], self.num_experts)
            positions = torch.empty_like(ranked)
            positions[priority] = ranked
            capacity = expert_capacity(experts_flat.numel(), self.num_experts, capacity_factor, counts, num_tokens)
            kept = positions < capacity
            gates_flat = gates_flat * kept
        # Allocated in the input's shape and filled through a flat view, so the returned tensor is not a view: FSDP2
        # warns on (and an in-place op by a caller would break) a view returned from a wrapped block.
        output = x.new_zeros(shape)
        if self.experts.runs_one_ffn:
            # Every expert runs one FFN (before upcycling): a token's output is that FFN's output times the sum of its
            # kept gates, the same sum computed once per token instead of once per assignment (1 / (prototypes x
            # top_k) of the expert work, and no gather): the upcycled model's shared stage costs less than a step of
            # the upcycled model.
            gate_sums = torch.zeros(num_tokens, dtype=gates_flat.dtype, device=x.device).index_add(
                0, tokens_flat, gates_flat)
            shared = self.experts.one_ffn(x)
            output.view(num_tokens, shape[-1]).copy_((shared.float() * gate_sums.unsqueeze(-1).float()).to(x.dtype))
        else:
            segment_key, segment_sizes = experts_flat, counts
            if kept is not None:
                # Dropped assignments sort after every expert's segment (key num_experts) with a zero gate: shapes
                # stay static and nothing is read on the host (a boolean-mask gather would sync to learn its length).
                segment_key = torch.where(kept, experts_flat, self.num_experts)
                segment_sizes = count_per_expert(segment_key, self.num_experts + 1)[:self.num_experts]
            order = torch.argsort(segment_key, stable=True)  # grouped by expert, dropped last
            if kept is not None:  # at most capacity rows per expert are kept: the rest need no gather
                order = order[:min(order.numel(), capacity * self.num_experts)]
            sorted_tokens = tokens_flat[order]
            sorted_gates = gates_flat[order]
            expert_out = self.experts(x[sorted_tokens], segment_sizes)
            # Under autocast the experts compute in bf16/fp16: the gates (fp32 router probabilities) weigh their
            # outputs in fp32, and the sum goes back in x's dtype (a bf16 gate would round each token's mix to 3
            # digits).
            weighted = (expert_out.float() * sorted_gates.unsqueeze(-1).float()).to(x.dtype)
            output.view(num_tokens, shape[-1]).index_add_(0, sorted_tokens, weighted)
        if self.always_on is not None:
            output = output + self.always_on(x).view(shape)
        if self.bias_rate is not None and self.training:
            with torch.no_grad():
                self.step_load.add_(counts.to(self.step_load.dtype))

        stats = RoutingStats(
            tokens_per_expert=counts.detach(),
            dropped_fraction=(x.new_zeros((), dtype=torch.float32) if kept is None
                              else 1.0 - kept.float().mean()).detach(),
        )
        return MoEOutput(
            output=output,
            aux_loss=self.balance_loss(probs, counts),
            z_loss=router_z_loss(logits, self.num_prototypes),
            stats=stats,
        )
