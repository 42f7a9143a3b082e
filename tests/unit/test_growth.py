"""Issue 30: a shallow pseudo model (U blocks run as U layers) grown into the real depth by the cycle map, and
experts sharing one FFN upcycled into their own copies; by hand (``delink``) and mid-fit (``PseudoToReal``)."""

from pathlib import Path

import pytest
import torch
from helpers import TINY, tiny_data, tiny_trainer
from lightning.pytorch.loggers.logger import Logger

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, PseudoToReal, delink
from lightning_p2r.models.transformer import M6Transformer

SHALLOW = TINY | {"num_layers": 4, "num_unique_blocks": 1, "sharing": "cycle", "pseudo_depth": "shallow",
                  "init_seed": 3}


def _model(**changes) -> M6Transformer:
    return M6Transformer(M6Config(**(SHALLOW | changes)))


def _tokens() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _loss(model: M6Transformer, tokens: torch.Tensor) -> float:
    logits = model(tokens[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))


def _trained(model: M6Transformer, steps: int = 2) -> torch.optim.AdamW:
    """A few AdamW steps, so the weights are no longer the init and the optimizer holds state."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = model(_tokens()[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), _tokens()[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def _block_calls(model: M6Transformer) -> list[int]:
    """The index of the block each call of one forward ran, in order."""
    calls: list[int] = []
    hooks = [block.register_forward_hook(lambda module, args, out, i=i: calls.append(i))
             for i, block in enumerate(model.blocks)]
    with torch.no_grad():
        model(_tokens())
    for hook in hooks:
        hook.remove()
    return calls


def test_shallow_forward_runs_one_layer_per_block_and_grows_to_the_depth() -> None:
    model = _model(num_layers=8, num_unique_blocks=2)
    assert _block_calls(model) == [0, 1]  # 2 of 8 layers: about a quarter of the real step's block compute
    delink(model, num_unique_blocks=4)
    assert _block_calls(model) == [0, 1, 2, 3]
    delink(model)
    assert _block_calls(model) == list(range(8))
    shared = M6Transformer(M6Config(**(SHALLOW | {"num_layers": 8, "num_unique_blocks": 2, "pseudo_depth": "shared"})))
    assert _block_calls(shared) == [0, 1] * 4  # M6-10T's pseudo model runs every layer


def test_growth_copies_block_i_mod_u_in_stages() -> None:
    model = _model(num_layers=8, num_unique_blocks=2)
    _trained(model)
    original = [{k: v.clone() for k, v in block.state_dict().items()} for block in model.blocks]
    delink(model, num_unique_blocks=4)
    delink(model)
    assert model.layer_to_block == list(range(8)) and model.config.num_unique_blocks == 8
    for i, block in enumerate(model.blocks):
        for name, value in block.state_dict().items():
            torch.testing.assert_close(value, original[i % 2][name], rtol=0, atol=0)
    assert len({id(p) for p in model.parameters()}) == len(list(model.parameters()))  # every copy its own tensors


@pytest.mark.parametrize("experts", [None, 1])
def test_identity_preserving_growth_keeps_the_loss_and_plain_growth_changes_it(experts: int | None) -> None:
    tokens = _tokens()
    losses = {}
    for growth_init in ("zero_outputs", "copy"):
        model = _model(num_unique_blocks=2, growth_init=growth_init, num_unique_experts=experts)
        optimizer = _trained(model)
        before = _loss(model, tokens)
        new_optimizer = delink(model, optimizer)
        losses[growth_init] = (before, _loss(model, tokens))
        if growth_init == "zero_outputs":
            for block in model.blocks[2:]:
                assert not block.attn.out.weight.any() and not block.ffn.experts.w_out.any()
                assert block.attn.out.weight not in new_optimizer.state  # a fresh tensor starts a fresh state
                assert block.ffn.experts.w_out not in new_optimizer.state
                assert block.attn.qkv.weight in new_optimizer.state
    before, after = losses["zero_outputs"]
    assert after == pytest.approx(before, abs=1e-6)
    before, after = losses["copy"]
    assert abs(after - before) > 1e-4  # the function changes: the model got deeper


def test_upcycled_experts_equal_the_shared_ffn() -> None:
    tokens = _tokens()
    model = _model(num_unique_blocks=None, pseudo_depth="shared", num_unique_experts=1)
    experts = model.blocks[0].ffn.experts
    assert experts.w_in.shape[0] == 1 and experts.is_shared
    _trained(model)
    shared_in, shared_out = experts.w_in.detach().clone(), experts.w_out.detach().clone()
    router = model.blocks[0].ffn.router.weight.detach().clone()
    with torch.no_grad():
        logits = model(tokens).logits
    delink(model)  # the blocks are real already: upcycles the experts only
    experts = model.blocks[0].ffn.experts
    assert experts.w_in.shape[0] == TINY["num_experts"] and not experts.is_shared
    assert model.config.num_unique_experts is None
    for e in range(TINY["num_experts"]):
        torch.testing.assert_close(experts.w_in[e], shared_in[0], rtol=0, atol=0)
        torch.testing.assert_close(experts.w_out[e], shared_out[0], rtol=0, atol=0)
    torch.testing.assert_close(model.blocks[0].ffn.router.weight, router, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, logits, rtol=0, atol=1e-6)

    noisy = _model(num_unique_blocks=None, pseudo_depth="shared", num_unique_experts=1, upcycle_noise=0.05,
                   upcycle_router="reinit")
    router = noisy.blocks[0].ffn.router.weight.detach().clone()
    delink(noisy)
    w_in = noisy.blocks[0].ffn.experts.w_in
    assert not torch.equal(w_in[0], w_in[1])  # noise broke the symmetry
    assert not torch.equal(noisy.blocks[0].ffn.router.weight, router)  # drawn afresh


def test_drop_upcycling_redraws_a_fraction_of_each_experts_hidden_units() -> None:
    """Drop-Upcycling (issue 41 item 4): half of each expert's hidden units re-drawn (w_in's columns and w_out's rows
    together), each expert its own units, the rest the shared FFN's; the same draw for the same seed."""
    def upcycled() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        model = _model(num_unique_blocks=None, pseudo_depth="shared", num_unique_experts=1, upcycle_drop=0.5)
        experts = model.blocks[0].ffn.experts
        shared_in, shared_out = experts.w_in.detach().clone(), experts.w_out.detach().clone()
        delink(model)
        experts = model.blocks[0].ffn.experts
        return experts.w_in.detach(), experts.w_out.detach(), shared_in, shared_out

    w_in, w_out, shared_in, shared_out = upcycled()
    hidden = w_in.shape[2]
    kept = []
    for e in range(TINY["num_experts"]):
        same_in = (w_in[e] == shared_in[0]).all(dim=0)  # per hidden unit: its input column unchanged
        same_out = (w_out[e] == shared_out[0]).all(dim=1)  # its output row unchanged
        assert torch.equal(same_in, same_out) and int((~same_in).sum()) == hidden // 2
        kept.append(same_in)
    assert any(not torch.equal(kept[0], other) for other in kept[1:])  # each expert drew its own units
    again = upcycled()
    assert torch.equal(again[0], w_in) and torch.equal(again[1], w_out)
    with pytest.raises(ValueError, match=r"upcycle_drop must be in \[0, 1\]"):
        M6Config(**(SHALLOW | {"upcycle_drop": 1.5}))


