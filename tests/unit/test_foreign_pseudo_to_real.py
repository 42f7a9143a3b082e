"""Pseudo-to-Real on a decoder the package did not write (issue 38 item 6): a Hugging Face model whose layers share
blocks (``sharing.share_layers``), delinked mid-run by ``PseudoToReal`` under ``P2RStrategy``: the function kept
exactly, the optimizer state carried ("scale"), the model's own parameter names, and a resume bit-identical."""

import re
from pathlib import Path

import lightning as L
import pytest
import torch
from hf_models import CONFIGS, Losses, windows

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

from lightning_p2r import P2RStrategy, PseudoToReal  # noqa: E402
from lightning_p2r.causal_lm import STRUCTURE_KEY, CausalLMModule  # noqa: E402
from lightning_p2r.sharing import delink, find_block_sequence  # noqa: E402


def _module(family: str = "llama_tied", blocks: int | None = 1, sharing: str = "sequence") -> CausalLMModule:
    return CausalLMModule(hf_config=CONFIGS[family], optimizer={"lr": 1e-2, "warmup_steps": 0}, init_seed=3,
                          num_unique_blocks=blocks, sharing=sharing)


@pytest.mark.parametrize(("family", "sharing", "blocks"), [("llama_tied", "sequence", 1), ("llama", "cycle", 2),
                                                            ("qwen3_moe", "sequence", 2)])
def test_delinking_a_shared_decoder_keeps_its_function_names_and_scaled_state(family: str, sharing: str,
                                                                              blocks: int) -> None:
    module = _module(family, blocks, sharing)
    module.configure_model()
    layers = module.model.model.layers
    assert len({id(layer) for layer in layers}) == blocks and len(layers) == 4
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    tokens = windows(4, 16)[:, :-1]
    module(tokens).float().pow(2).mean().backward()
    optimizer.step()
    before = module(tokens)
    shared_state = {name: optimizer.state[p]["exp_avg"].clone() for name, p in module.named_parameters()}
    old_map = list(find_block_sequence(module).layer_to_block)
    new_optimizer = delink(module, optimizer, num_unique_blocks=4)
    torch.testing.assert_close(module(tokens), before, rtol=0, atol=0)  # exactly the same function
    assert len({id(layer) for layer in layers}) == 4
    reference = _module(family, None)
    reference.configure_model()
    assert list(module.state_dict()) == list(reference.state_dict())  # the model's own names, once each
    copies = 4 // blocks
    for name, param in module.named_parameters():
        state = new_optimizer.state[param]["exp_avg"]
        if ".layers." not in name:
            torch.testing.assert_close(state, shared_state[name])
            continue
        head, rest = name.split(".layers.")
        layer, inner = rest.split(".", 1)
        # Before delinking, a shared block's tensors were named by the first layer that ran it.
        source = f"{head}.layers.{old_map.index(old_map[int(layer)])}.{inner}"
        torch.testing.assert_close(state, shared_state[source] / copies)


def _fit(tmp_path: Path, module: CausalLMModule, callbacks: list, steps: int, ckpt_path: Path | None = None,
         strategy: dict | None = None) -> list[float]:
    losses = Losses()
    L.Trainer(accelerator="cpu", devices=1, strategy=P2RStrategy(**(strategy or {})), max_steps=steps, logger=False,
              enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
              default_root_dir=tmp_path, callbacks=[losses, *callbacks], limit_val_batches=0,
              ).fit(module, torch.utils.data.DataLoader(windows(), batch_size=4), ckpt_path=ckpt_path,
                    weights_only=True)
    return losses.losses


@pytest.mark.parametrize(("family", "strategy"), [("llama_tied", {}), ("llama_tied", {"offload_fraction": 0.5}),
                                                  ("llama_tied", {"sharding": "zero3"})],
                         ids=["none", "offload", "zero3"])
def test_pseudo_to_real_under_the_strategy_resumes_bit_identical(tmp_path: Path, family: str, strategy: dict) -> None:
    """ZeRO-3 with a tied head: the delinking's gather of the FSDP2 model keeps the tie (it failed on it once)."""
    # 4 batches per epoch: the checkpoint at step 4 ends an epoch, so the resumed run reads the same batches.
    straight = _fit(tmp_path / "straight", _module(family), [PseudoToReal(delink_at_step=2)], steps=6,
                    strategy=strategy)
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1,
                                                save_on_train_epoch_end=False)
    first = _fit(tmp_path / "first", _module(family), [PseudoToReal(delink_at_step=2), saver], steps=6,
                 strategy=strategy)
    path = next((tmp_path / "ckpt").glob("*step=4.ckpt"))
    if path.is_file():  # a sharded (directory) checkpoint records it in its metadata file
        assert torch.load(path, weights_only=True)[STRUCTURE_KEY] == {"num_unique_blocks": 4}
    resumed = _module(family)  # built pseudo: the checkpoint makes it real before its weights load
    rest = _fit(tmp_path / "second", resumed, [PseudoToReal(delink_at_step=2)], steps=6, ckpt_path=path,
                strategy=strategy)
    assert first == straight  # the checkpoint changed nothing
    assert rest == straight[4:]  # steps 5 and 6 again, from the step-4 checkpoint: bit-identical
    assert len({id(layer) for layer in resumed.model.model.layers}) == 4


