"""Text generation: the KV cache against the full forward, MoE without drops, sampling, and ``lightning-p2r
generate`` end to end on a model trained to memorize a sentence (single-file and sharded checkpoints), with one
line for each bad input."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from helpers import tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy, PseudoToReal, TextDataModule
from lightning_p2r.cli import main as cli_main
from lightning_p2r.cli.generate import main
from lightning_p2r.generation import check_request, sample_next
from lightning_p2r.models import M6Transformer, MoEFeedForward, MoEOutput
from lightning_p2r.strategy.checkpoint import is_sharded_checkpoint, load_meta, read_model_state, to_single_file

SENTENCE = "In the beginning God created the heaven and the earth. "
SEQ_LEN = 32
SHARDED = "run/checkpoints/last.ckpt"
# Alternating dense and banded attention (window 8 < seq_len), MoE with a capacity that drops tokens in training
# (and none at inference), rotary positions.
MODEL = {"num_layers": 2, "dim": 48, "num_heads": 4, "moe_layers": [1], "num_experts": 4, "capacity_factor": 1.0,
         "attention": "alternating", "sparse_window": 8, "init_seed": 0}

# ------------------------------------------------------------------------------------ the cache is exact
CACHE_CASES = {
    "dense": {},
    # 150 positions: the full forward's banded layers take the chunked path (banded_attention).
    "alternating banded": {"attention": "alternating", "sparse_window": 4},
    "local banded, learned positions": {"attention": "local", "sparse_window": 5, "position_embedding": "learned"},
    "moe top-2 with prototypes and capacity": {"moe_top_k": 2, "num_prototypes": 2, "capacity_factor": 0.5},
    "pseudo: one shared block, alternating": {"num_unique_blocks": 1, "attention": "alternating",
                                              "sparse_window": 6},
    "two blocks cycled": {"num_unique_blocks": 2, "sharing": "cycle", "moe_layers": [], "attention": "local",
                          "sparse_window": 3},
}


@pytest.mark.parametrize("changes", CACHE_CASES.values(), ids=CACHE_CASES.keys())
def test_the_cache_gives_the_full_forwards_logits_at_every_position(changes: dict) -> None:
    config = M6Config(vocab_size=64, max_seq_len=160, num_layers=4, dim=32, num_heads=4, num_experts=4,
                      init_seed=3, **changes)
    model = M6Transformer(config).eval()
    tokens = torch.randint(0, 64, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens, dropless=True).logits
        cache = model.new_cache()
        # A prompt, a chunk of several tokens after cached ones (the masked path), then one token per step.
        pieces = [model(tokens[:, :9], cache=cache, dropless=True).logits,
                  model(tokens[:, 9:13], cache=cache, dropless=True).logits]
        pieces += [model(tokens[:, t:t + 1], cache=cache, dropless=True).logits for t in range(13, 150)]
    assert cache.length == 150
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=2e-5, rtol=1e-5)


def test_a_banded_layer_decodes_from_its_band_only() -> None:
    """A cached step of a banded layer reads no key outside its band: changing those keys changes nothing."""
    config = M6Config(vocab_size=64, max_seq_len=32, num_layers=1, dim=16, num_heads=2, moe_layers=[],
                      attention="local", sparse_window=4, init_seed=0)
    model = M6Transformer(config).eval()
    tokens = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.new_cache()
        model(tokens[:, :19], cache=cache)
        reference = model(tokens[:, 19:], cache=cache).logits
        cache.length = 19
        cache._keys[0][:, :, :16] = 1e4  # positions 0..15 lie outside the band of position 19 (16..19)
        torch.testing.assert_close(model(tokens[:, 19:], cache=cache).logits, reference)


def test_the_cache_refuses_positions_past_max_seq_len() -> None:
    model = M6Transformer(M6Config(vocab_size=64, max_seq_len=8, num_layers=1, dim=16, num_heads=2, init_seed=0))
    with pytest.raises(ValueError, match="exceeds M6Config.max_seq_len=8"):
        model.new_cache(9)
    cache = model.new_cache()
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="positions up to 9 exceeds M6Config.max_seq_len=8"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


# ------------------------------------------------------------------------------------- MoE drops nothing
def test_moe_at_inference_drops_no_token_while_training_keeps_its_capacity() -> None:
    config = M6Config(vocab_size=64, max_seq_len=64, num_layers=2, dim=32, num_heads=4, num_experts=4,
                      moe_top_k=2, capacity_factor=0.25, init_seed=0)
    module = M6LanguageModel(config)
    module.configure_model()
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained_path = module.transformer(tokens)
        inference = module.transformer(tokens, dropless=True)
    assert all(float(stats.dropped_fraction) > 0.5 for stats in trained_path.routing.values())  # capacity applies
    assert all(float(stats.dropped_fraction) == 0 for stats in inference.routing.values())
    assert all(int(stats.tokens_per_expert.sum()) == 2 * 40 * 2 for stats in inference.routing.values())

    seen: list[tuple[float, int, int]] = []

    def record(_: MoEFeedForward, args: tuple[torch.Tensor, ...], out: MoEOutput) -> None:
        seen.append((float(out.stats.dropped_fraction), int(out.stats.tokens_per_expert.sum()),
                     args[0].shape[:-1].numel()))

    for layer in module.transformer.modules():
        if isinstance(layer, MoEFeedForward):
            layer.register_forward_hook(record)
    module.generate(tokens[0, :10], 12, temperature=1.0, seed=0)
    assert len(seen) == 2 * 12  # the prompt once, then 11 single positions (the last token is never fed back)
    assert all(dropped == 0 and assigned == 2 * count for dropped, assigned, count in seen), seen


# ------------------------------------------------------------------------------------------ sampling
def test_greedy_is_the_argmax_and_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next(logits, 0.0), logits.argmax(-1))
    generator = torch.Generator().manual_seed(1)
    assert torch.equal(sample_next(logits, 5.0, top_k=1, generator=generator), logits.argmax(-1))


def test_a_tiny_temperature_draws_the_argmax_instead_of_failing() -> None:
    """Logits divided by 1e-40 overflowed to inf (softmax NaN: torch.multinomial raised); below float32's smallest
    normal number the division itself was by zero. Both now draw the largest logit."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)) * 10
    for temperature in (1e-40, 1e-46):
        assert torch.equal(sample_next(logits, temperature, generator=torch.Generator().manual_seed(5)),
                           logits.argmax(-1))