@pytest.mark.parametrize("policy", ["scale", "copy", "reset"])
def test_optimizer_state_is_carried_into_grown_layers_and_upcycled_experts(policy: str) -> None:
    model = _model(num_unique_blocks=1, num_unique_experts=1)
    optimizer = _trained(model)
    old = {name: optimizer.state[p] for name, p in model.named_parameters()}
    new_optimizer = delink(model, optimizer, num_unique_blocks=2, optimizer_state=policy)
    params = dict(model.named_parameters())
    qkv = new_optimizer.state.get(params["blocks.1.attn.qkv.weight"], {})
    w_in = new_optimizer.state.get(params["blocks.1.ffn.experts.w_in"], {})
    if policy == "reset":
        assert not qkv and not w_in
        return
    shared_qkv, shared_in = old["blocks.0.attn.qkv.weight"], old["blocks.0.ffn.experts.w_in"]
    # A shallow block ran once per step and its copy runs once: no rescaling of a grown layer's state.
    torch.testing.assert_close(qkv["exp_avg"], shared_qkv["exp_avg"])
    torch.testing.assert_close(qkv["exp_avg_sq"], shared_qkv["exp_avg_sq"])
    torch.testing.assert_close(qkv["step"], shared_qkv["step"])
    # Upcycled experts: the shared FFN's gradient summed all experts'; "scale" divides by their number.
    n = TINY["num_experts"] if policy == "scale" else 1
    assert w_in["exp_avg"].shape == params["blocks.1.ffn.experts.w_in"].shape
    held = [p for group in new_optimizer.param_groups for p in group["params"]]
    assert len(held) == len(params) and {id(p) for p in held} == {id(p) for p in params.values()}
    for e in range(TINY["num_experts"]):
        torch.testing.assert_close(w_in["exp_avg"][e], shared_in["exp_avg"][0] / n)
        torch.testing.assert_close(w_in["exp_avg_sq"][e], shared_in["exp_avg_sq"][0] / n**2)


