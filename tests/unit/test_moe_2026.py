"""The MoE layer of 2026 (issue 40 item 6): always-on ("shared") experts, fine-grained experts (a routed expert
hidden size of its own) and auxiliary-loss-free balancing (DeepSeek-V3's routing bias)."""

import pytest
import torch

from lightning_p2r.layout.rules import Layout, ModelShape, check_layout
from lightning_p2r.models import M6Config, MoEFeedForward
from lightning_p2r.models.moe import route_tokens, update_routing_bias, update_routing_biases
from lightning_p2r.models.transformer import M6Transformer
from lightning_p2r.planning.model import block_params, root_params


def _moe(**changes) -> MoEFeedForward:
    torch.manual_seed(0)
    return MoEFeedForward(M6Config(**({"dim": 16, "ffn_hidden_dim": 32, "num_experts": 8, "moe_top_k": 2,
                                       "capacity_factor": None} | changes)))


def test_the_bias_chooses_the_experts_and_the_probabilities_stay_the_gates() -> None:
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    bias = torch.zeros(8)
    bias[3] = 10.0  # expert 3 wins every token's first pick
    gates, experts, probs = route_tokens(logits, 1, 2, bias=bias)
    assert (experts[:, 0, 0] == 3).all()
    torch.testing.assert_close(gates, probs.gather(-1, experts))
    plain_gates, plain_experts, _ = route_tokens(logits, 1, 2, bias=torch.zeros(8))
    reference_gates, reference_experts, _ = route_tokens(logits, 1, 2)
    assert torch.equal(plain_experts, reference_experts) and torch.equal(plain_gates, reference_gates)


def test_the_bias_moves_towards_balance_within_each_routing_group() -> None:
    bias = torch.zeros(6)
    update_routing_bias(bias, torch.tensor([5.0, 1.0, 3.0, 0.0, 2.0, 4.0]), rate=0.1, groups=2)
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.1, 0.0, 0.1, 0.0, -0.1]))


def test_one_step_of_several_micro_batches_moves_the_bias_once_by_their_summed_load() -> None:
    moe = _moe(router_balance="bias", router_bias_rate=0.5)
    moe.train()
    batches = [torch.randn(24, 16, generator=torch.Generator().manual_seed(seed)) for seed in (2, 3)]
    counts = []
    for batch in batches:
        counts.append(moe(batch).stats.tokens_per_expert)
    torch.testing.assert_close(moe.step_load, (counts[0] + counts[1]).float())
    expected = torch.zeros(8)
    update_routing_bias(expected, counts[0] + counts[1], 0.5)
    summed = []
    update_routing_biases(moe, reduce=lambda load: summed.append(load.clone()) or load * 2)  # as two processes would
    torch.testing.assert_close(moe.routing_bias, expected)  # a common scale does not change the rule
    assert len(summed) == 1 and torch.equal(moe.step_load, torch.zeros(8))
    moe.eval()
    moe(batches[0])
    assert torch.equal(moe.step_load, torch.zeros(8))  # evaluation and generation do not count


def test_the_bias_is_in_checkpoints_and_the_step_load_is_not() -> None:
    state = _moe(router_balance="bias").state_dict()
    assert "routing_bias" in state and "step_load" not in state
    assert "routing_bias" not in _moe().state_dict()


def test_fine_grained_and_always_on_experts_have_their_own_sizes() -> None:
    moe = _moe(always_on_experts=2, expert_hidden_dim=8)
    assert tuple(moe.experts.w_in.shape) == (8, 16, 8)  # fine-grained: the routed experts' own hidden size
    assert tuple(moe.always_on.fc_in.weight.shape) == (16, 16)  # 2 always-on experts of hidden 8, fused
    assert moe(torch.randn(2, 12, 16)).output.shape == (2, 12, 16)


def test_the_always_on_output_is_the_mlp_of_the_input() -> None:
    moe = _moe(always_on_experts=1)
    x = torch.randn(20, 16)
    full = moe(x).output
    mlp = moe.always_on(x)
    moe.always_on = None
    torch.testing.assert_close(full, moe(x).output + mlp)


@pytest.mark.parametrize("changes", [{"always_on_experts": 2, "expert_hidden_dim": 8}, {"router_balance": "bias"},
                                     {"expert_hidden_dim": 16, "num_experts": 16, "moe_top_k": 4}])
