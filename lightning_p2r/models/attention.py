"""Causal self-attention: dense, or locally banded sparse (GPT-3 / mGPT alternate the two across layers)."""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .cache import LayerKV
from .config import M6Config


def local_causal_mask(seq_len: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean (seq_len, seq_len) mask, True where query i may attend key j: ``0 <= i - j < window``.

    This is the "locally banded" pattern of GPT-3's sparse layers: causal, and each token sees itself and the
    ``window - 1`` tokens before it. With ``window >= seq_len`` it equals the dense causal mask.
    """
    positions = torch.arange(seq_len, device=device)
    distance = positions[:, None] - positions[None, :]  # (query, key)
    return (distance >= 0) & (distance < window)


def band_chunk_size(window: int) -> int:
    """Query chunk length for :func:`banded_attention`.

    Each chunk of C queries reads C + window keys, so the work is T * (C + window): small chunks waste less on keys
    outside the band, but below about 64 queries the kernel's per-call overhead dominates. A quarter of the window,
    at least 64, measured fastest on CPU for windows of 64 to 512 (``python -m lightning_p2r.benchmarks.attention``).
    """
    return max(64, window // 4)


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """Locally banded causal attention whose cost grows with seq_len x window, not seq_len squared.

    q, k, v: (batch, heads, seq, head_dim). The result equals ``scaled_dot_product_attention`` with
    :func:`local_causal_mask` up to float rounding. The queries are cut into chunks of C; chunk c attends to the
    C + window keys that end with it (keys before position 0 are zero padding, masked out), so every chunk is a
    small dense problem with the same band mask, batched through one fused attention call.
    """
    batch, heads, seq_len, head_dim = q.shape
    chunk = band_chunk_size(window)
    num_chunks = -(-seq_len // chunk)
    tail = num_chunks * chunk - seq_len
    # Padding at the end is never attended by a real query (it lies in every real query's future).
    q = F.pad(q, (0, 0, 0, tail))
    k, v = (F.pad(t, (0, 0, window, tail)) for t in (k, v))
    span = chunk + window

    def key_windows(t: torch.Tensor) -> torch.Tensor:
        # (batch, heads, chunks, head_dim, span) view -> (batch * heads, chunks, span, head_dim) copy; the flash
        # kernel takes 4-d inputs only, which is why batch and heads are merged.
        return t.unfold(2, span, chunk).transpose(-1, -2).reshape(batch * heads, num_chunks, span, head_dim)

    query = torch.arange(chunk, device=q.device)[:, None]
    key = torch.arange(span, device=q.device)[None, :]
    first_key_position = torch.arange(num_chunks, device=q.device)[:, None, None] * chunk - window
    # Query i of a chunk sits at offset window + i of its key span: it sees offsets (i, window + i].
    mask = (key > query) & (key <= window + query) & (first_key_position + key >= 0)
    y = F.scaled_dot_product_attention(q.reshape(batch * heads, num_chunks, chunk, head_dim), key_windows(k),
                                       key_windows(v), attn_mask=mask[None], dropout_p=dropout_p)
    return y.reshape(batch, heads, num_chunks * chunk, head_dim)[:, :, :seq_len]


def cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                     window: int | None) -> torch.Tensor:
    """Attention of the queries at positions ``[start, start + new)`` to the cached keys of positions
    ``[0, start + new)``, under the same rule as the full forward: causal, and with a ``window`` only the ``window``
    positions ending at the query (banded layers). Keys before the first query's band are not read at all, so a
    banded layer's step costs ``window`` keys, not the whole prefix.

    q: (batch, heads, new, head_dim); keys, values: (batch, heads, start + new, head_dim).
    """
    new = q.shape[2]
    end = start + new
    first = 0 if window is None else max(0, start - window + 1)
    keys, values = keys[:, :, first:end], values[:, :, first:end]
    mask = None
    if new > 1:  # one query sees every key left after the slice: no mask needed
        distance = torch.arange(start, end, device=q.device)[:, None] - torch.arange(first, end, device=q.device)
        mask = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None, start: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_dim // 2) for positions ``[start, start + seq_len)``, in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (first half, second half) of x: (batch, heads, seq, head_dim)."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.to(x.dtype)


@dataclass(frozen=True)
class Band:
    """The kernel one banded layer runs in this forward call, chosen outside the (possibly compiled) block, with
    the flex block mask when the kernel is "flex" (built once per length and window, never inside a traced block)."""

    kernel: str
    block_mask: Any = None


def band_kernel_by_rule(seq_len: int, window: int) -> str:
    """The CPU rule: chunked when the band touches fewer keys than causal attention's seq_len / 2 per query, else
    the masked fused kernel (measured on 2 CPU cores with ``python -m lightning_p2r.benchmarks.attention``)."""
    return "chunked" if band_chunk_size(window) + window < seq_len // 2 else "masked"


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=32)
def band_block_mask(seq_len: int, window: int, device: str) -> Any:
    """flex_attention's block mask of the band ``0 <= q - k < window`` for one length (cached: built once)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def in_band(batch: Any, head: Any, query: Any, key: Any) -> Any:
        return (query >= key) & (query - key < window)

    return create_block_mask(in_band, None, None, seq_len, seq_len, device=device)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # flex's fused kernels exist only compiled; eager flex is a reference


def flex_band_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """Banded attention through ``flex_attention`` (compiled off CPU; on CPU the eager reference, forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu":
        with warnings.catch_warnings():  # eager on purpose: compiling per length costs more than CPU inference
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q, k, v, block_mask=block_mask)
    if torch.compiler.is_compiling():  # inside a compiled block: traced into its graph like any other op
        return flex_attention(q, k, v, block_mask=block_mask)
    return _compiled_flex()(q, k, v, block_mask=block_mask)


def attend_band(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, band: Band,
                dropout_p: float = 0.0) -> torch.Tensor:
    """Run one banded layer's attention core with ``band``'s kernel."""
    if band.kernel == "flex":
        return flex_band_attention(q, k, v, band.block_mask)
    if band.kernel == "chunked":
        return banded_attention(q, k, v, window, dropout_p=dropout_p)
    mask = local_causal_mask(q.shape[-2], window, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


_TIMED: dict[tuple, str] = {}


def timed_band_kernel(shape: tuple[int, int, int, int], window: int, dtype: torch.dtype, device: torch.device,
                      candidates: tuple[str, ...], repeats: int = 3) -> str:
    """The fastest of ``candidates`` for q, k, v of ``shape`` (batch, heads, seq, head_dim), forward + backward,
    timed once per shape, window, dtype and device in this process (a first call warms each kernel up, flex's
    compile included) and remembered."""
    key = (shape, window, dtype, str(device), candidates)
    if key not in _TIMED:
        seq_len = shape[2]
        generator = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=generator).requires_grad_()
                   for _ in range(3))
        seconds = {}
        for kernel in candidates:
            band = Band(kernel, band_block_mask(seq_len, window, str(device)) if kernel == "flex" else None)
            times = []
            for _ in range(repeats + 1):  # the first call warms up (and compiles flex): left out of the median
                _synchronize(device)
                start = time.perf_counter()
                attend_band(q, k, v, window, band).sum().backward()
                _synchronize(device)
                times.append(time.perf_counter() - start)
            seconds[kernel] = statistics.median(times[1:])
        _TIMED[key] = min(seconds, key=seconds.__getitem__)
    return _TIMED[key]


def _synchronize(device: torch.device) -> None:
    # measure.run.synchronize does this too, but measure sits above the models (it imports the LightningModule).
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def choose_bands(kernel: str, windows: set[int], shape: tuple[int, int, int, int], dtype: torch.dtype,
                 device: torch.device, *, training: bool, dropout: float) -> dict[int, Band]:
    """The kernel of each banded window narrower than the sequence for one forward call (``M6Config.
    attention_kernel``): a named kernel as is; "auto" by the CPU rule on CPU (deterministic, measured there), and
    elsewhere by timing the candidates once per shape (flex among them where it can run: not while training with
    attention dropout, which flex lacks)."""
    seq_len = shape[2]
    bands = {}
    for window in sorted(w for w in windows if w < seq_len):
        chosen = kernel
        if kernel == "auto":
            if device.type == "cpu":
                chosen = band_kernel_by_rule(seq_len, window)
            else:
                candidates = ("masked", "chunked") + (("flex",) if flex_available() and not (
                    training and dropout > 0) else ())
                chosen = timed_band_kernel(shape, window, dtype, device, candidates)
        elif kernel == "flex":
            if not flex_available():
                raise ValueError("M6Config.attention_kernel='flex' needs torch.nn.attention.flex_attention")
            if training and device.type == "cpu":
                raise ValueError("M6Config.attention_kernel='flex' cannot train on CPU (torch has no flex_attention "
                                 "backward there): use 'auto', 'chunked' or 'masked'")
            if training and dropout > 0:
                raise ValueError("M6Config.attention_kernel='flex' has no attention dropout: set dropout=0 or use "
                                 "'auto'")
        bands[window] = Band(chosen, band_block_mask(seq_len, window, str(device)) if chosen == "flex" else None)
    return bands


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``.

    The band width is an argument of ``forward``, not a property of the weights: a block shared by several layers
    (pseudo model) runs dense in one layer and banded in the next, exactly as the real model would. With a ``cache``
    (incremental decoding) x holds the tokens after the cached ones: their keys and values are stored, and their
    queries attend to every cached position their band reaches.
    """

    def __init__(self, config: M6Config) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                window: int | None = None, cache: LayerKV | None = None, band: Band | None = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # Head-major projection rows (head 0's q, k, v, then head 1's, ...), as Megatron-LM lays them out: a
        # column-parallel split of qkv then hands each tensor-parallel rank whole heads, and the head count here is
        # read from the projection's width, so the same code runs on all heads or on a rank's share of them.
        qkv = self.qkv(x).view(batch, seq_len, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k, v = qkv.unbind(0)  # each (batch, heads, seq, head_dim)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        dropout = self.dropout if self.training else 0.0
        if cache is not None:
            start = cache.start
            keys, values = cache.store(k, v)
            if start > 0:  # a prefix is cached; from position 0 (the prompt) the full forward's path below is exact
                y = cached_attention(q, keys, values, start, window)
                return self.out(y.transpose(1, 2).reshape(batch, seq_len, -1))
        if window is None or window >= seq_len:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:  # the kernel the model chose for this call (choose_bands), or the CPU rule when called alone
            y = attend_band(q, k, v, window, band or Band(band_kernel_by_rule(seq_len, window)), dropout_p=dropout)
        return self.out(y.transpose(1, 2).reshape(batch, seq_len, -1))