@pytest.mark.parametrize("policy", ["scale", "copy"])
def test_identity_preserving_growth_starts_only_the_zeroed_outputs_afresh(policy: str) -> None:
    """Growth 1 -> 4 with zeroed outputs and upcycling: every other tensor carries its state. (The tensors to start
    afresh were once kept by id; the ids of the replaced expert weights were reused by the next blocks' upcycled w_in,
    whose state was then dropped, differently on each rank of a DDP run.)"""
    model = _model(num_unique_experts=1, growth_init="zero_outputs")
    new_optimizer = delink(model, _trained(model), optimizer_state=policy)
    zeroed = ("attn.out.weight", "attn.out.bias", "experts.w_out", "fc_out.weight", "fc_out.bias")
    for name, param in model.named_parameters():
        afresh = name.endswith(zeroed) and not name.startswith("blocks.0.")
        assert bool(new_optimizer.state.get(param)) != afresh, name


class Recorder(Logger):
    """Keeps every logged metric."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics |= {key: float(value) for key, value in metrics.items()}

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def _module(**changes) -> M6LanguageModel:
    return M6LanguageModel(M6Config(**(SHALLOW | changes)), OptimizerConfig(lr=3e-3, warmup_steps=2))



def test_fit_grows_and_upcycles_mid_run(tmp_path: Path) -> None:
    import lightning as L

    class Watch(L.Callback):
        def __init__(self) -> None:
            self.rows: list[tuple[int, int, float]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.rows.append((len(pl_module.transformer.layer_to_block), len(pl_module.transformer.blocks),
                              trainer.optimizers[0].param_groups[0]["lr"]))

    callback, watch, recorder = PseudoToReal(schedule={2: 2, 4: 4}), Watch(), Recorder()
    module = _module(num_unique_experts=1, growth_init="zero_outputs")
    trainer = tiny_trainer(tmp_path, max_steps=6, callbacks=[callback, watch], logger=recorder, val_check_interval=100)
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    assert [(layers, blocks) for layers, blocks, _ in watch.rows] == [(1, 1)] * 2 + [(2, 2)] * 2 + [(4, 4)] * 2
    first, second = callback.events
    assert (first.layers_before, first.layers_after, first.experts_upcycled) == (1, 2, True)
    assert (second.layers_before, second.layers_after, second.experts_upcycled) == (2, 4, False)
    # zero_outputs keeps the function: the same language-model loss (the new layers' router losses add to the total)
    assert first.lm_loss_after == pytest.approx(first.lm_loss_before, abs=1e-5)
    assert second.lm_loss_after == pytest.approx(second.lm_loss_before, abs=1e-5)
    assert recorder.metrics["p2r/loss_after_growth"] == pytest.approx(recorder.metrics["p2r/loss_before_growth"],
                                                                     abs=1e-5)
    assert module.transformer.blocks[3].ffn.experts.w_in.shape[0] == TINY["num_experts"]
    assert trainer.optimizers[0].param_groups[0]["params"][0] is next(module.parameters())

    # The LR schedule goes on through both growths as in a run that never grows.
    plain = Watch()
    tiny_trainer(tmp_path / "plain", max_steps=6, callbacks=[plain], val_check_interval=100).fit(
        _module(num_unique_experts=1), datamodule=tiny_data(tmp_path))
    assert [lr for *_, lr in watch.rows] == pytest.approx([lr for *_, lr in plain.rows])


@pytest.mark.parametrize(("changes", "message"), [
    ({"sharing": "sequence"}, "set sharing='cycle'"),
    ({"num_unique_experts": 3}, "num_unique_experts must divide num_experts"),
    ({"growth_init": "zeros"}, "growth_init must be one of"),
    ({"upcycle_router": "fresh"}, "upcycle_router must be one of"),
    ({"upcycle_noise": 1.5}, "upcycle_noise must be in"),
    ({"pseudo_depth": "thin"}, "pseudo_depth must be one of"),
])
def test_bad_config_is_refused_in_one_line(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        M6Config(**(SHALLOW | changes))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("callback", "message"), [
    (lambda: PseudoToReal(auto=True), "auto=True"),
    (lambda: PseudoToReal(delink_at_step=2, optimizer_state="per_layer"), "per_layer"),
])
def test_growth_refuses_what_it_cannot_carry_before_the_first_step(tmp_path: Path, callback, message: str) -> None:
    trainer = tiny_trainer(tmp_path, max_steps=4, callbacks=[callback()])
    with pytest.raises(ValueError, match=message) as error:
        trainer.fit(_module(), datamodule=tiny_data(tmp_path))
    assert "\n" not in str(error.value)


def test_shared_experts_stay_whole_under_expert_parallelism_and_tensor_parallelism_is_refused() -> None:
    """A shared FFN is not split (each expert-parallel rank runs it whole on its own tokens) until upcycling; the
    rulebook refuses tensor parallelism over it, in one line, before anything is placed."""
    from lightning_p2r.layout.rules import Layout, ModelShape, check_model

    model = _model(num_unique_experts=1)
    assert all("ffn" not in block for block in model.parallel_plan().blocks)
    shape = ModelShape.of(model.config)
    check_model(Layout(expert_parallel=2), shape)
    with pytest.raises(ValueError, match="upcycle them first") as error:
        check_model(Layout(tensor_parallel=2), shape)
    assert "\n" not in str(error.value)
    delink(model)
    assert all(block.get("ffn") == "expert" for block in model.parallel_plan().blocks)  # upcycled: split as usual
    check_model(Layout(tensor_parallel=2), ModelShape.of(model.config))


@pytest.mark.parametrize("changes", [{}, {"num_unique_blocks": None, "pseudo_depth": "shared"}])
def test_checkpoint_after_growth_and_upcycling_loads_into_the_pseudo_module(changes: dict) -> None:
    """The module records the structure (blocks, upcycled experts); loading rebuilds it before the weights."""
    trained = _module(num_unique_experts=1, **changes)
    trained.configure_model()
    delink(trained.transformer)
    checkpoint = {"state_dict": trained.state_dict()}
    trained.on_save_checkpoint(checkpoint)
    fresh = _module(num_unique_experts=1, **changes)
    fresh.on_load_checkpoint(checkpoint)
    fresh.load_state_dict(checkpoint["state_dict"])
    assert fresh.transformer.layer_to_block == list(range(4))
    with torch.no_grad():
        torch.testing.assert_close(fresh(_tokens()).logits, trained(_tokens()).logits, rtol=0, atol=0)


def test_the_callback_upcycles_a_model_whose_blocks_are_real(tmp_path: Path) -> None:
    callback = PseudoToReal(delink_at_step=2)
    module = _module(num_unique_blocks=None, pseudo_depth="shared", num_unique_experts=1)
    tiny_trainer(tmp_path, max_steps=3, callbacks=[callback], val_check_interval=100).fit(
        module, datamodule=tiny_data(tmp_path))
    (event,) = callback.events
    assert (event.blocks_before, event.blocks_after, event.experts_upcycled) == (4, 4, True)
    assert event.loss_after == pytest.approx(event.loss_before, abs=1e-5)  # router kept, no noise: same function
    assert not module.transformer.blocks[0].ffn.experts.is_shared


def _grown_weights(tmp_path: Path, strategy=None) -> tuple[dict[str, torch.Tensor], PseudoToReal, object]:
    """A shallow model with shared experts, grown and upcycled in two stages over 6 steps, with gradient clipping;
    the weights it ends with (whole, on the host)."""
    import lightning as L
    from torch.distributed.tensor import DTensor

    L.seed_everything(5)
    module, callback = _module(num_unique_experts=1, upcycle_noise=0.01), PseudoToReal(schedule={2: 2, 4: 4})
    options = {} if strategy is None else {"strategy": strategy}
    trainer = tiny_trainer(tmp_path, max_steps=6, val_check_interval=100, gradient_clip_val=0.5,
                           callbacks=[callback], **options)
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
               for k, v in module.state_dict().items()}
    return weights, callback, trainer


@pytest.mark.parametrize("options", [{"offload_fraction": 0.5}, {"sharding": "zero3", "offload_fraction": 0.5},
                                     {"sharding": "zero2"}])
def test_growth_under_p2r_strategy_matches_plain_training(tmp_path: Path, options: dict) -> None:
    """The strategy grows and upcycles the model where it lives (offloaded blocks on the host, FSDP2 shards) and
    re-places the new layers by its plan; on one process the run is bit for bit a plain one."""
    from equivalence import assert_bit_identical

    from lightning_p2r import P2RStrategy

    reference, _, _ = _grown_weights(tmp_path / "plain")
    weights, callback, trainer = _grown_weights(tmp_path / "strategy", P2RStrategy(**options))
    assert [(e.layers_before, e.layers_after) for e in callback.events] == [(1, 2), (2, 4)]
    assert_bit_identical(weights, reference)
    if "offload_fraction" in options:
        assert len(trainer.strategy.plan.offloaded) == 2  # re-planned over the 4 grown blocks


def test_growth_under_pipeline_parallelism_is_refused_in_one_line() -> None:
    from types import SimpleNamespace

    from lightning_p2r import P2RStrategy

    strategy = P2RStrategy(pipeline_parallel=2, micro_batches=2)
    with pytest.raises(ValueError, match="pipeline_parallel > 1") as error:
        PseudoToReal(delink_at_step=2)._check_growth(SimpleNamespace(strategy=strategy))
    assert "\n" not in str(error.value)
    PseudoToReal(delink_at_step=2)._check_growth(SimpleNamespace(strategy=P2RStrategy(offload_fraction=0.5)))


def test_a_run_resumed_between_growth_stages_reaches_the_same_weights(tmp_path: Path) -> None:
    """A checkpoint taken after the first growth (2 layers, experts upcycled) resumes into a module built shallow
    with shared experts, and the run ends bit-identical to the uninterrupted one."""
    import lightning as L
    from equivalence import assert_bit_identical

    def weights(module: M6LanguageModel) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    schedule, changes = {2: 2, 4: 4}, {"num_unique_experts": 1, "growth_init": "zero_outputs"}
    L.seed_everything(5)
    straight = _module(**changes)
    tiny_trainer(tmp_path / "straight", max_steps=6, val_check_interval=100,
                 callbacks=[PseudoToReal(schedule=schedule)]).fit(straight, datamodule=tiny_data(tmp_path))

    L.seed_everything(5)
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1,
                                                save_on_train_epoch_end=False)
    tiny_trainer(tmp_path / "first", max_steps=6, val_check_interval=100,
                 callbacks=[PseudoToReal(schedule=schedule), saver]).fit(_module(**changes),
                                                                         datamodule=tiny_data(tmp_path))
    path = next((tmp_path / "ckpt").glob("*step=3.ckpt"))
    callback, resumed = PseudoToReal(schedule=schedule), _module(**changes)
    tiny_trainer(tmp_path / "second", max_steps=6, val_check_interval=100, callbacks=[callback]).fit(
        resumed, datamodule=tiny_data(tmp_path), ckpt_path=path, weights_only=True)
    assert [event.step for event in callback.events] == [2, 4]
    assert resumed.transformer.layer_to_block == [0, 1, 2, 3]
    assert_bit_identical(weights(resumed), weights(straight))
