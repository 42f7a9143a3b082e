"""A Hugging Face MoE's load-balancing loss (``config.output_router_logits=True``): added to the training loss as the
model's own loss adds it, and computed layer by layer under layered accumulation with the whole model's value and
gradients (``lightning_p2r.models.router_loss``); pipelines refuse it."""

from pathlib import Path

import lightning as L
import pytest
import torch
from hf_models import CONFIGS, Losses, windows
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

from lightning_p2r import P2RStrategy  # noqa: E402
from lightning_p2r.causal_lm import CausalLMModule  # noqa: E402
from lightning_p2r.models.decoders import decoder_parts, decoder_pipeline_parts, decoder_stages  # noqa: E402
from lightning_p2r.models.router_loss import (  # noqa: E402
    RouterLoss,
    RoutingRecords,
    finish_micro_batch,
    router_loss_of,
    run_recording_routers,
)
from lightning_p2r.module import next_token_batch  # noqa: E402

BALANCED = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
"""A weight large enough that a missing or wrong router gradient shows in the weights after a few steps."""


def _module(family: str) -> CausalLMModule:
    return CausalLMModule(hf_config=CONFIGS[family] | BALANCED, optimizer={"lr": 1e-2, "warmup_steps": 0},
                          init_seed=3)


def _fit(tmp_path: Path, family: str, strategy: object, batch: int, accumulate: int = 1, steps: int = 3
         ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, float]]:
    L.seed_everything(0)
    module, losses = _module(family), Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        accumulate_grad_batches=accumulate, default_root_dir=tmp_path, callbacks=[losses])
    trainer.fit(module, torch.utils.data.DataLoader(windows(rows=4 * steps), batch_size=batch))
    weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
               for k, v in module.state_dict().items()}
    return losses.losses, weights, {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_the_training_loss_adds_the_models_load_balancing_loss_with_its_coefficient() -> None:
    """Hugging Face computes the loss (``output.aux_loss``) but adds it only when given labels; the module adds it to
    its next-token cross-entropy with the model's ``router_aux_loss_coef``, as the model's own loss would."""
    module = _module("qwen3_moe")
    module.configure_model()
    batch = windows(rows=4)
    inputs, targets = next_token_batch(batch)
    output = module.model(input_ids=inputs, use_cache=False)
    ce = torch.nn.functional.cross_entropy(output.logits.reshape(-1, output.logits.shape[-1]), targets.reshape(-1))
    expected = load_balancing_loss_func(output.router_logits, 4, 2)
    assert expected.item() > 1.0  # Switch's loss is 1 when perfectly balanced, more otherwise
    assert module.training_step(batch, 0).item() == pytest.approx((ce + 0.5 * expected).item(), rel=1e-6)


def test_layer_records_give_the_pooled_loss_and_its_gradient_for_every_layer() -> None:
    """Three layers' router logits through the records (each layer's term, then the head's pooled value) against
    Hugging Face's ``load_balancing_loss_func`` over the three: the same value, and the same gradient in every
    layer's logits."""
    torch.manual_seed(0)
    balance = RouterLoss(router=torch.nn.Identity, index=0, num_experts=6, top_k=2, coefficient=0.3)
    logits = [torch.randn(10, 6, requires_grad=True) for _ in range(3)]
    records = RoutingRecords()
    terms = []
    router = torch.nn.Identity()  # stands for a layer whose router returns these logits
    for index, layer_logits in enumerate(logits):
        _, term = run_recording_routers(balance, router, index, records, lambda x=layer_logits: router(x))
        terms.append(term)
    value = finish_micro_batch(balance, records)
    torch.stack(terms).sum().backward()
    ours = [x.grad.clone() for x in logits]
    for x in logits:
        x.grad = None
    expected = load_balancing_loss_func(tuple(logits), 6, 2)
    (0.3 * expected).backward()
    assert value.item() == pytest.approx(expected.item(), rel=1e-6)
    for mine, theirs in zip(ours, logits):
        torch.testing.assert_close(mine, theirs.grad, rtol=1e-6, atol=1e-8)
        assert theirs.grad.abs().sum() > 0


@pytest.mark.parametrize(("family", "layout"), [
    ("qwen3_moe", {"accumulation": "layered", "micro_batches": 2}),
    ("mixtral", {"accumulation": "layered", "micro_batches": 2, "recompute": True}),
    # Qwen2-MoE: dense layers between the MoE ones (no router there), and a shared expert
    ("qwen2_moe", {"accumulation": "layered", "micro_batches": 2, "sharding": "zero3", "offload_fraction": 0.5}),
    # one process's block streamer (offloaded blocks fetched around each layer's call)
    ("qwen3_moe", {"accumulation": "layered", "micro_batches": 2, "offload_fraction": 0.5}),
])
def test_layered_accumulation_trains_with_the_pooled_loss_like_the_whole_model(tmp_path: Path, family: str,
                                                                            layout: dict) -> None:
    """Layered accumulation over 2 micro-batches against a plain Trainer accumulating the same 2 micro-batches of
    the whole model: the same losses (with the router loss in them) and the same weights after 3 steps. The loss
    pools all layers' routing, so each layer's gradient is applied only once the head has run."""
    plain, plain_weights, plain_metrics = _fit(tmp_path, family, "auto", batch=2, accumulate=2)
    layered, weights, metrics = _fit(tmp_path, family, P2RStrategy(**layout), batch=4)
    # A plain Trainer reports each micro-batch's loss divided by the accumulation count.
    assert layered == pytest.approx([a + b for a, b in zip(plain[::2], plain[1::2])], rel=1e-5)
    assert metrics["train/aux_loss"] > 1.0
    assert metrics["train/loss"] == pytest.approx(metrics["train/ce"] + 0.5 * metrics["train/aux_loss"], rel=1e-5)
    assert set(weights) == set(plain_weights)
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_pipelines_refuse_the_pooled_loss_and_name_the_setting() -> None:
    module = _module("mixtral")
    module.configure_model()
    assert router_loss_of(module.model).num_experts == 4
    with pytest.raises(ValueError, match="output_router_logits=False for pipeline parallelism"):
        parts = decoder_parts(module.model)
        stages = decoder_stages(module.model, parts, list(range(4)), next_token_batch)
        decoder_pipeline_parts(module.model, parts, stages, next_token_batch)