def test_top_k_samples_only_among_the_k_largest() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(2)).expand(400, 50)
    drawn = sample_next(logits, 10.0, top_k=3, generator=torch.Generator().manual_seed(3))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(drawn.tolist()) == allowed  # all three drawn at a high temperature, nothing else


def test_the_same_seed_samples_the_same_tokens() -> None:
    module = M6LanguageModel(M6Config(vocab_size=256, max_seq_len=32, num_layers=2, dim=32, num_heads=4,
                                      num_experts=4, init_seed=0))
    prompt = [72, 101, 108, 108, 111]
    first = module.generate(prompt, 20, temperature=1.0, seed=11)
    assert torch.equal(module.generate(prompt, 20, temperature=1.0, seed=11), first)
    assert not torch.equal(module.generate(prompt, 20, temperature=1.0, seed=12), first)
    assert first.shape == (25,) and first[:5].tolist() == prompt
    greedy = module.generate(prompt, 20, temperature=0, seed=1)
    assert torch.equal(module.generate(prompt, 20, temperature=0, seed=2), greedy)  # greedy draws nothing
    batch = module.generate(torch.tensor([prompt, prompt]), 4, temperature=0)
    assert batch.shape == (2, 9) and torch.equal(batch[0], batch[1])


def test_generate_refuses_requests_that_do_not_fit() -> None:
    module = M6LanguageModel(M6Config(vocab_size=256, max_seq_len=16, num_layers=1, dim=16, num_heads=2,
                                      init_seed=0))
    with pytest.raises(ValueError, match=r"max_new_tokens=13 runs past .*max_seq_len=16.*at most 12 new tokens"):
        module.generate([1, 2, 3, 4], 13)
    with pytest.raises(ValueError, match="top_k must be between 1 and the vocabulary size 256"):
        module.generate([1, 2], 3, top_k=257)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        module.generate([1, 2], 3, temperature=-1.0)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        module.generate([1, 2], 3, temperature=float("inf"))
    with pytest.raises(ValueError, match="the prompt is empty"):
        check_request(0, 3, 16)
    with pytest.raises(ValueError, match="the prompt is 16 tokens .* shorten it to at most 15 tokens"):
        check_request(16, 1, 16)


