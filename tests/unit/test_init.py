"""Deterministic, placement-independent init: every way of building the model gives the same weights, bit for bit."""

import pytest
import torch
from helpers import TINY

from lightning_p2r import M6Config
from lightning_p2r.models import M6Transformer
from lightning_p2r.models.init import parameter_seed

CONFIGS = {
    "dense_real": TINY | {"num_layers": 4, "moe_layers": []},
    "moe_real": TINY | {"num_layers": 4, "moe_layers": [1, 3]},
    "dense_shared": TINY | {"num_layers": 4, "num_unique_blocks": 1, "moe_layers": []},
    "moe_shared": TINY | {"num_layers": 4, "num_unique_blocks": 2},
}


def _config(name: str, **changes) -> M6Config:
    return M6Config(**(CONFIGS[name] | {"init_seed": 7} | changes))


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_meta_then_init_weights_equals_eager(name: str) -> None:
    eager = M6Transformer(_config(name))
    with torch.device("meta"):
        lazy = M6Transformer(_config(name))
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights()
    _assert_identical(_weights(eager), _weights(lazy))
    assert (lazy.lm_head.weight is lazy.tok_embeddings.weight) == lazy.config.tie_embeddings


@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_by_block_equals_eager(name: str) -> None:
    eager = M6Transformer(_config(name))
    with torch.device("meta"):
        lazy = M6Transformer(_config(name))
    # Blocks in reverse order, each on its own, then the rest: the order of materialization does not matter.
    for block in reversed(lazy.blocks):
        block.to_empty(device="cpu")
        block.init_weights()
    in_blocks = set(lazy.blocks.modules())
    for module in lazy.modules():
        if module not in in_blocks:
            module.to_empty(device="cpu", recurse=False)
    lazy.init_non_block_weights()
    _assert_identical(_weights(eager), _weights(lazy))


def test_initial_value_by_name_matches_the_parameter() -> None:
    model = M6Transformer(_config("moe_real"))
    for name, param in model.named_parameters():
        assert torch.equal(model.initial_value(name), param.detach())


def test_values_follow_the_seed_not_the_global_rng() -> None:
    torch.manual_seed(0)
    a = _weights(M6Transformer(_config("dense_real")))
    torch.manual_seed(1)
    b = _weights(M6Transformer(_config("dense_real")))
    c = _weights(M6Transformer(_config("dense_real", init_seed=8)))
    _assert_identical(a, b)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])


def test_without_a_seed_the_global_rng_decides() -> None:
    config = CONFIGS["dense_real"]
    torch.manual_seed(0)
    a = _weights(M6Transformer(M6Config(**config)))
    torch.manual_seed(0)
    b = _weights(M6Transformer(M6Config(**config)))
    torch.manual_seed(1)
    c = _weights(M6Transformer(M6Config(**config)))
    _assert_identical(a, b)
    assert not torch.equal(a["tok_embeddings.weight"], c["tok_embeddings.weight"])


def test_the_distribution_is_kept() -> None:
    """normal(0, 0.02), residual output projections std / sqrt(2L), LayerNorms 1 and 0, no two tensors alike."""
    config = M6Config(**(TINY | {"num_layers": 8, "dim": 256, "num_heads": 4, "moe_layers": [0], "init_seed": 3}))
    model = M6Transformer(config)
    residual = 0.02 / (2 * 8) ** 0.5
    params = dict(model.named_parameters())
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.02)
    assert params["blocks.1.attn.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.02)
    assert params["blocks.1.attn.out.weight"].std().item() == pytest.approx(residual, rel=0.02)
    assert params["blocks.1.ffn.fc_out.weight"].std().item() == pytest.approx(residual, rel=0.02)
    assert params["blocks.0.ffn.experts.w_out"].std().item() == pytest.approx(residual, rel=0.02)
    assert params["blocks.0.ffn.router.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(params["blocks.2.attn_norm.weight"], torch.ones(256))
    assert torch.equal(params["blocks.2.attn_norm.bias"], torch.zeros(256))
    assert not torch.equal(params["blocks.1.attn.qkv.weight"], params["blocks.2.attn.qkv.weight"])


def test_seeds_are_stable_and_distinct() -> None:
    assert parameter_seed(0, "blocks.0.attn.qkv.weight") == parameter_seed(0, "blocks.0.attn.qkv.weight")
    seeds = {parameter_seed(s, f"blocks.{i}.w") for s in range(3) for i in range(50)}
    assert len(seeds) == 150 and all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "7"])
def test_a_bad_seed_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="init_seed"):
        M6Config(**(TINY | {"init_seed": bad}))


@pytest.mark.parametrize(("residual_init", "blocks", "count"), [
    ("depth", 2, 8), ("applications", 2, 32), ("blocks", 2, 2), ("applications", None, 8), ("blocks", None, 8)])
def test_residual_init_divides_by_what_it_names(residual_init: str, blocks: int | None, count: int) -> None:
    """A shared block applied g times can start its residual outputs smaller ("applications") or larger
    ("blocks"); the real model is the same under every choice but "blocks" with fewer blocks than layers."""
    config = M6Config(**(TINY | {"num_layers": 8, "dim": 256, "num_heads": 4, "moe_layers": [], "init_seed": 3,
                                 "num_unique_blocks": blocks, "residual_init": residual_init}))
    out = dict(M6Transformer(config).named_parameters())["blocks.0.attn.out.weight"]
    assert out.std().item() == pytest.approx(0.02 / (2 * count) ** 0.5, rel=0.03)


def test_unknown_residual_init_is_refused() -> None:
    with pytest.raises(ValueError, match="residual_init"):
        M6Config(**(TINY | {"residual_init": "sqrt"}))