def test_a_pseudo_decoder_trains_like_the_real_model_with_its_layers_tied(tmp_path: Path) -> None:
    """The pseudo model is the real one with its layers' weights kept equal: built from the same seed, its first
    loss equals that of the real model whose layers all hold block 0's values."""
    pseudo = _module(blocks=1)
    pseudo.configure_model()
    real = _module(blocks=None)
    real.configure_model()
    real.load_state_dict(pseudo.state_dict())  # every layer's names load block 0's tensors
    tokens = windows(4, 16)[:, :-1]
    torch.testing.assert_close(real(tokens), pseudo(tokens))


def test_layers_that_are_not_alike_are_not_shared() -> None:
    """Qwen3 with two full-attention layers then two sliding-window ones: the first half and the second half may
    each share a block ("sequence"), but a full layer running a sliding layer's block ("cycle") would change the
    function, and is refused by name before any training."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lightning_p2r.sharing import share_layers

    def model() -> Qwen3ForCausalLM:
        return Qwen3ForCausalLM(Qwen3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, use_sliding_window=True, sliding_window=8, max_window_layers=2))

    halves = model()
    share_layers(halves, halves.model.layers, 2, "sequence")
    assert halves.model.layers[1] is halves.model.layers[0] and halves.model.layers[3] is halves.model.layers[2]
    alternating = model()
    with pytest.raises(ValueError, match=r"layer 2 would run layer 0's block .* self_attn\.layer_type is "
                                         r"'full_attention' on one and 'sliding_attention' on the other"):
        share_layers(alternating, alternating.model.layers, 2, "cycle")
    assert len({id(layer) for layer in alternating.model.layers}) == 4  # refused before anything changed


def _shallow(family: str = "llama_tied", growth_init: str = "zero_outputs") -> CausalLMModule:
    return CausalLMModule(hf_config=CONFIGS[family], optimizer={"lr": 1e-2, "warmup_steps": 0}, init_seed=3,
                          num_unique_blocks=1, pseudo_depth="shallow", growth_init=growth_init)


@pytest.mark.parametrize("family", ["llama_tied", "qwen3_moe", "gpt2"])
def test_a_shallow_decoder_grows_to_the_real_one_keeping_its_function_names_and_state(family: str) -> None:
    """Growth of a foreign decoder (G_stack's stacking): one layer run, grown to four by copying it; with the
    residual branches' output projections zeroed the function is kept exactly, the grown model has the real model's
    names, its layers are numbered again, and only the zeroed tensors start without optimizer state."""
    module = _shallow(family)
    module.configure_model()
    layers = module._layers()
    assert len(layers) == 1 and find_block_sequence(module).full_depth == 4
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    tokens = windows(4, 16)[:, :-1]
    module(tokens).float().pow(2).mean().backward()
    optimizer.step()
    before = module(tokens)
    new_optimizer = delink(module, optimizer)
    torch.testing.assert_close(module(tokens), before, rtol=0, atol=0)
    assert len(layers) == 4 and len({id(layer) for layer in layers}) == 4
    reference = _module(family, None)
    reference.configure_model()
    assert list(module.state_dict()) == list(reference.state_dict())
    if family != "gpt2":
        assert [layer.self_attn.layer_idx for layer in layers] == [0, 1, 2, 3]
    outputs = module._declared().residual_outputs
    for name, param in module.named_parameters():
        layer = re.search(r"\.(?:layers|h)\.(\d+)\.", name)
        zeroed = layer is not None and int(layer.group(1)) > 0 and name.endswith(outputs)  # a gained layer's
        assert bool(new_optimizer.state.get(param)) != zeroed, name
        if zeroed:
            assert not param.any(), name


def test_plain_growth_changes_the_function_and_a_shallow_model_needs_its_output_names() -> None:
    module = _shallow("llama", growth_init="copy")
    module.configure_model()
    tokens = windows(4, 16)[:, :-1]
    before = module(tokens).detach()
    delink(module)
    assert not torch.allclose(module(tokens), before)
    with pytest.raises(ValueError, match="set num_unique_blocks to the layers it starts with"):
        CausalLMModule(hf_config=CONFIGS["llama"], pseudo_depth="shallow")
    with pytest.raises(ValueError, match="pseudo_depth must be 'shared' or 'shallow'"):
        CausalLMModule(hf_config=CONFIGS["llama"], num_unique_blocks=1, pseudo_depth="deep")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [{}, {"offload_fraction": 0.5}, {"sharding": "zero3"}],
                         ids=["none", "offload", "zero3"])
def test_growth_under_the_strategy_trains_and_resumes_bit_identical(tmp_path: Path, strategy: dict) -> None:
    straight = _fit(tmp_path / "straight", _shallow(), [PseudoToReal(delink_at_step=2)], steps=6, strategy=strategy)
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1,
                                                save_on_train_epoch_end=False)
    first = _fit(tmp_path / "first", _shallow(), [PseudoToReal(delink_at_step=2), saver], steps=6,
                 strategy=strategy)
    resumed = _shallow()  # built shallow: the checkpoint grows it before its weights load
    rest = _fit(tmp_path / "second", resumed, [PseudoToReal(delink_at_step=2)], steps=6,
                ckpt_path=next((tmp_path / "ckpt").glob("*step=4.ckpt")), strategy=strategy)
    assert first == straight and rest == straight[4:]
    assert len({id(layer) for layer in resumed.model.model.layers}) == 4
    plain = _fit(tmp_path / "plain", _shallow(), [PseudoToReal(delink_at_step=2)], steps=6)
    assert straight == pytest.approx(plain, rel=1e-5)  # the layout changes nothing
