import pytest

from lightning_p2r import M6Config, OptimizerConfig


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"dim": 30, "num_heads": 4}, "num_heads"),
        ({"num_layers": 6, "num_unique_blocks": 4}, "num_unique_blocks"),
        ({"num_unique_blocks": 0}, "num_unique_blocks"),
        ({"num_experts": 6, "num_prototypes": 4}, "num_prototypes"),
        ({"num_experts": 4, "moe_top_k": 5}, "moe_top_k"),
        ({"num_experts": 8, "num_prototypes": 4, "moe_top_k": 3}, "moe_top_k"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"dropout": 1.0}, "dropout"),
        ({"attention": "banded"}, "attention"),
        ({"position_embedding": "alibi"}, "position_embedding"),
        ({"sparse_window": 0}, "sparse_window"),
        ({"moe_layers": [7]}, "moe_layers"),
        ({"moe_layers": [1, 1]}, "moe_layers"),
        ({"num_layers": 4, "num_unique_blocks": 1, "moe_layers": [0, 2]}, "moe_layers"),
        ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef"),
        ({"num_experts": 2.5}, "num_experts"),
        ({"dim": 12, "num_heads": 4, "position_embedding": "rotary"}, "rotary"),
        ({"rope_theta": 0.0}, "rope_theta"),
    ],
)
def test_invalid_model_config_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        M6Config(**changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"lr": -1e-3}, "lr"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_invalid_optimizer_config_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        OptimizerConfig(**changes)


def test_sharing_map() -> None:
    assert M6Config(num_layers=6, num_unique_blocks=1).layer_to_block == [0] * 6
    assert M6Config(num_layers=6, num_unique_blocks=3).layer_to_block == [0, 0, 1, 1, 2, 2]
    assert M6Config(num_layers=6).layer_to_block == list(range(6))
    assert M6Config(num_layers=6, num_unique_blocks=2).layers_of_block(1) == [3, 4, 5]


def test_moe_layers_shared_consistently_is_valid() -> None:
    config = M6Config(num_layers=4, num_unique_blocks=2, moe_layers=[2, 3])
    assert [config.is_moe_layer(layer) for layer in range(4)] == [False, False, True, True]
