import math

import pytest
import torch

from lightning_p2r.benchmarks.gpu import parameter_counts
from lightning_p2r.measure.throughput import mfu, peak_tflops
from lightning_p2r.models import M6Config
from lightning_p2r.models.transformer import M6Transformer


def test_peaks_are_found_by_the_name_cuda_reports() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H100 PCIe", torch.bfloat16) == pytest.approx(756.0)
    assert peak_tflops("NVIDIA A100-SXM4-80GB", torch.float32) == pytest.approx(19.5)
    assert peak_tflops("AMD EPYC 7B13", torch.bfloat16) is None


def test_mfu_is_three_forwards_per_token_over_the_peak() -> None:
    assert mfu(1000.0, 2e9, 6.0) == pytest.approx(3 * 2e9 * 1000 / 6e12)
    assert math.isnan(mfu(1000.0, 2e9, None))


@pytest.mark.parametrize("changes", [{"moe_layers": []}, {"num_experts": 4, "moe_top_k": 2},
                                     {"num_experts": 8, "num_prototypes": 2, "moe_layers": [1]}])
def test_parameter_counts_match_the_built_model(changes: dict) -> None:
    config = M6Config(**({"vocab_size": 64, "num_layers": 2, "dim": 32, "num_heads": 4} | changes))
    total, active = parameter_counts(config)
    assert total == sum(p.numel() for p in M6Transformer(config).parameters())
    per_expert = 2 * config.dim * config.hidden_dim
    moe_layers = sum(config.is_moe_layer(layer) for layer in range(config.num_layers))
    unused = config.num_experts - config.num_prototypes * config.moe_top_k
    assert total - active == moe_layers * unused * per_expert
