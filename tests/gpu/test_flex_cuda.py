"""CUDA checks of the flex kernel for banded layers (issue 40 item 2): forward and gradients of the compiled
``flex_attention`` with a band block mask against the masked fused kernel, an M6 model that trains on "flex" like on
"masked", a compiled banded block with no graph break, and "auto" choosing among the kernels by timing.

Skipped without a GPU (torch has no flex_attention backward on CPU; the forward is checked there in
tests/unit/test_attention_kernels.py).
"""

import pytest
import torch
import torch.nn.functional as F

from lightning_p2r.models import M6Config, M6Transformer, local_causal_mask
from lightning_p2r.models.attention import Band, attend_band, band_block_mask, choose_bands, flex_available

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not flex_available(), reason="this torch has no flex_attention")]

CONFIG = {"vocab_size": 512, "max_seq_len": 1024, "num_layers": 2, "dim": 256, "num_heads": 4, "num_experts": 4,
          "attention": "local", "sparse_window": 128, "dropout": 0.0}


def test_flex_band_gives_the_masked_outputs_and_gradients_in_bf16() -> None:
    torch.manual_seed(0)
    shape, window = (2, 4, 1024, 64), 128
    leaves = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(6)]
    results = []
    for band, (q, k, v) in [(Band("flex", band_block_mask(1024, window, "cuda")), leaves[:3]),
                            (Band("masked"), leaves[3:])]:
        with torch.no_grad():
            for mine, first in zip((q, k, v), leaves[:3]):
                mine.copy_(first)
        out = attend_band(q, k, v, window, band)
        out.float().pow(2).sum().backward()
        results.append((out.float(), q.grad.float(), k.grad.float(), v.grad.float()))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-2 * expected.abs().max().item())
    mask = local_causal_mask(1024, window, device="cuda")
    reference = F.scaled_dot_product_attention(*(t.detach().float() for t in leaves[:3]), attn_mask=mask)
    torch.testing.assert_close(results[0][0], reference, rtol=3e-2, atol=3e-2)


def _train(kernel: str, steps: int = 3) -> list[float]:
    torch.manual_seed(0)
    model = M6Transformer(M6Config(**(CONFIG | {"attention_kernel": kernel}))).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 512, (4, 1025), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_an_m6_model_trains_on_flex_like_on_the_masked_kernel() -> None:
    flex, masked = _train("flex"), _train("masked")
    assert flex == pytest.approx(masked, rel=1e-2)


def test_a_compiled_banded_block_on_flex_has_no_graph_break() -> None:
    model = M6Transformer(M6Config(**(CONFIG | {"attention_kernel": "flex"}))).cuda()
    tokens = torch.randint(0, 512, (2, 1024), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        x, context = model.embed(tokens)
        assert context.bands[128].kernel == "flex"

        def block_call(x):
            return model.blocks[0](x, rotary=context.rotary, window=128, band=context.bands[128])[0]

        explanation = torch._dynamo.explain(block_call)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_auto_times_the_kernels_on_the_gpu_and_keeps_its_choice() -> None:
    shape = (2, 4, 4096, 64)
    first = choose_bands("auto", {128}, shape, torch.bfloat16, torch.device("cuda"), training=True, dropout=0.0)
    again = choose_bands("auto", {128}, shape, torch.bfloat16, torch.device("cuda"), training=True, dropout=0.0)
    assert first[128].kernel in ("masked", "chunked", "flex") and again[128].kernel == first[128].kernel