# --------------------------------------------------------------------- a model that memorized a sentence
@pytest.fixture(scope="module")
def memorized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model trained (on one process, ZeRO-3: a sharded checkpoint) until it recites SENTENCE; its recipe,
    the sharded checkpoint and its single-file conversion."""
    root = tmp_path_factory.mktemp("memorized")
    corpus = root / "corpus.txt"
    corpus.write_text(SENTENCE * 60, encoding="utf-8")
    data = {"corpus": str(corpus), "tokenizer": "bytes", "seq_len": SEQ_LEN, "batch_size": 8,
            "cache_dir": str(root / "cache")}
    recipe = {"trainer": {"default_root_dir": str(root / "run")},
              "model": {"config": MODEL, "optimizer": {"lr": 0.01, "warmup_steps": 10}}, "data": data}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    L.seed_everything(0)
    module = M6LanguageModel(M6Config(**MODEL, vocab_size=256, max_seq_len=SEQ_LEN),
                             OptimizerConfig(lr=0.01, warmup_steps=10))
    # The checkpoint Lightning's callback writes at the end of training, where `--ckpt_path last` finds it.
    saver = ModelCheckpoint(dirpath=root / "run" / "checkpoints", save_last=True, every_n_train_steps=150)
    trainer = tiny_trainer(root / "run", strategy=P2RStrategy(sharding="zero3"), max_steps=150,
                           limit_val_batches=0, callbacks=[saver])
    trainer.fit(module, datamodule=TextDataModule(**data))
    to_single_file(root / SHARDED, root / "single.ckpt")
    return root


def _generate(root: Path, capsys: pytest.CaptureFixture[str], *options: str, ckpt: str = "single.ckpt",
              recipe: str = "recipe.yaml") -> tuple[str, str]:
    main(["--config", str(root / recipe), "--ckpt_path", str(root / ckpt), *options])
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.slow
def test_greedy_generation_recites_the_memorized_sentence(memorized: Path, capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    prompt = SENTENCE[:12]
    out, err = _generate(memorized, capsys, "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "20")
    assert out == (SENTENCE * 2)[:32] + "\n"
    assert re.fullmatch(r"20 tokens in \d+\.\d+ s: \d+\.\d tokens/s \(prompt 12 tokens, (cpu|cuda)\)\n", err), err
    # The whole context by default; the Python API gives the same tokens.
    out, _ = _generate(memorized, capsys, "--prompt", prompt, "--temperature", "0")
    assert out == (SENTENCE * 2)[:SEQ_LEN] + "\n"
    module = M6LanguageModel(M6Config(**MODEL, vocab_size=256, max_seq_len=SEQ_LEN))
    module.configure_model()
    module.load_state_dict(torch.load(memorized / "single.ckpt", weights_only=True)["state_dict"])
    tokens = module.generate(list(prompt.encode()), SEQ_LEN - 12, temperature=0)
    assert bytes(tokens.tolist()).decode() == (SENTENCE * 2)[:SEQ_LEN]


def test_a_sharded_checkpoint_generates_what_its_single_file_conversion_does(
        memorized: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert is_sharded_checkpoint(memorized / SHARDED)
    single = torch.load(memorized / "single.ckpt", weights_only=True)["state_dict"]
    sharded = read_model_state(memorized / SHARDED)
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[name], single[name]) for name in single)
    for options in (["--temperature", "0"], ["--temperature", "1.5", "--top_k", "20", "--seed", "5"]):
        from_sharded = _generate(memorized, capsys, "--prompt", "the heaven", *options, ckpt=SHARDED)[0]
        assert from_sharded == _generate(memorized, capsys, "--prompt", "the heaven", *options)[0]
        # `last`: the newest last*.ckpt of the recipe's run, the sharded one here.
        main(["--config", str(memorized / "recipe.yaml"), "--ckpt_path", "last", "--prompt", "the heaven", *options])
        assert capsys.readouterr().out == from_sharded


def test_the_same_seed_generates_the_same_text(memorized: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = ["--prompt", "God", "--temperature", "3", "--top_k", "256", "--seed", "7"]
    first = _generate(memorized, capsys, *options)[0]
    assert _generate(memorized, capsys, *options)[0] == first
    assert first.startswith("God") and len(first) > 10


def test_a_delinked_pseudo_models_checkpoint_generates_with_its_pseudo_recipe(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pseudo-to-Real: the recipe says one shared block, the checkpoint (written after the delink) holds two; the
    saved structure rebuilds them before the weights load."""
    (tmp_path / "corpus.txt").write_text(SENTENCE * 20, encoding="utf-8")
    data = {"corpus": str(tmp_path / "corpus.txt"), "tokenizer": "bytes", "seq_len": 16, "batch_size": 4,
            "cache_dir": str(tmp_path / "cache")}
    pseudo = {"num_layers": 2, "num_unique_blocks": 1, "dim": 32, "num_heads": 4, "num_experts": 4, "init_seed": 0}
    (tmp_path / "pseudo.yaml").write_text(yaml.safe_dump({"model": {"config": pseudo}, "data": data}))
    module = M6LanguageModel(M6Config(**pseudo, vocab_size=256, max_seq_len=16), OptimizerConfig(warmup_steps=1))
    trainer = tiny_trainer(tmp_path, max_steps=4, limit_val_batches=0, callbacks=[PseudoToReal(delink_at_step=2)])
    trainer.fit(module, datamodule=TextDataModule(**data))
    assert len(module.transformer.blocks) == 2
    trainer.save_checkpoint(tmp_path / "real.ckpt")
    main(["--config", str(tmp_path / "pseudo.yaml"), "--ckpt_path", str(tmp_path / "real.ckpt"), "--prompt", "In",
          "--temperature", "0"])
    expected = module.generate(list(b"In"), 14, temperature=0)
    assert capsys.readouterr().out == bytes(expected.tolist()).decode(errors="replace") + "\n"


