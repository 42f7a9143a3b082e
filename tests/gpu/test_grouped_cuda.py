"""CUDA checks of the grouped-GEMM expert kernel: no host synchronization (CUDA's sync debug mode raises at the
first), the loop kernel's outputs and gradients within bf16 rounding, and a compiled MoE block with no graph break.

Skipped without a GPU; on CPU the same properties are checked with a counter (tests/unit/test_grouped_experts.py).
"""

import copy

import pytest
import torch

from lightning_p2r.models import M6Config, MoEFeedForward

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _pair(**changes) -> tuple[MoEFeedForward, MoEFeedForward]:
    torch.manual_seed(0)
    config = M6Config(**({"dim": 256, "ffn_hidden_dim": 512, "num_experts": 8, "moe_top_k": 2} | changes))
    grouped = MoEFeedForward(config).cuda()
    grouped.experts.kernel = "grouped"
    loop = copy.deepcopy(grouped)
    loop.experts.kernel = "loop"
    return grouped, loop


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_grouped_moe_layer_runs_forward_and_backward_without_a_host_sync(capacity: float | None) -> None:
    grouped, _ = _pair(capacity_factor=capacity)
    x = torch.randn(2048, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        grouped(x)  # warm: lazy initialization may synchronize once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = grouped(x)
            (out.output.float().sum() + out.aux_loss + out.z_loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("capacity", [None, 0.5])
def test_grouped_kernel_matches_the_loop_on_cuda_in_bf16(capacity: float | None) -> None:
    grouped, loop = _pair(capacity_factor=capacity)
    x = torch.randn(2048, 256, device="cuda")
    outputs = []
    for moe in (grouped, loop):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = moe(x)
        out.output.float().pow(2).sum().backward()
        outputs.append((out.output.float(), moe.experts.w_in.grad.float(), moe.experts.w_out.grad.float()))
    for got, expected in zip(outputs[0], outputs[1]):
        torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-2 * expected.abs().max().item())


def test_a_compiled_moe_layer_on_the_grouped_kernel_has_no_graph_break() -> None:
    grouped, _ = _pair(capacity_factor=1.25)
    x = torch.randn(1024, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(grouped)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
