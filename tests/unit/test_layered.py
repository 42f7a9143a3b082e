"""Layered gradient accumulation must give the gradients of standard accumulation on the same micro-batches.

The comparisons are of gradients after one backward, not of trained weights: the two schedules add the
micro-batches' contributions to a shared or accumulated gradient in another order, so they agree to fp32
reduction-order noise (about 1e-7 relative to the tensor's largest entry), and nothing amplifies that noise before
the comparison (no optimizer step). The tolerance, 1e-6 of the tensor's largest entry, is 10x above the noise on
any CPU and far below a missing micro-batch (a quarter to a half of the gradient). Comparisons that must be
exact (recompute against keeping activations, the stage methods against forward) use bit equality or the default
fp32 tolerance of the same operations in the same order.
"""

import weakref
from collections import namedtuple

import pytest
import torch
from helpers import TINY, AccumulationResult, run_depth_first, run_layered
from torch import nn

from lightning_p2r import M6Config, M6LanguageModel
from lightning_p2r.strategy.layered import BlockEvents, LayeredStages, split_micro_batches

# Strong router losses, so an error in how the extra losses are weighted would show in the gradients.
ROUTER = {"router_aux_loss_coef": 0.1, "router_z_loss_coef": 0.01}


def _module(**changes) -> M6LanguageModel:
    module = M6LanguageModel(M6Config(**(TINY | changes)))
    module.configure_model()
    return module


def _batch(rows: int = 4, seq: int = 13) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (rows, seq + 1))


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return grads


def _depth_first(module: M6LanguageModel, micro_batches: list[torch.Tensor]) -> AccumulationResult:
    def loss_fn(micro_batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        result = module.losses(micro_batch)
        return result["loss"], {"ce": result["ce"], "aux": result["aux"], "z": result["z"]}

    return run_depth_first(loss_fn, micro_batches)


def _assert_grads_close(actual: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor | None]) -> None:
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        got = actual[name]
        assert (got is None) == (want is None), name
        if want is not None:
            # fp32 summation order differs between the schedules: absolute tolerance relative to the scale
            atol = 1e-6 * max(1.0, float(want.abs().max()))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=name)


def _compare(module: M6LanguageModel, micro_batches: int, recompute: bool, batch: torch.Tensor | None = None) -> None:
    parts = split_micro_batches(_batch() if batch is None else batch, micro_batches)
    reference = _depth_first(module, parts)
    expected = _grads(module)
    result = run_layered(module.layered_stages(), parts, recompute=recompute)
    actual = _grads(module)
    _assert_grads_close(actual, expected)
    torch.testing.assert_close(result.loss, reference.loss, rtol=1e-6, atol=1e-6)
    for key in ("ce", "aux", "z"):
        torch.testing.assert_close(result.metrics[key], reference.metrics[key], rtol=1e-6, atol=1e-6)
    assert all(g is not None for g in actual.values())  # every parameter of the LM takes part


MODELS = {
    "dense": {"moe_layers": []},
    "moe_dropless": {"capacity_factor": None, **ROUTER},
    "moe_capacity": {"capacity_factor": 1.0, "moe_top_k": 2, **ROUTER},
    "moe_some_layers_prototypes": {"num_layers": 4, "moe_layers": [1, 3], "num_prototypes": 2, **ROUTER},
    "pseudo": {"num_layers": 4, "num_unique_blocks": 1, **ROUTER},
    "grouped_sharing_alternating": {"num_layers": 4, "num_unique_blocks": 2, "attention": "alternating",
                                    "sparse_window": 4, **ROUTER},
    "untied_learned_positions": {"tie_embeddings": False, "position_embedding": "learned", **ROUTER},
}


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_layered_matches_depth_first(model: str, micro_batches: int, recompute: bool) -> None:
    module = _module(**MODELS[model])
    assert module.config.tie_embeddings == (model != "untied_learned_positions")
    _compare(module, micro_batches, recompute)


def test_stage_methods_compose_to_forward() -> None:
    model = _module(num_layers=4, num_unique_blocks=2, attention="alternating", sparse_window=4).transformer
    tokens = _batch()[:, :-1]
    out = model(tokens)
    x, context = model.embed(tokens)
    for layer in range(model.num_layers):
        x, _ = model.run_layer(layer, x, context)
    assert torch.equal(model.head(x), out.logits)


