"""How much the layers sharing a block agree on the direction its weights should move.

While layers share a block, autograd sums their gradient contributions and the individual contributions are lost.
For the weights of an MoE block's bulk they are cheap to recover from what each call saw:

- an ``nn.Linear`` (attention projections, dense FFN, the MoE router): one call contributes
  ``grad_output^T @ input``;
- the stacked ``Experts`` weights: expert e of one call contributes ``gelu(h_e)^T @ g_e`` to ``w_out[e]`` and
  ``x_e^T @ ((g_e @ w_out[e]^T) * gelu'(h_e))`` to ``w_in[e]``, with x_e its rows, ``h_e = x_e @ w_in[e]`` and g_e
  the gradient of its output rows.

The probe hooks these modules inside every shared block for one forward/backward pass, rebuilds each call's (=
each layer's) contribution to each weight, and reports the mean pairwise cosine similarity between the layers'
contributions, averaged over the weights (each weight counts once, whatever its size). Near 1: the layers pull the
shared weights the same way (sharing costs little). Near 0 or below: they pull apart, the signal Yang et al. (2021)
use to stop sharing. Norm weights are left out: they are a sliver of the parameters and their per-call gradient
needs the normalized input, which the norm does not expose.

The hooks read only what a forward already has at hand (inputs, outputs, and for the experts their weights while
the block runs, which is when an offloaded or sharded block holds them), so the probe works in every layout. The
experts' ``w_out`` is copied once per shared block per probe (the weights do not change within a pass).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_p2r.models.moe import Experts


class GradientAgreementProbe:
    """Hooks the linear layers and experts of ``holder``'s shared blocks until :meth:`finish` or :meth:`remove`.

    With ``by_layer=True`` it also records which layer made each call, in ``layers`` (parallel to
    ``contributions``): the holder must run its layers through ``run_layer(layer, ...)``, as ``M6Transformer``
    and the layered executor do; the probe wraps that method on the instance while it is attached.
    """

    def __init__(self, holder: nn.Module, by_layer: bool = False) -> None:
        uses = [holder.layer_to_block.count(index) for index in range(len(holder.blocks))]
        # (weight name, per-call contribution) appended as each call's output gradient arrives.
        self.contributions: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.layers: dict[str, list[int]] = defaultdict(list)
        self._handles: list[RemovableHandle] = []
        self._expert_out_weights: dict[nn.Module, torch.Tensor] = {}
        self._holder: nn.Module | None = None
        self._current_layer: int | None = None
        if by_layer:
            run_layer = getattr(holder, "run_layer", None)
            if not callable(run_layer):
                raise ValueError(f"{type(holder).__name__} has no run_layer(layer, ...) method: the probe cannot tell "
                                 "which layer made each call")

            def tagged(layer: int, *args, **kwargs):
                self._current_layer = layer
                return run_layer(layer, *args, **kwargs)
            holder.run_layer = tagged
            self._holder = holder
        for index, block in enumerate(holder.blocks):
            if uses[index] < 2:
                continue
            for name, module in block.named_modules(prefix=f"blocks.{index}"):
                if isinstance(module, nn.Linear):
                    self._handles.append(module.register_forward_hook(self._linear_hook(f"{name}.weight")))
                elif isinstance(module, Experts):
                    self._handles.append(module.register_forward_hook(self._experts_hook(name)))

    def _linear_hook(self, weight_name: str):
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if not output.requires_grad:
                return  # a no-grad forward (the first pass of a recomputed layer) has no gradient to split
            x = inputs[0].detach()
            layer = self._current_layer

            def on_grad(grad: torch.Tensor) -> None:
                self.contributions[weight_name].append(_flat(grad).T @ _flat(x))
                self._tag(weight_name, layer)
            output.register_hook(on_grad)
        return record

    def _experts_hook(self, name: str):
        def record(module: Experts, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
            if not output.requires_grad:
                return
            x, counts = inputs
            counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
            total = sum(counts)  # rows past the kept ones are dropped assignments: no gradient
            with torch.no_grad():
                x = x[:total].detach().float()
                w_in = module.w_in.detach().float()
                hidden = torch.cat([segment @ w_in[e] for e, segment in enumerate(x.split(counts))])
                if module not in self._expert_out_weights:
                    self._expert_out_weights[module] = module.w_out.detach().float().clone()
            w_out = self._expert_out_weights[module]
            layer = self._current_layer

            def on_grad(grad: torch.Tensor) -> None:
                grad_in, grad_out = expert_weight_gradients(x, hidden, grad[:total].float(), w_out, counts)
                self.contributions[f"{name}.w_in"].append(grad_in)
                self.contributions[f"{name}.w_out"].append(grad_out)
                self._tag(f"{name}.w_in", layer)
                self._tag(f"{name}.w_out", layer)
            output.register_hook(on_grad)
        return record

    def drain(self) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[int]]]:
        """Hand over what was recorded since the last drain and start afresh, hooks kept (the cached expert
        weights too are dropped: the next pass runs after an optimizer step)."""
        contributions, layers = dict(self.contributions), dict(self.layers)
        self.contributions, self.layers = defaultdict(list), defaultdict(list)
        self._expert_out_weights.clear()
        return contributions, layers

    def _tag(self, weight_name: str, layer: int | None) -> None:
        if self._holder is not None:
            self.layers[weight_name].append(layer)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._expert_out_weights.clear()
        if self._holder is not None:
            del self._holder.run_layer  # the class's own method again
            self._holder = None

    def finish(self) -> float | None:
        """Remove the hooks; the mean pairwise cosine similarity of per-layer gradients (None if not measured)."""
        self.remove()
        scores = [mean_pairwise_cosine(torch.stack([c.flatten() for c in calls]))
                  for calls in self.contributions.values() if len(calls) >= 2]
        self.contributions.clear()
        return float(torch.stack(scores).mean()) if scores else None


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1, t.shape[-1]).float()


def expert_weight_gradients(x: torch.Tensor, hidden: torch.Tensor, grad: torch.Tensor, w_out: torch.Tensor,
                            counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's gradient of the stacked expert weights from its rows ``x`` (sorted by expert, ``counts[e]`` each),
    their pre-activations ``hidden`` and the output gradient ``grad``: ``(grad of w_in, grad of w_out)``."""
    grad_in = torch.zeros(len(counts), x.shape[1], w_out.shape[1], dtype=torch.float32, device=x.device)
    grad_out = torch.zeros_like(w_out, dtype=torch.float32)
    for e, (x_e, h_e, g_e) in enumerate(zip(x.split(counts), hidden.split(counts), grad.split(counts))):
        if not counts[e]:
            continue
        with torch.enable_grad():
            h = h_e.detach().requires_grad_()
            activation = F.gelu(h)
            grad_hidden, = torch.autograd.grad(activation, h, g_e @ w_out[e].T)
        grad_out[e] = activation.detach().T @ g_e
        grad_in[e] = x_e.T @ grad_hidden
    return grad_in, grad_out


def mean_pairwise_cosine(vectors: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity over distinct pairs of rows of ``vectors`` (rows, dim)."""
    unit = torch.nn.functional.normalize(vectors, dim=1)
    similarity = unit @ unit.T
    count = vectors.shape[0]
    return (similarity.sum() - similarity.diagonal().sum()) / (count * (count - 1))
