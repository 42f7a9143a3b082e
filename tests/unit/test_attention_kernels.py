"""Attention kernels by device (issue 40 item 2): banded layers run "masked", "chunked" or "flex"; "auto" follows the
CPU rule on CPU and times the candidates elsewhere, outside any compiled block; every kernel gives the reference's
output. flex_attention has no CPU backward, so training with it is checked on a GPU (tests/gpu/test_flex_cuda.py)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY

from lightning_p2r import M6Config
from lightning_p2r.models import M6Transformer, local_causal_mask
from lightning_p2r.models import attention as attention_module
from lightning_p2r.models.attention import Band, attend_band, band_kernel_by_rule, choose_bands, flex_available

needs_flex = pytest.mark.skipif(not flex_available(), reason="this torch has no flex_attention")


@pytest.mark.parametrize("kernel", ["masked", "chunked", pytest.param("flex", marks=needs_flex)])
def test_every_band_kernel_gives_the_masked_reference(kernel: str) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 160, 16) for _ in range(3))
    window = 24
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=local_causal_mask(160, window))
    band = choose_bands(kernel, {window}, tuple(q.shape), q.dtype, q.device, training=False, dropout=0.0)[window]
    assert band.kernel == kernel and (band.block_mask is not None) == (kernel == "flex")
    torch.testing.assert_close(attend_band(q, k, v, window, band), expected, atol=2e-6, rtol=1e-5)


def test_auto_on_cpu_is_the_measured_cpu_rule_and_wide_windows_get_no_band() -> None:
    for seq_len, window in [(64, 8), (1024, 64), (1024, 400), (256, 256)]:
        bands = choose_bands("auto", {window}, (1, 2, seq_len, 8), torch.float32, torch.device("cpu"),
                             training=True, dropout=0.0)
        if window >= seq_len:
            assert bands == {}  # dense causal: no band to choose
        else:
            assert bands[window].kernel == band_kernel_by_rule(seq_len, window)


def test_auto_elsewhere_takes_the_fastest_candidate_timed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timing itself is replaced (a fake device clock): the choice is the minimum of what was measured, each
    shape is timed once, and flex is not a candidate while training with attention dropout."""
    costs = {"masked": 3.0, "chunked": 1.0, "flex": 2.0}
    calls = []

    def fake_timed(shape, window, dtype, device, candidates, repeats=3):
        calls.append(candidates)
        return min(candidates, key=costs.__getitem__)

    monkeypatch.setattr(attention_module, "timed_band_kernel", fake_timed)
    monkeypatch.setattr(attention_module, "band_block_mask", lambda *args: "block mask")
    device = torch.device("meta")
    bands = choose_bands("auto", {16}, (1, 2, 128, 8), torch.bfloat16, device, training=True, dropout=0.1)
    assert bands[16] == Band("chunked") and "flex" not in calls[-1]
    costs["chunked"] = 9.0
    bands = choose_bands("auto", {16}, (1, 2, 128, 8), torch.bfloat16, device, training=False, dropout=0.1)
    assert bands[16] == Band("flex", "block mask")


def test_the_timer_picks_the_kernel_that_ran_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    """timed_band_kernel on CPU with a clock that charges each kernel a set cost per call."""
    cost = {"masked": 0.5, "chunked": 0.2}
    now = [0.0]
    current = []

    def fake_attend(q, k, v, window, band, dropout_p=0.0):
        current.append(band.kernel)
        return attention_module.banded_attention(q, k, v, window)

    def fake_clock():
        now[0] += cost[current[-1]] / 2 if current else 0.0  # start and end each advance by half a call
        return now[0]

    monkeypatch.setattr(attention_module, "attend_band", fake_attend)
    monkeypatch.setattr(attention_module.time, "perf_counter", fake_clock)
    attention_module._TIMED.clear()
    chosen = attention_module.timed_band_kernel((1, 1, 64, 4), 8, torch.float32, torch.device("cpu"),
                                                ("masked", "chunked"), repeats=2)
    assert chosen == "chunked"
    attention_module._TIMED.clear()


def test_flex_cannot_train_on_cpu_and_says_what_to_use() -> None:
    with pytest.raises(ValueError, match="attention_kernel='flex' cannot train on CPU"):
        choose_bands("flex", {8}, (1, 2, 64, 8), torch.float32, torch.device("cpu"), training=True, dropout=0.0)
    with pytest.raises(ValueError, match="attention_kernel"):
        M6Config(**(TINY | {"attention_kernel": "fast"}))


@pytest.mark.parametrize("kernel", ["masked", "chunked", pytest.param("flex", marks=needs_flex)])
def test_a_banded_m6_model_gives_the_same_logits_with_every_kernel(kernel: str) -> None:
    config = M6Config(**(TINY | {"attention": "alternating", "sparse_window": 4, "max_seq_len": 64}))
    reference = M6Transformer(config).eval()
    chosen = M6Transformer(M6Config(**(TINY | {"attention": "alternating", "sparse_window": 4, "max_seq_len": 64,
                                               "attention_kernel": kernel}))).eval()
    chosen.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, TINY["vocab_size"], (2, 64))
    with torch.no_grad():
        context = chosen.layer_context(tokens)
        assert set(context.bands) == {4} and context.bands[4].kernel == kernel
        torch.testing.assert_close(chosen(tokens).logits, reference(tokens).logits, atol=1e-5, rtol=1e-5)