def test_layered_dropout_with_recompute_reuses_the_masks() -> None:
    # The schedules draw dropout masks in different orders, so under dropout layered accumulation is compared with
    # itself: recomputing must reproduce the masks of the first forward, and leave the global RNG where it was.
    module = _module(dropout=0.2, router_jitter=0.1, **ROUTER)
    parts = split_micro_batches(_batch(), 2)
    runs = {}
    for recompute in (False, True):
        torch.manual_seed(123)
        result = run_layered(module.layered_stages(), parts, recompute=recompute)
        runs[recompute] = (_grads(module), result.loss, torch.rand(()))
    _assert_grads_close(runs[True][0], runs[False][0])
    torch.testing.assert_close(runs[True][1], runs[False][1])
    assert runs[True][2] == runs[False][2]

    torch.manual_seed(321)  # other masks: the comparison above is not vacuous
    run_layered(module.layered_stages(), parts, recompute=True)
    other = _grads(module)
    assert not torch.allclose(other["transformer.tok_embeddings.weight"],
                              runs[True][0]["transformer.tok_embeddings.weight"])


def test_layered_under_autocast_matches_depth_first() -> None:
    module = _module(**ROUTER)
    parts = split_micro_batches(_batch(), 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = _depth_first(module, parts)
        expected = _grads(module)
        result = run_layered(module.layered_stages(), parts, recompute=True)
        actual = _grads(module)
    torch.testing.assert_close(result.loss, reference.loss, rtol=1e-3, atol=1e-3)
    for name, want in expected.items():
        torch.testing.assert_close(actual[name], want, rtol=2e-2, atol=2e-2 * float(want.abs().max()), msg=name)


class Recorder(BlockEvents):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def before_forward(self, block: int) -> None:
        self.calls.append(("before_forward", block))

    def after_forward(self, block: int) -> None:
        self.calls.append(("after_forward", block))

    def before_backward(self, block: int) -> None:
        self.calls.append(("before_backward", block))

    def before_micro_backward(self, block: int, micro_batch: int, last: bool) -> None:
        self.calls.append(("before_micro_backward", block, micro_batch, last))

    def after_backward(self, block: int) -> None:
        self.calls.append(("after_backward", block))


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_events_fire_per_layer_around_the_block_computation(recompute: bool) -> None:
    module = _module(num_layers=4, num_unique_blocks=2)
    assert module.transformer.layer_to_block == [0, 0, 1, 1]
    m = 3
    events = Recorder()
    for block_index, block in enumerate(module.transformer.blocks):
        block.register_forward_pre_hook(
            lambda *args, b=block_index: events.calls.append(("run", b, torch.is_grad_enabled())))
    run_layered(module.layered_stages(), split_micro_batches(_batch(rows=3), m), events, recompute=recompute)

    expected: list[tuple] = []
    for block in [0, 0, 1, 1]:
        expected += [("before_forward", block), *[("run", block, not recompute)] * m, ("after_forward", block)]
    for block in [1, 1, 0, 0]:
        expected.append(("before_backward", block))
        for i in range(m):
            expected.append(("before_micro_backward", block, i, i == m - 1))
            if recompute:
                expected.append(("run", block, True))
        expected.append(("after_backward", block))
    assert events.calls == expected


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_activations_are_freed_as_backward_goes(recompute: bool) -> None:
    num_layers, m = 3, 2
    module = _module(num_layers=num_layers, **ROUTER)
    stages = module.layered_stages()
    seen: dict[int, list[weakref.ref]] = {layer: [] for layer in range(num_layers)}
    run_layer = stages.layer

    def layer(index: int, hidden: torch.Tensor, context):
        out, extra = run_layer(index, hidden, context)
        seen[index] += [weakref.ref(hidden), weakref.ref(out)]
        return out, extra

    class CheckFreed(BlockEvents):
        def __init__(self) -> None:
            self.layer = num_layers

        def after_backward(self, block: int) -> None:
            # Freed by reference counting alone (no gc.collect): a cycle would hold them until the next collection.
            self.layer -= 1
            alive = [layer for layer in range(self.layer, num_layers) for ref in seen[layer] if ref() is not None]
            assert not alive, f"activations of layers {sorted(set(alive))} outlive their backward"

    stages.layer = layer
    events = CheckFreed()
    result = run_layered(stages, split_micro_batches(_batch(), m), events, recompute=recompute)
    assert events.layer == 0
    assert all(len(refs) == (4 if recompute else 2) * m for refs in seen.values())
    assert result.loss.grad_fn is None and all(v.grad_fn is None for v in result.metrics.values())


def _toy() -> tuple[nn.ModuleList, nn.Parameter, LayeredStages, callable]:
    """Stages with the awkward cases: inputs that need no grad, layers without an extra loss, a frozen layer and
    a parameter nothing uses."""
    layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
    layers[1].requires_grad_(False)
    unused = nn.Parameter(torch.ones(2))

    def embed(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["x"], batch["y"]  # a plain input: the first boundary needs no grad upstream

    def layer(index: int, hidden: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = layers[index](hidden).tanh()
        return out, 0.3 * out.square().mean() if index == 0 else None

    def head(hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = (hidden - target).square().mean()
        return loss, {"mse": loss.detach()}

    def loss_fn(batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hidden, target = embed(batch)
        total = torch.zeros(())
        for index in range(len(layers)):
            hidden, extra = layer(index, hidden, target)
            total = total + (extra if extra is not None else 0.0)
        loss, metrics = head(hidden, target)
        return loss + total, metrics

    return layers, unused, LayeredStages(embed=embed, layer=layer, head=head, layer_to_block=[0, 1, 2]), loss_fn


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_toy_stages_match_depth_first(recompute: bool) -> None:
    layers, unused, stages, loss_fn = _toy()
    batch = {"x": torch.randn(4, 6), "y": torch.randn(4, 6), "note": "shared by every micro-batch"}
    parts = split_micro_batches(batch, 2)
    assert parts[1]["note"] == batch["note"] and torch.equal(parts[1]["x"], batch["x"][2:])
    reference = run_depth_first(loss_fn, parts)
    expected = _grads(layers)
    result = run_layered(stages, parts, recompute=recompute)
    actual = _grads(layers)
    _assert_grads_close(actual, expected)
    assert expected["1.weight"] is None and expected["0.weight"] is not None
    assert unused.grad is None
    torch.testing.assert_close(result.loss, reference.loss)
    torch.testing.assert_close(result.metrics["mse"], reference.metrics["mse"])


def test_split_micro_batches_structures_and_errors() -> None:
    Pair = namedtuple("Pair", "a b")
    parts = split_micro_batches(Pair(torch.arange(6), [torch.zeros(6, 2), 7]), 3)
    assert len(parts) == 3 and isinstance(parts[0], Pair) and isinstance(parts[0].b, list)
    assert parts[2].a.tolist() == [4, 5] and parts[2].b[0].shape == (2, 2) and parts[2].b[1] == 7
    with pytest.raises(ValueError, match="batch size 6 is not divisible by micro_batches=4"):
        split_micro_batches(torch.zeros(6, 3), 4)
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
        split_micro_batches(torch.zeros(6, 3), 0)
    with pytest.raises(ValueError, match="0-dim"):
        split_micro_batches({"x": torch.tensor(1.0)}, 2)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        run_layered(_toy()[2], [])
    with torch.no_grad(), pytest.raises(RuntimeError, match="gradients enabled"):
        run_layered(_toy()[2], [{"x": torch.randn(2, 6), "y": torch.randn(2, 6)}])


def test_layered_stages_metrics_and_logging_keys() -> None:
    module = _module(num_layers=4, moe_layers=[1, 3], **ROUTER)
    stages = module.layered_stages()
    result = run_layered(stages, split_micro_batches(_batch(), 2))
    for key in ("ce", "loss", "aux", "z", "moe/load_max_over_mean", "moe/layer3/dropped_fraction"):
        assert key in result.metrics, key
    assert "moe/layer0/dropped_fraction" not in result.metrics
    torch.testing.assert_close(result.metrics["loss"], result.loss)

    logged: dict[str, torch.Tensor] = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)  # no Trainer needed
    stages.log_metrics(result.metrics)
    expected_keys = {"train/loss", "train/total_loss", "train/aux_loss", "train/z_loss", "moe/load_max_over_mean"}
    assert expected_keys <= logged.keys()
    assert torch.equal(logged["train/loss"], result.metrics["ce"])

    dense = _module(moe_layers=[]).layered_stages()
    metrics = run_layered(dense, [_batch(rows=2)]).metrics
    assert float(metrics["aux"]) == 0.0 and float(metrics["z"]) == 0.0


def test_recompute_reruns_layers_under_the_first_forwards_autocast() -> None:
    """The forward runs inside the training step's bf16 autocast, the backward (and the rerun) outside it: the rerun
    must use the same autocast settings, so recompute=True is bit-identical to keeping activations (issue 13 3)."""
    from lightning_p2r.strategy.layered import layered_forward

    module = _module(num_layers=2, moe_layers=[1], capacity_factor=None, **ROUTER)
    parts = split_micro_batches(_batch(), 2)
    runs = {}
    for recompute in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step = layered_forward(module.layered_stages(), parts, recompute=recompute)
        step.backward()  # outside autocast, as P2RStrategy.backward runs it
        runs[recompute] = _grads(module)
    for name, grad in runs[False].items():
        assert (grad is None) == (runs[True][name] is None), name
        if grad is not None:
            assert torch.equal(grad, runs[True][name]), name
