"""Model FLOPs and the accelerator peaks MFU is measured against (issue 40 item 4).

MFU = model FLOPs per second / the device's peak. Model FLOPs count what the model must compute, not what a run
happens to do: the forward's matmuls over the *active* parameters (an MoE token pays for its router and its top-k
experts, not every expert) plus the attention scores and mix, times 3 for forward and backward (recomputation is
not counted, as in the PaLM and torchtitan definitions). The peaks are the vendors' dense (no sparsity) figures.
"""

from __future__ import annotations

import torch

# (device-name fragment, compute dtype) -> dense peak TFLOP/s per device, from the vendors' data sheets (SXM parts).
# Matched in order: the first fragment found in torch.cuda.get_device_name() wins, so "H100 PCIe" precedes "H100".
PEAK_TFLOPS: tuple[tuple[str, str, float], ...] = (
    ("H100 PCIe", "bf16", 756.0), ("H100 PCIe", "fp32", 51.0),
    ("H100", "bf16", 989.4), ("H100", "fp32", 66.9),
    ("H200", "bf16", 989.4), ("H200", "fp32", 66.9),
    ("B200", "bf16", 2250.0), ("B200", "fp32", 80.0),
    ("A100", "bf16", 312.0), ("A100", "fp32", 19.5),
)


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


def peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """The table's peak for a device name (as CUDA reports it) computing in ``dtype``; None when not listed."""
    key = dtype_key(dtype)
    for fragment, kind, value in PEAK_TFLOPS:
        if fragment in device_name and kind == key:
            return value
    return None


def training_flops_per_token(forward_flops_per_token: float) -> float:
    """Forward + backward: the backward computes two matmuls (input and weight gradients) per forward matmul."""
    return 3.0 * forward_flops_per_token


def mfu(tokens_per_second: float, forward_flops_per_token: float, peak: float | None) -> float:
    """Model FLOPs utilization of one device (``tokens_per_second`` is that device's); NaN without a peak."""
    if not peak:
        return float("nan")
    return training_flops_per_token(forward_flops_per_token) * tokens_per_second / (peak * 1e12)