# ---------------------------------------------------------------------------------------- bad input
def _bad_recipes(root: Path) -> None:
    recipe = yaml.safe_load((root / "recipe.yaml").read_text(encoding="utf-8"))
    recipe["model"]["config"]["dim"] = 64
    (root / "wider.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    recipe["model"]["config"] |= {"dim": 48, "attention": "dense"}
    (root / "dense.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    recipe["model"]["config"] |= {"attention": "alternating", "num_expert": 4}
    (root / "typo.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    del recipe["model"]["config"]["num_expert"]
    recipe["trainer"]["default_root_dir"] = str(root / "no_run")
    (root / "untrained.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    recipe["data"] |= {"prepared": "auto", "cache_dir": str(root / "empty_cache")}
    (root / "unprepared.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    (root / "broken.yaml").write_text("model:\n  config: {dim: 48\ndata: {}\n", encoding="utf-8")
    (root / "corrupt.ckpt").write_bytes(b"PK\x03\x04 not a checkpoint" * 20)


BAD_INPUTS = {
    "empty prompt": (["--prompt", ""], r"--prompt: '' tokenizes to no token"),
    "too many new tokens": (["--prompt", "In the", "--max_new_tokens", "40"],
                            r"--max_new_tokens: max_new_tokens=40 runs past the model's context \(max_seq_len=32 "
                            r".*at most 26 new tokens fit after this 6-token prompt"),
    "prompt filling the context": (["--prompt", SENTENCE], r"--prompt: the prompt is 55 tokens and the model's "
                                                           r"context is max_seq_len=32"),
    "top_k above the vocabulary": (["--prompt", "In", "--top_k", "300"],
                                   r"--top_k 300 is larger than the vocabulary \(256 tokens"),
    "top_k below one": (["--prompt", "In", "--top_k", "0"], r"--top_k must be >= 1"),
    "negative temperature": (["--prompt", "In", "--temperature", "-0.5"], r"--temperature must be a finite number"),
    "infinite temperature": (["--prompt", "In", "--temperature", "inf"], r"--temperature must be a finite number"),
    "another model's recipe (shape)": (["--prompt", "In", "--config", "{root}/wider.yaml"],
                                       r"--ckpt_path: .*single.ckpt holds another model than recipe .*wider.yaml: "
                                       r"tensor transformer.tok_embeddings.weight is \[256, 48\] in the checkpoint "
                                       r"but \[256, 64\] in the recipe's model.*model.config.dim=64 \(the checkpoint "
                                       r"has 48\). Pass the recipe the checkpoint was trained with"),
    "another model's recipe (same shapes)": (["--prompt", "In", "--config", "{root}/dense.yaml"],
                                             r"holds another model than recipe .*dense.yaml: the recipe's options "
                                             r"differ: model.config.attention='dense' \(the checkpoint has "
                                             r"'alternating'\)"),
    "missing checkpoint": (["--prompt", "In", "--ckpt_path", "{root}/nothing.ckpt"],
                           r"--ckpt_path: checkpoint .*nothing.ckpt does not exist"),
    "corrupt checkpoint": (["--prompt", "In", "--ckpt_path", "{root}/corrupt.ckpt"],
                           r"--ckpt_path: checkpoint .*corrupt.ckpt cannot be loaded: it is truncated or not a torch"),
    "recipe with a YAML error": (["--prompt", "In", "--config", "{root}/broken.yaml"],
                                 r"--config: recipe .*broken.yaml: line 3, column 5: expected ',' or '}'"),
    "recipe with an unknown model option": (["--prompt", "In", "--config", "{root}/typo.yaml"],
                                            r"--config: .*typo.yaml: model.config has no option 'num_expert' "
                                            r"\(in .*typo.yaml, line \d+\)"),
    "last without a trained run": (["--prompt", "In", "--config", "{root}/untrained.yaml", "--ckpt_path", "last"],
                                   r"--ckpt_path last: no last\*.ckpt in .*no_run/checkpoints"),
    "a name only a Trainer resolves": (["--prompt", "In", "--ckpt_path", "best"],
                                       r"--ckpt_path: 'best' is resolved by a running Trainer"),
    "sharded checkpoint, another model's recipe": (["--prompt", "In", "--config", "{root}/wider.yaml", "--ckpt_path",
                                                    "{root}/" + SHARDED], r"last.ckpt holds another model than recipe"),
    "a recipe whose prepared corpus is not here": (["--prompt", "In", "--config", "{root}/unprepared.yaml"],
                                                   r"--config: the recipe's tokenizer comes from its prepared corpus, "
                                                   r"which is not ready here: .*a fit of the recipe on this machine"),
    "missing recipe": (["--prompt", "In", "--config", "{root}/none.yaml"], r"--config: recipe .*none.yaml does not "
                                                                          r"exist"),
}


@pytest.mark.parametrize(("options", "message"), BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_each_bad_input_is_refused_in_one_line_before_generating(
        options: list[str], message: str, memorized: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bad_recipes(memorized)
    args = ["--config", str(memorized / "recipe.yaml"), "--ckpt_path", str(memorized / "single.ckpt")]
    with pytest.raises(SystemExit) as exit_info:
        main(args + [option.format(root=memorized) for option in options])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing generated
    lines = captured.err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: lightning-p2r generate"), captured.err
    assert lines[1].startswith("lightning-p2r generate: error: ")
    assert re.search(message, lines[1]), lines[1]


def test_the_lightning_p2r_command_refuses_with_exit_status_two(memorized: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "--config", str(memorized / "recipe.yaml"), "--ckpt_path", str(memorized / "none"),
                  "--prompt", "In"])
    assert exit_info.value.code == 2
    assert "--ckpt_path: checkpoint" in capsys.readouterr().err
    cli_main(["generate", "--config", str(memorized / "recipe.yaml"), "--ckpt_path", "last", "--prompt", "In the",
              "--temperature", "0", "--max_new_tokens", "5"])
    assert capsys.readouterr().out == SENTENCE[:11] + "\n"


# ------------------------------------------------------------------- CausalLMModule recipes (Hugging Face, litgpt)
# `generate` built only M6 models: a checkpoint of any CausalLMModule recipe (recipes/hf_moe.yaml among them) was
# refused as "another model" (a new-user audit). Each recipe below is trained for two steps by `lightning-p2r fit`.
HF_SEQ_LEN = 16
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
         "max_position_embeddings": 64}
ZERO3 = {"class_path": "lightning_p2r.P2RStrategy", "init_args": {"sharding": "zero3"}}
DELINK_AT_STEP_1 = {"callbacks": [{"class_path": "lightning_p2r.PseudoToReal", "init_args": {"delink_at_step": 1}}]}
CAUSAL_LM_RECIPES = {
    # As recipes/hf_moe.yaml: a Qwen3-MoE under ZeRO-3, so `last` is a sharded checkpoint directory.
    "qwen3_moe, sharded": ({"hf_config": QWEN3_MOE}, {"strategy": ZERO3}),
    # A pseudo model: two blocks shared by four layers, its checkpoint holding them shared.
    "llama pseudo": ({"hf_config": LLAMA, "num_unique_blocks": 2}, {}),
    # The same delinked after step 1, and a shallow one (two layers) grown to four: the recipe says pseudo, the
    # checkpoint holds the real model, rebuilt from its saved structure before the weights load.
    "llama pseudo, delinked": ({"hf_config": LLAMA, "num_unique_blocks": 2}, DELINK_AT_STEP_1),
    "llama shallow, grown": ({"hf_config": LLAMA, "num_unique_blocks": 2, "pseudo_depth": "shallow",
                              "growth_init": "zero_outputs"}, DELINK_AT_STEP_1),
    "litgpt": ({"litgpt_config": {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 64, "bias": False}}, {}),
}


def _causal_lm_recipe(root: Path, name: str, init_args: dict, trainer: dict) -> Path:
    data = {"corpus": str(root / "corpus.txt"), "tokenizer": "bytes", "seq_len": HF_SEQ_LEN, "batch_size": 4,
            "cache_dir": str(root / "cache")}
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}]
    recipe = {"seed_everything": 0,
              "trainer": {"default_root_dir": str(root / name), "max_steps": 2, "logger": False,
                          "limit_val_batches": 0, "enable_progress_bar": False, "enable_model_summary": False,
                          "accelerator": "cpu", "devices": 1, **trainer,
                          "callbacks": callbacks + trainer.get("callbacks", [])},
              "model": {"class_path": "lightning_p2r.CausalLMModule",
                        "init_args": {**init_args, "optimizer": {"lr": 0.01, "warmup_steps": 0}}},
              "data": data}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def causal_lm_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each of CAUSAL_LM_RECIPES trained two steps by `lightning-p2r fit` (its `last` checkpoint), and a one-step M6
    checkpoint (m6.ckpt) on the same data."""
    import os
    from unittest import mock

    root = tmp_path_factory.mktemp("causal_lm")
    (root / "corpus.txt").write_text(SENTENCE * 20, encoding="utf-8")
    with mock.patch.dict(os.environ):  # fit sets the process group's variables
        for name, (init_args, trainer) in CAUSAL_LM_RECIPES.items():
            cli_main(["fit", "--config", str(_causal_lm_recipe(root, name, init_args, trainer))])
    data = {"corpus": str(root / "corpus.txt"), "tokenizer": "bytes", "seq_len": HF_SEQ_LEN, "batch_size": 4,
            "cache_dir": str(root / "cache")}
    m6 = M6LanguageModel(M6Config(num_layers=1, dim=32, num_heads=4, vocab_size=256, max_seq_len=HF_SEQ_LEN,
                                  init_seed=0), OptimizerConfig(warmup_steps=0))
    trainer = tiny_trainer(root / "m6", max_steps=1, limit_val_batches=0)
    trainer.fit(m6, datamodule=TextDataModule(**data))
    trainer.save_checkpoint(root / "m6.ckpt")
    return root


def _greedy_by_argmax(root: Path, name: str, prompt: str, new_tokens: int) -> tuple[str, int]:
    """The recipe's trained model continuing ``prompt`` by the argmax of its own forward, step by step (the text
    `generate --temperature 0` must print), and how many distinct layers it runs."""
    from lightning_p2r import CausalLMModule
    from lightning_p2r.cli.generate import read_recipe, recipe_tokenizer

    init_args = yaml.safe_load((root / f"{name}.yaml").read_text())["model"]["init_args"]
    module = CausalLMModule(**init_args, vocab_size=256)
    checkpoint = root / name / "checkpoints" / "last.ckpt"
    if is_sharded_checkpoint(checkpoint):
        state, saved = read_model_state(checkpoint), load_meta(checkpoint)
    else:
        saved = torch.load(checkpoint, weights_only=True)
        state = saved["state_dict"]
    module.configure_model()
    module.on_load_checkpoint(saved)  # as a resumed run: a delinked pseudo model gets its real layers back
    module.load_state_dict(state)
    module.eval()
    distinct_layers = len({id(layer) for layer in module._layers()})
    tokenizer = recipe_tokenizer(read_recipe(root / f"{name}.yaml").data)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(module(torch.tensor([ids]))[0, -1].argmax()))
    return tokenizer.decode(ids), distinct_layers


@pytest.mark.parametrize("name", CAUSAL_LM_RECIPES)
def test_a_causal_lm_recipes_checkpoint_generates_its_models_greedy_text(
        name: str, causal_lm_runs: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(causal_lm_runs)
    recipe = str(causal_lm_runs / f"{name}.yaml")
    if name.endswith("sharded"):
        assert is_sharded_checkpoint(causal_lm_runs / name / "checkpoints" / "last.ckpt")
    main(["--config", recipe, "--ckpt_path", "last", "--prompt", "In the", "--temperature", "0",
          "--max_new_tokens", "8"])
    out, err = capsys.readouterr()
    expected, distinct_layers = _greedy_by_argmax(causal_lm_runs, name, "In the", 8)
    assert out == expected + "\n"
    # The pseudo model runs its two shared blocks; the delinked and grown ones four layers of their own.
    assert distinct_layers == {"llama pseudo, delinked": 4, "llama shallow, grown": 4}.get(name, 2)
    assert re.fullmatch(r"8 tokens in \d+\.\d+ s: \d+\.\d tokens/s \(prompt 6 tokens, (cpu|cuda)\)\n", err), err
    # Sampled: the same seed draws the same text; without --max_new_tokens the continuation fills data.seq_len.
    sampled = ["--config", recipe, "--ckpt_path", "last", "--prompt", "In the", "--temperature", "2", "--top_k",
               "256", "--device", "cpu"]
    main([*sampled, "--seed", "3"])
    first = capsys.readouterr()
    assert re.match(r"10 tokens in ", first.err) and first.out.startswith("In the")
    main([*sampled, "--seed", "3"])
    assert capsys.readouterr().out == first.out
    main([*sampled, "--seed", "4"])
    assert capsys.readouterr().out != first.out


def _edited_recipe(root: Path, source: str, target: str, edit) -> str:
    recipe = yaml.safe_load((root / f"{source}.yaml").read_text())
    edit(recipe["model"])
    (root / f"{target}.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return str(root / f"{target}.yaml")


CAUSAL_LM_BAD_INPUTS = {
    "an M6 checkpoint, a Hugging Face recipe": (
        "qwen3_moe, sharded", "{root}/m6.ckpt", None,
        r"--ckpt_path: .*m6.ckpt holds another model than recipe .*: it has no tensor model.model.embed_tokens.weight"
        r", which the recipe's model has \(shape \[256, 32\]\); M6LanguageModel wrote it, the recipe builds "
        r"CausalLMModule. Pass the recipe the checkpoint was trained with"),
    "a Hugging Face checkpoint, an M6 recipe": (
        "qwen3_moe, sharded", "last", lambda model: model.clear() or model.update(config={"dim": 32}),
        r"holds another model than recipe .*: it holds tensor model.model.embed_tokens.weight \(shape \[256, 32\]\), "
        r"which the recipe's model has not; CausalLMModule wrote it, the recipe builds M6LanguageModel"),
    "another width": ("qwen3_moe, sharded", "last", lambda model: model["init_args"]["hf_config"].update(
        hidden_size=64), r"holds another model than recipe .*: tensor model.model.embed_tokens.weight is \[256, 32\] "
                         r"in the checkpoint but \[256, 64\] .*model.init_args.hf_config.hidden_size=64 \(the "
                         r"checkpoint has 32\)"),
    "the same shapes, other options": (
        "llama pseudo, delinked", "last", lambda model: model["init_args"]["hf_config"].update(rope_theta=500.0),
        r"holds another model than recipe .*: the recipe's options differ: model.init_args.hf_config\.(rope_parameters"
        r"\.)?rope_theta=500.0 \(the checkpoint has 10000.0\)"),
    "another module class": ("litgpt", "last", lambda model: model.update(class_path="my_package.MyModule"),
                             r"--config: .*: model.class_path my_package.MyModule: generate builds only "
                             r"lightning_p2r.CausalLMModule"),
    "an unknown argument": ("litgpt", "last", lambda model: model["init_args"].update(hf_confg={}),
                            r"--config: .*: CausalLMModule has no argument 'hf_confg' \(model.init_args, in .*line"),
    "a model given whole": ("litgpt", "last",
                            lambda model: model["init_args"].update(litgpt_config=None,
                                                                    model={"class_path": "my_package.Decoder"}),
                            r"--config: .*: model.init_args.model gives the model whole, which generate cannot "
                            r"rebuild"),
    "an hf_config without model_type": ("qwen3_moe, sharded", "last",
                                        lambda model: model["init_args"]["hf_config"].pop("model_type"),
                                        r"--config: .*: model.init_args: CausalLMModule.hf_config needs a "
                                        r"'model_type'"),
}


@pytest.mark.parametrize(("source", "ckpt", "edit", "message"), CAUSAL_LM_BAD_INPUTS.values(),
                         ids=CAUSAL_LM_BAD_INPUTS.keys())
def test_a_causal_lm_recipe_refuses_another_models_checkpoint_in_one_line(
        source: str, ckpt: str, edit, message: str, causal_lm_runs: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(causal_lm_runs)
    recipe = _edited_recipe(causal_lm_runs, source, "edited", edit) if edit else str(causal_lm_runs / f"{source}.yaml")
    # The edited recipe keeps the source's run folder, where `last` is.
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", recipe, "--ckpt_path", ckpt.format(root=causal_lm_runs), "--prompt", "In",
              "--temperature", "0"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("lightning-p2r generate: error: "), captured.err
    assert re.search(message, lines[1]), lines[1]


def test_a_causal_lm_recipe_refuses_a_request_past_data_seq_len(causal_lm_runs: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The decoder allows 64 positions (max_position_embeddings) but trained on windows of data.seq_len=16."""
    with pytest.raises(SystemExit):
        main(["--config", str(causal_lm_runs / "litgpt.yaml"), "--ckpt_path",
              str(causal_lm_runs / "litgpt" / "checkpoints" / "last.ckpt"), "--prompt", "In the", "--max_new_tokens",
              "11"])
    assert re.search(r"--max_new_tokens: max_new_tokens=11 runs past the model's context \(max_seq_len=16 .*at most "
                     r"10 new tokens", capsys.readouterr().err)
