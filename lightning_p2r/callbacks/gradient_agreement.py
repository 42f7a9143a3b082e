"""How much the layers sharing a block agree on the direction its weights should move.

While layers share a block, autograd sums their gradient contributions and the individual contributions are lost.
For a linear layer they are cheap to recover: the contribution of one call is ``grad_output^T @ input``. The probe
hooks every ``nn.Linear`` inside a shared block for one forward/backward pass, rebuilds each call's (= each
layer's) weight gradient, and reports the mean pairwise cosine similarity between layers, averaged over the
linear layers. Near 1: the layers pull the shared weights the same way (sharing costs little). Near 0 or below:
they pull apart, the signal Yang et al. (2021) use to stop sharing.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class GradientAgreementProbe:
    """Hooks the linear layers of ``holder``'s shared blocks until :meth:`finish` (or :meth:`remove`) is called."""

    def __init__(self, holder: nn.Module) -> None:
        uses = [holder.layer_to_block.count(index) for index in range(len(holder.blocks))]
        self._calls: dict[nn.Module, list[list[torch.Tensor]]] = {}
        self._handles: list[RemovableHandle] = []
        for index, block in enumerate(holder.blocks):
            if uses[index] < 2:
                continue
            for module in block.modules():
                if isinstance(module, nn.Linear):
                    self._calls[module] = []
                    self._handles.append(module.register_forward_hook(self._record))

    def _record(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if not output.requires_grad:
            return
        entry = [inputs[0].detach()]
        self._calls[module].append(entry)
        output.register_hook(lambda grad: entry.append(grad.detach()))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def finish(self) -> float | None:
        """Remove the hooks; the mean pairwise cosine similarity of per-layer gradients (None if not measured)."""
        self.remove()
        scores = []
        for calls in self._calls.values():
            grads = [
                (grad.reshape(-1, grad.shape[-1]).float().T @ x.reshape(-1, x.shape[-1]).float()).flatten()
                for x, *rest in calls if rest for grad in rest[:1]
            ]
            if len(grads) >= 2:
                scores.append(mean_pairwise_cosine(torch.stack(grads)))
        self._calls.clear()
        return float(torch.stack(scores).mean()) if scores else None


def mean_pairwise_cosine(vectors: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity over distinct pairs of rows of ``vectors`` (rows, dim)."""
    unit = torch.nn.functional.normalize(vectors, dim=1)
    similarity = unit @ unit.T
    count = vectors.shape[0]
    return (similarity.sum() - similarity.diagonal().sum()) / (count * (count - 1))
