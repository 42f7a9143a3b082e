"""The auxiliary load-balancing loss of a Hugging Face MoE trained with ``config.output_router_logits=True``, in
every layout that runs the model layer by layer (layered accumulation).

Run whole, the model computes this loss itself (``output.aux_loss``, ``load_balancing_loss_func``) and
``CausalLMModule`` adds it to the cross-entropy with the model's ``router_aux_loss_coef``, as Hugging Face's own
loss does when given labels. Its definition pools the routing of every MoE layer before it multiplies: with T_e the
top-k assignments to expert e summed over the layers, P_e the router probabilities summed over the layers and R the
rows summed over the layers,

    aux = E * sum_e (T_e / R) * (P_e / R).

That is not a sum of one term per layer, so a layer's stage cannot add its share when it runs. But T carries no
gradient, so the loss is linear in each layer's P once every layer has run: d aux / d P_l = E * T / R**2, the same
weight for every layer. Layered accumulation runs every layer of a micro-batch before any backward, so each layer's
stage records its T and P (:func:`run_recording_routers`), the head computes the loss and that weight
(:func:`finish_micro_batch`), and each layer's backward applies it to its own P (a term whose gradient is known only
later, :class:`_DeferredBalance`). Pipelines run a micro-batch's backward on a stage before the later stages' T are
known there: they refuse this loss.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class RouterLoss:
    """How a Hugging Face MoE computes its load-balancing loss: which module's output (at ``index``) holds a layer's
    router logits (tokens, experts), and the loss's constants, as the causal LM itself reads them."""

    router: type[nn.Module]
    index: int
    num_experts: int
    top_k: int
    coefficient: float


def aux_loss_coefficient(model: nn.Module) -> float:
    """The weight a Hugging Face MoE gives its load-balancing loss in its training loss (the causal LM's
    ``router_aux_loss_coef``, else its config's)."""
    value = getattr(model, "router_aux_loss_coef", None)
    if value is None:
        value = getattr(getattr(model, "config", None), "router_aux_loss_coef", None)
    if value is None:
        raise ValueError(f"{type(model).__name__} returns a load-balancing loss (aux_loss) but no "
                         "router_aux_loss_coef to weigh it by: set it in its config")
    return float(value)


def adds_balance_loss(model: nn.Module) -> bool:
    """Whether ``model`` adds a load-balancing loss to its training loss: its config sets ``output_router_logits``
    and its forward computes one (Mixtral's and its followers' keep it in a local ``aux_loss``, from
    ``load_balancing_loss_func``). DeepSeek-V3 returns its router logits but adds no loss (it balances by a routing
    bias)."""
    if not getattr(getattr(model, "config", None), "output_router_logits", False):
        return False
    forward = inspect.unwrap(type(model).forward)
    code = getattr(forward, "__code__", None)
    return code is None or "aux_loss" in code.co_varnames or "load_balancing_loss_func" in code.co_names


def router_loss_of(model: nn.Module) -> RouterLoss | None:
    """The load-balancing loss ``model`` adds to its training loss: None unless its config sets
    ``output_router_logits=True``. A model that sets it but does not say where its router logits come from (its
    ``_can_record_outputs``) or what the loss's constants are is refused, naming what is missing."""
    if not adds_balance_loss(model):
        return None
    recorder = getattr(model, "_can_record_outputs", None) or {}
    recorder = recorder.get("router_logits")
    router = getattr(recorder, "target_class", recorder)
    constants = {name: getattr(model, name, None) for name in ("num_experts", "num_experts_per_tok")}
    missing = [name for name, value in constants.items() if value is None]
    if not isinstance(router, type) or missing:
        what = "which module records its router logits (_can_record_outputs['router_logits'])" \
            if not isinstance(router, type) else f"its {', '.join(missing)}"
        raise ValueError(f"{type(model).__name__} sets config.output_router_logits=True, but does not declare {what}: "
                         "its load-balancing loss cannot be computed layer by layer; set output_router_logits=False "
                         "or train it without layered accumulation")
    return RouterLoss(router=router, index=int(getattr(recorder, "index", 0) or 0),
                      num_experts=int(constants["num_experts"]), top_k=int(constants["num_experts_per_tok"]),
                      coefficient=aux_loss_coefficient(model))