def test_the_planner_counts_the_parameters_the_model_has(changes: dict) -> None:
    config = M6Config(**({"vocab_size": 64, "num_layers": 2, "dim": 32, "num_heads": 4, "num_experts": 8} | changes))
    model = M6Transformer(config)
    planned = sum(spec.numel for block in range(config.num_blocks) for spec in block_params(config, block))
    planned += sum(spec.numel for spec in root_params(config))
    assert planned == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("layout", "changes", "message"), [
    ({"tensor_parallel": 2}, {"always_on_experts": 1}, "always-on experts"),
    ({"expert_parallel": 2}, {"always_on_experts": 1}, "always-on experts"),
    ({"pipeline_parallel": 2, "micro_batches": 2}, {"router_balance": "bias"}, "router_balance"),
])
def test_layouts_that_cannot_run_the_new_options_are_refused_by_name(layout: dict, changes: dict,
                                                                      message: str) -> None:
    config = M6Config(**({"vocab_size": 64, "num_layers": 2, "dim": 32, "num_heads": 4, "num_experts": 8} | changes))
    with pytest.raises(ValueError, match=message):
        check_layout(Layout(**layout), 2, ModelShape.of(config))


@pytest.mark.parametrize(("field", "value"), [("always_on_experts", -1), ("expert_hidden_dim", 0),
                                              ("router_balance", "loss"), ("router_bias_rate", -0.1)])
def test_bad_values_are_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"M6Config.{field}"):
        M6Config(**{field: value})


def test_under_gradient_accumulation_the_bias_moves_once_per_optimizer_step(tmp_path) -> None:
    import lightning as L
    from helpers import TINY, tiny_data

    from lightning_p2r import M6LanguageModel, OptimizerConfig

    class Moves(L.Callback):
        def __init__(self) -> None:
            self.biases: list[torch.Tensor] = []

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            self.biases.append(pl_module.transformer.blocks[0].ffn.routing_bias.clone())

    L.seed_everything(0)
    module = M6LanguageModel(M6Config(**(TINY | {"router_balance": "bias", "router_bias_rate": 0.25})),
                             OptimizerConfig(warmup_steps=1))
    moves = Moves()
    L.Trainer(accelerator="cpu", devices=1, max_steps=2, accumulate_grad_batches=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0, default_root_dir=tmp_path, callbacks=[moves]).fit(module, tiny_data(tmp_path))
    first, second, third, fourth = moves.biases
    assert torch.equal(first, torch.zeros(4))  # the first micro-batch: no optimizer step yet
    assert second.abs().max() == 0.25 and torch.equal(third, second)  # one move per optimizer step
    assert ((fourth - second).abs() <= 0.25).all() and not torch.equal(fourth, second)


def test_loss_free_balancing_trains_under_the_strategy_built_in_place(tmp_path) -> None:
    """The routing buffers are initialized where the model is materialized (a meta build refused them once)."""
    import lightning as L
    from helpers import TINY, tiny_data

    from lightning_p2r import M6LanguageModel, OptimizerConfig, P2RStrategy

    module = M6LanguageModel(M6Config(**(TINY | {"router_balance": "bias"})), OptimizerConfig(warmup_steps=1))
    L.Trainer(accelerator="cpu", devices=1, strategy=P2RStrategy(sharding="zero3"), max_steps=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0, default_root_dir=tmp_path).fit(module, tiny_data(tmp_path))
    bias = module.transformer.blocks[0].ffn.routing_bias
    assert torch.isfinite(bias).all() and bias.abs().max() > 0


def test_the_routing_buffers_stay_float32_in_a_bf16_model_so_small_bias_steps_are_kept() -> None:
    config = M6Config(dim=16, ffn_hidden_dim=32, num_experts=8, router_balance="bias", router_bias_rate=0.001)
    moe = MoEFeedForward(config).to(torch.bfloat16)
    assert moe.router.weight.dtype == torch.bfloat16  # the weights follow the model
    assert moe.routing_bias.dtype == moe.step_load.dtype == torch.float32
    moe.routing_bias.fill_(1.0)
    load = torch.zeros_like(moe.step_load)
    load[0] = 1000.0  # expert 0 over-used: its bias moves down, the others' up
    update_routing_bias(moe.routing_bias, load, 0.001)
    assert moe.routing_bias[0].item() == pytest.approx(0.999) and moe.routing_bias[1].item() == pytest.approx(1.001)
    moe.step_load.add_(257.0)
    assert moe.step_load[0].item() == 257.0  # bf16 would hold 256
