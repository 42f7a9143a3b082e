"""Before upcycling, with one FFN shared by every expert, the MoE layer computes that FFN once per token and weighs it
by the token's kept gates (issue 41 item 4: an upcycled model's shared stage that costs less than its real step).
Checked against the general path (one FFN run per assignment, then summed) for outputs, every gradient and the
routing losses, with and without a capacity, and with prototypes."""

from dataclasses import replace

import pytest
import torch

from lightning_p2r import M6Config
from lightning_p2r.models.moe import Experts, MoEFeedForward
from lightning_p2r.planning.model import layer_forward_flops

BASE = M6Config(vocab_size=64, max_seq_len=16, num_layers=2, dim=32, num_heads=4, num_experts=8, moe_top_k=2,
                num_unique_experts=1)


@pytest.mark.parametrize("options", [{"capacity_factor": None}, {"capacity_factor": 1.0},
                                     {"num_prototypes": 2, "moe_top_k": 1, "capacity_factor": 1.25},
                                     {"normalize_gates": True, "capacity_factor": None}],
                         ids=["dropless", "capacity", "prototypes", "normalized"])
def test_one_shared_ffn_gives_the_general_paths_outputs_and_gradients(options, monkeypatch) -> None:
    config = replace(BASE, **options)
    torch.manual_seed(0)
    layer = MoEFeedForward(config)
    x = torch.randn(3, 16, config.dim, requires_grad=True)
    assert layer.experts.runs_one_ffn

    def run() -> tuple[torch.Tensor, ...]:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        ((out.output ** 2).sum() + out.aux_loss + out.z_loss).backward()
        return (out.output.detach(), out.aux_loss.detach(), out.stats.dropped_fraction, x.grad.clone(),
                *(p.grad.clone() for p in layer.parameters()))

    shortcut = run()
    monkeypatch.setattr(Experts, "runs_one_ffn", property(lambda self: False))
    general = run()
    if config.capacity_factor == 1.0:
        assert general[2] > 0  # some assignments were dropped: their gates count for nothing on both paths
    for mine, reference in zip(shortcut, general):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5)  # summed in another order


def test_the_shortcut_stays_off_where_experts_differ_or_are_split() -> None:
    assert not MoEFeedForward(replace(BASE, num_unique_experts=2)).experts.runs_one_ffn
    assert not MoEFeedForward(replace(BASE, num_unique_experts=None)).experts.runs_one_ffn
    split = MoEFeedForward(BASE).experts
    vars(split)["forward"] = lambda *args: None  # what expert parallelism installs
    assert not split.runs_one_ffn


def test_the_planner_prices_the_shared_stage_at_one_ffn_per_token() -> None:
    moe_layer = 0
    assert BASE.is_moe_layer(moe_layer)
    shared = layer_forward_flops(BASE, moe_layer, 16)
    upcycled = layer_forward_flops(replace(BASE, num_unique_experts=None), moe_layer, 16)
    two_unique = layer_forward_flops(replace(BASE, num_unique_experts=2), moe_layer, 16)
    ffn = 2 * 2 * BASE.dim * BASE.routed_hidden_dim
    assert upcycled - shared == pytest.approx(ffn * (BASE.moe_top_k - 1))
    assert two_unique == upcycled


def test_the_shortcut_compiles_without_a_graph_break() -> None:
    torch.manual_seed(0)
    layer = MoEFeedForward(replace(BASE, expert_kernel="grouped"))
    assert layer.experts.runs_one_ffn
    x = torch.randn(2, 16, BASE.dim)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
            return out.output.float().sum() + out.aux_loss

    torch._dynamo.reset()
    assert torch._dynamo.explain(step)(x).graph_break_count == 0
