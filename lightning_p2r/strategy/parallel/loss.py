"""Vocabulary-parallel cross-entropy (Megatron-LM): the loss from each tensor-parallel rank's shard of the logits,
never gathered whole. Three all-reduces of one number per token (the maximum; the sum of exponentials; the target
logit) give the sums over the vocabulary, so each rank's gradient is ``softmax - one_hot`` on its shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .experts import reduce_from_tensor_parallel


class VocabParallelCrossEntropy:
    """``loss(logits, targets)``: mean cross-entropy of logits (batch, seq, vocab or vocab / tp) against targets
    (batch, seq), in fp32. Whole logits (evaluation, where the head gathers them) take the ordinary path."""

    def __init__(self, tp_mesh: Any, vocab_size: int) -> None:
        self.tp_mesh = tp_mesh
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] == self.vocab_size:
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        # This rank's vocabulary shard: collective over the tensor-parallel ranks, which hold the same tokens' shards.
        group = self.tp_mesh.get_group()
        shard = logits.shape[-1]
        if shard * dist.get_world_size(group) != self.vocab_size:
            raise ValueError(f"the vocabulary-parallel loss got logits {shard} wide: neither the vocabulary "
                             f"({self.vocab_size}) nor one tensor-parallel rank's share of it; a model whose forward "
                             "changes the logits' width after its head cannot train with tensor_parallel > 1")
        start = dist.get_rank(group) * shard
        logits = logits.float().reshape(-1, shard)  # (tokens, shard)
        targets = targets.reshape(-1)
        peak = logits.detach().max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)
        sum_exp = reduce_from_tensor_parallel(shifted.exp().sum(dim=-1), self.tp_mesh)
        local = targets - start
        here = (local >= 0) & (local < shard)
        picked = shifted.gather(1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1) * here
        target_logit = reduce_from_tensor_parallel(picked, self.tp_mesh)
        return (sum_exp.log() - target_logit).mean()
