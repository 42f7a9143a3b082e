"""The "per_layer" optimizer-state policy: measure, before delinking, the second moment each copy will need.

While ``g`` layers share a weight, AdamW's ``exp_avg_sq`` tracks the square of the *summed* gradient
``G = sum_l g_l``. After delinking, copy ``j`` gets only the sum over its own layers, ``G_j``. "scale" assumes the
layers' contributions are identical (``G_j = G / n``, so ``v_j = v / n**2``); when they are not, ``E[G_j**2]`` is
larger than that, and the copies' first updates come out too large.

:class:`SecondMomentTracker` rebuilds every layer's contribution to each shared linear and expert weight during
the last steps before a planned delinking (``GradientAgreementProbe`` with layer tags), folds them per optimizer
step into each future copy's ``G_j`` and the whole ``G``, and accumulates ``sum G_j**2`` and ``sum G**2`` per
element. At delinking each copy's ``exp_avg_sq`` becomes ``exp_avg_sq * sum G_j**2 / sum G**2``: the shared
moment, rescaled by the share of it that the copy's own gradients measured. Pure functions over tensors; the
callback decides when to attach and fold.
"""

from __future__ import annotations

import torch
from torch import nn

from ..sharing import MeasuredSecondMoments
from .gradient_agreement import GradientAgreementProbe


class SecondMomentTracker:
    """Per-element sums of each future copy's squared gradient and of the shared one, over the folded steps.

    Args:
        holder: the block sequence (``blocks`` + ``layer_to_block`` + ``run_layer``).
        new_map: the block each layer will run after the delinking (``sharing.new_layout``).
    """

    def __init__(self, holder: nn.Module, new_map: list[int]) -> None:
        self.new_map = list(new_map)
        self.old_map = list(holder.layer_to_block)
        self.probe = GradientAgreementProbe(holder, by_layer=True)
        self.copy_squares: dict[str, torch.Tensor] = {}  # new-model name -> sum over steps of G_j ** 2
        self.shared_squares: dict[str, torch.Tensor] = {}  # old-model name -> sum over steps of G ** 2
        self.steps = 0

    def fold(self) -> None:
        """Add the step the probe saw since the last fold (all its micro-batches summed) to the sums."""
        contributions, layers = self.probe.drain()
        if not contributions:
            return
        for name, calls in contributions.items():
            tags = layers[name]
            if len(tags) != len(calls) or any(tag is None for tag in tags):
                raise RuntimeError(f"per_layer: calls of {name} without a layer (run outside run_layer?)")
            rest = name.split(".", 2)[2]
            per_copy: dict[int, torch.Tensor] = {}
            for layer, contribution in zip(tags, calls):
                copy = self.new_map[layer]
                per_copy[copy] = per_copy[copy] + contribution if copy in per_copy else contribution.clone()
            shared = torch.stack(list(per_copy.values())).sum(0)
            self._add(self.shared_squares, name, shared.square())
            for copy, gradient in per_copy.items():
                self._add(self.copy_squares, f"blocks.{copy}.{rest}", gradient.square())
        self.steps += 1

    @staticmethod
    def _add(sums: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
        sums[name] = sums[name] + value if name in sums else value

    def ratios(self) -> dict[str, torch.Tensor]:
        """Each new copy's ``sum G_j**2 / sum G**2`` per element (new-model names inside the block sequence);
        elements whose shared gradient was always zero get ``1 / n**2``, the "scale" rule, n the copies per block."""
        out = {}
        for name, squares in self.copy_squares.items():
            copy, rest = name.split(".", 2)[1:]
            layer = self.new_map.index(int(copy))
            shared = self.shared_squares[f"blocks.{self.old_map[layer]}.{rest}"]
            copies = len({self.new_map[i] for i, old in enumerate(self.old_map) if old == self.old_map[layer]})
            out[name] = torch.where(shared > 0, squares / shared.clamp_min(torch.finfo(shared.dtype).tiny),
                                    torch.full_like(shared, 1.0 / copies**2))
        return out

    def finish(self) -> MeasuredSecondMoments:
        """Fold what is pending, remove the hooks, and give the policy object ``delink`` takes."""
        self.fold()
        self.probe.remove()
        return MeasuredSecondMoments(self.ratios(), steps=self.steps)

    def remove(self) -> None:
        self.probe.remove()
