"""Deterministic, placement-independent weight init: a parameter's initial value is a function of the model's
``init_seed`` and the parameter's name, nothing else.

Why not the global RNG: a model built on the meta device and materialized block by block, on one rank or
sharded over many, or with some blocks straight in host memory, visits its parameters in another order (or only
some of them) on each placement; values drawn from one shared stream would then differ with the placement. A
generator seeded per parameter from ``(init_seed, name)`` gives the same tensor whoever materializes it, wherever.
Values are drawn on the CPU in fp32, then cast and copied: CUDA and CPU generators give different streams.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def parameter_seed(init_seed: int, name: str) -> int:
    """A 63-bit generator seed from the model's seed and a parameter's name (stable across Python processes,
    unlike ``hash``)."""
    digest = hashlib.blake2b(f"{init_seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def draw_seed() -> int:
    """A fresh ``init_seed`` from torch's global CPU generator, so ``seed_everything`` still decides the model."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


@dataclass(frozen=True)
class InitRule:
    """The init distribution of the M6 model: LayerNorm weights 1 and biases 0, every matrix normal(0, std), and
    the output projections of residual branches normal(0, residual_std) (GPT-2's std / sqrt(2 * num_layers) by
    default; ``M6Config.residual_init``)."""

    seed: int
    std: float
    residual_std: float
    residual_outputs: tuple[str, ...] = ("attn.out.weight", "fc_out.weight", "experts.w_out")

    def value(self, name: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """The initial value of parameter ``name`` (its name inside the model), fp32 on the CPU."""
        return self.fill_(name, torch.empty(tuple(shape), dtype=torch.float32, device="cpu"))

    @torch.no_grad()
    def fill_(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Write the initial value of ``name`` into ``out`` (its whole shape): drawn in place when ``out`` is a
        contiguous fp32 CPU tensor (no temporary: a model of many GB is filled without a second copy), else drawn
        on the CPU and copied."""
        if out.dim() < 2:
            return out.fill_(0.0 if name.endswith("bias") else 1.0)
        if out.device.type != "cpu" or out.dtype != torch.float32 or not out.is_contiguous():
            return out.copy_(self.value(name, out.shape))
        std = self.residual_std if name.endswith(self.residual_outputs) else self.std
        generator = torch.Generator(device="cpu").manual_seed(parameter_seed(self.seed, name))
        return out.normal_(0.0, std, generator=generator)


@torch.no_grad()
def fill_parameters(module: torch.nn.Module, rule: InitRule, prefix: str) -> None:
    """Write every parameter of ``module`` (plain tensors, on any device) from ``rule``, naming each
    ``prefix + its name inside module``."""
    for name, param in module.named_parameters():
        rule.fill_(prefix + name, param)
