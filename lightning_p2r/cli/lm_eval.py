"""``lightning-p2r lm-eval``: score a checkpoint with lm-evaluation-harness on the per-language verse-continuation
tasks (``lm_eval_adapter.bible_choice_tasks``), offline, and print one table (docs/your_model.md)."""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

from ..console.text_table import format_table
from ..data.bible_multi import TRANSLATIONS
from .generate import GenerateError, load_model, read_checkpoint, read_recipe, recipe_tokenizer, resolve_checkpoint


def build_parser() -> argparse.ArgumentParser:
    # The docstring's whole first paragraph: its first line alone ended mid-phrase ("... on the per-language
    # verse-continuation") in --help until 2026-12-02.
    parser = argparse.ArgumentParser(prog="lightning-p2r lm-eval",
                                     description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""))
    parser.add_argument("-c", "--config", required=True,
                        help="the recipe the checkpoint was trained with (its tokenizer)")
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint file, a sharded checkpoint directory, or "
                                                           "'last'")
    parser.add_argument("--languages", default="en,fr,de,ru,zh",
                        help="comma-separated bible-multi codes (default: %(default)s)")
    parser.add_argument("--per-language", type=int, default=50,
                        help="documents per language, each a verse's first half and four endings (default: "
                             "%(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the verses drawn, their wrong endings and the right one's position (default: "
                             "%(default)s)")
    return parser


def _module_and_tokenizer(config: str, ckpt_path: str) -> tuple[Any, Any, int]:
    """The trained model (logits of token ids), its tokenizer and context length. The model is built and checked as
    ``generate`` builds it: an M6 recipe, or one whose model is a ``CausalLMModule`` (Hugging Face or litgpt config,
    shared or grown blocks), from a single-file or sharded checkpoint; a checkpoint of another model than the
    recipe's is refused naming the difference (``generate.load_model``)."""
    recipe = read_recipe(config)
    path = resolve_checkpoint(ckpt_path, recipe)
    state, saved = read_checkpoint(path)
    # The recipe's data.seq_len is the longest window the model trained on, whatever its family's own limit.
    return load_model(recipe, state, saved, path), recipe_tokenizer(recipe.data), recipe.max_seq_len


def main(argv: list[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    languages = [code.strip() for code in args.languages.split(",") if code.strip()]
    unknown = [code for code in languages if code not in TRANSLATIONS]
    if unknown:
        parser.error(f"--languages: unknown {unknown}; bible-multi has {sorted(TRANSLATIONS)}")
    try:
        from .lm_eval_adapter import P2RLM, evaluate_languages

        module, tokenizer, max_length = _module_and_tokenizer(args.config, args.ckpt_path)
        lm = P2RLM(module, tokenizer.encode, tokenizer.decode, max_length=max_length)
    except (GenerateError, ImportError, ValueError) as error:
        parser.error(str(error))
    with tempfile.TemporaryDirectory(prefix="p2r-lm-eval-") as folder:
        rows = evaluate_languages(lm, languages, folder, per_language=args.per_language, seed=args.seed)
    print("four-way verse continuation (held-out books), accuracy per language:")
    print(format_table(rows, ["language", "accuracy", "stderr", "documents", "chance"]))