@dataclass
class RoutingRecords:
    """One micro-batch's routing, layer by layer (detached), and, once every layer has run, the gradient weight each
    layer's probability sums get (``weight``). A layer run twice (forward, then recompute) records the same values
    under the same index."""

    counts: dict[int, torch.Tensor] = field(default_factory=dict)
    """layer -> (experts,) top-k assignments of the layer's rows."""
    probabilities: dict[int, torch.Tensor] = field(default_factory=dict)
    """layer -> (experts,) router probabilities summed over the layer's rows."""
    rows: dict[int, int] = field(default_factory=dict)
    weight: torch.Tensor | None = None


def layer_routing(logits: torch.Tensor, loss: RouterLoss) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's router logits (rows, experts) -> (top-k assignments per expert, detached; probabilities summed
    per expert, with their graph), as ``load_balancing_loss_func`` counts them (without an attention mask). The
    counts are a scatter into a fixed-size vector: no size read on the host."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    chosen = torch.topk(probabilities, loss.top_k, dim=-1).indices.reshape(-1)
    counts = torch.zeros(loss.num_experts, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
    return counts, probabilities.sum(dim=0)


def run_recording_routers(loss: RouterLoss, block: nn.Module, index: int, records: RoutingRecords,
                          run: Callable[[], Any]) -> tuple[Any, torch.Tensor | None]:
    """``run()`` (the block's call at layer ``index``) with its routers' logits recorded -> (its output, the term
    through which the layer's backward gets the load-balancing loss's gradient; None where the block routes
    nothing). The term's value is 0: the head adds the loss's value (:func:`finish_micro_batch`)."""
    captured: list[torch.Tensor] = []

    def record(module: nn.Module, args: Any, output: Any) -> None:
        captured.append(output[loss.index] if isinstance(output, (tuple, list)) else output)

    handles = [m.register_forward_hook(record) for m in block.modules() if isinstance(m, loss.router)]
    try:
        output = run()
    finally:
        for handle in handles:
            handle.remove()
    if not captured:
        return output, None
    counts, probabilities, rows = None, None, 0
    for logits in captured:
        layer_counts, layer_probabilities = layer_routing(logits, loss)
        counts = layer_counts if counts is None else counts + layer_counts
        probabilities = layer_probabilities if probabilities is None else probabilities + layer_probabilities
        rows += logits.shape[0]
    records.counts[index], records.probabilities[index] = counts, probabilities.detach()
    records.rows[index] = rows
    return output, _DeferredBalance.apply(probabilities, records)


def finish_micro_batch(loss: RouterLoss, records: RoutingRecords) -> torch.Tensor | None:
    """After every layer of a micro-batch has run: its load-balancing loss (detached, None where nothing routed),
    and each layer's gradient weight stored in ``records`` for their backward."""
    if not records.counts:
        return None
    layers = sorted(records.counts)
    counts = torch.stack([records.counts[k] for k in layers]).sum(dim=0)
    probabilities = torch.stack([records.probabilities[k] for k in layers]).sum(dim=0)
    rows = float(sum(records.rows[k] for k in layers))
    records.weight = loss.coefficient * loss.num_experts * counts / rows ** 2
    return loss.num_experts * torch.sum((counts / rows) * (probabilities / rows))


class _DeferredBalance(torch.autograd.Function):
    """A zero whose backward gives a layer's probability sums the load-balancing loss's gradient, read from the
    micro-batch's records at backward time (the head has set it by then)."""

    @staticmethod
    def forward(ctx: Any, probabilities: torch.Tensor, records: RoutingRecords) -> torch.Tensor:
        ctx.records = records
        return probabilities.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        weight = ctx.records.weight
        if weight is None:
            raise RuntimeError("a layer's load-balancing term ran its backward before the micro-batch's head computed "
                               "the loss (finish_micro_batch)")
        return grad * weight.to(grad.device), None
