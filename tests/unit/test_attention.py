import pytest
import torch

from lightning_p2r.models import (
    CausalSelfAttention,
    M6Config,
    M6Transformer,
    band_chunk_size,
    banded_attention,
    local_causal_mask,
)


def test_local_mask_matches_its_definition() -> None:
    seq_len, window = 9, 3
    mask = local_causal_mask(seq_len, window)
    for i in range(seq_len):
        for j in range(seq_len):
            assert bool(mask[i, j]) == (0 <= i - j < window), (i, j)


def test_local_mask_with_wide_window_is_dense_causal() -> None:
    assert torch.equal(local_causal_mask(6, 6), torch.ones(6, 6).tril().bool())


def _explicit_attention(attn: CausalSelfAttention, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    batch, seq, dim = x.shape
    # Head-major projection rows: head h's q, k, v are rows [3h, 3h + 3) x head_dim (see CausalSelfAttention).
    q, k, v = attn.qkv(x).view(batch, seq, attn.num_heads, 3, attn.head_dim).permute(3, 0, 2, 1, 4)
    scores = (q @ k.transpose(-1, -2)) / attn.head_dim**0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    y = scores.softmax(-1) @ v
    return attn.out(y.transpose(1, 2).reshape(batch, seq, dim))


@pytest.mark.parametrize("window", [None, 1, 3, 16])
def test_banded_attention_equals_its_documented_mask(window: int | None) -> None:
    config = M6Config(dim=32, num_heads=4)
    attn = CausalSelfAttention(config).eval()
    x = torch.randn(2, 10, 32)
    mask = local_causal_mask(10, window if window is not None else 10)
    torch.testing.assert_close(attn(x, window=window), _explicit_attention(attn, x, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["dense", "alternating", "local"])
@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_model_is_causal(attention: str, positions: str) -> None:
    config = M6Config(vocab_size=64, max_seq_len=16, num_layers=2, dim=32, num_heads=4, num_experts=4,
                      attention=attention, sparse_window=3, position_embedding=positions, capacity_factor=None)
    model = M6Transformer(config).eval()
    tokens = torch.randint(0, 64, (2, 16))
    changed = tokens.clone()
    t = 7
    changed[:, t + 1] = (changed[:, t + 1] + 1) % 64
    before, after = model(tokens).logits, model(changed).logits
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1], atol=1e-6, rtol=0)
    assert not torch.allclose(before[:, t + 1], after[:, t + 1])


def test_banded_layer_cannot_see_past_its_window() -> None:
    config = M6Config(dim=16, num_heads=2)
    attn = CausalSelfAttention(config).eval()
    x = torch.randn(1, 12, 16)
    changed = x.clone()
    changed[:, 2] += 1.0
    out, out_changed = attn(x, window=4), attn(changed, window=4)
    # Position 2 is visible to queries 2..5 and to nobody after.
    torch.testing.assert_close(out[:, 6:], out_changed[:, 6:])
    assert not torch.allclose(out[:, 5], out_changed[:, 5])


def test_alternating_pattern_is_dense_on_even_layers() -> None:
    config = M6Config(num_layers=4, attention="alternating", sparse_window=8)
    assert [config.attention_window(layer) for layer in range(4)] == [None, 8, None, 8]


@pytest.mark.parametrize(("seq_len", "window"), [(300, 1), (300, 16), (257, 64), (200, 100), (130, 129), (64, 200)])
def test_chunked_band_equals_the_masked_band_with_gradients(seq_len: int, window: int) -> None:
    generator = torch.Generator().manual_seed(seq_len + window)
    q, k, v = (torch.randn(2, 3, seq_len, 8, generator=generator, requires_grad=True) for _ in range(3))
    mask = local_causal_mask(seq_len, window)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = banded_attention(q, k, v, window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(expected.shape, generator=generator)
    expected_grads = torch.autograd.grad(expected, (q, k, v), upstream)
    for got_grad, expected_grad in zip(torch.autograd.grad(got, (q, k, v), upstream), expected_grads):
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-5, rtol=1e-5)


def test_long_banded_layer_takes_the_chunked_path_and_keeps_its_outputs() -> None:
    config = M6Config(dim=32, num_heads=4)
    attn = CausalSelfAttention(config).eval()
    seq_len, window = 400, 16
    assert band_chunk_size(window) + window < seq_len // 2  # the layer chunks at this length
    x = torch.randn(1, seq_len, 32)
    torch.testing.assert_close(attn(x, window=window), _explicit_attention(attn, x, local_causal_mask(seq_len, window)),
                               atol=1e-5, rtol=1e-5)
    changed = x.clone()
    changed[:, 100] += 1.0
    out, out_changed = attn(x, window=window), attn(changed, window=window)
    torch.testing.assert_close(out[:, : 100], out_changed[:, : 100], atol=0, rtol=0)  # causal
    torch.testing.assert_close(out[:, 100 + window:], out_changed[:, 100 + window:], atol=0, rtol=0)  # banded
    assert not torch.allclose(out[:, 100 + window - 1], out_changed[:, 100 + window - 1])
