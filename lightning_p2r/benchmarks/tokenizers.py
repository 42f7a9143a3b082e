"""The tokenizer study of mGPT, in small: raw bytes against byte-level BPE trained on a language-balanced sample.

    python -m lightning_p2r.benchmarks.tokenizers [--vocab-sizes 8192 32768] [--sample-kb 1024] [--out DIR]

On ``bible-multi`` (22 languages, the ``[multilingual]`` extra), BPEs of each vocabulary size are trained on the
same number of bytes of every language's training books (so no language buys the merges of another), then every
language's validation books are encoded with each tokenizer. The table gives the **fertility**: tokens per
character and tokens per whitespace-separated word (for Chinese and Japanese, written without spaces, the word
figure counts whole runs of text and is not comparable), per language with its script. A lower fertility means a
language's text costs fewer tokens: more of it fits a context, and a step trains on more of it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lightning_p2r.benchmarks.report import (
    base_parser,
    environment_info,
    print_environment,
    print_table,
    save_bar_chart,
    with_environment,
    write_csv,
)
from lightning_p2r.data import BPETokenizer, ByteTokenizer, TextTokenizer
from lightning_p2r.data.bible_multi import SCRIPTS, TRANSLATIONS, read_texts


def balanced_sample(train_texts: dict[str, str], per_language: int) -> str:
    """About ``per_language`` bytes of every language's text, taken as evenly spaced runs of whole lines."""
    parts = []
    for text in train_texts.values():
        lines = text.splitlines(keepends=True)
        total = sum(len(line.encode()) for line in lines)
        keep_every = max(1, total // per_language)
        parts.append("".join(line for i, line in enumerate(lines) if i % keep_every == 0))
    return "".join(parts)


def fertility(tokenizer: TextTokenizer, text: str) -> tuple[float, float]:
    """(tokens per character, tokens per whitespace-separated word) of ``text``."""
    lines = [line for line in text.splitlines() if line]
    if isinstance(tokenizer, BPETokenizer):
        tokens = sum(len(ids) for ids in tokenizer.encode_batch(lines))
    else:
        tokens = sum(len(tokenizer.encode(line)) for line in lines)
    characters = sum(len(line) for line in lines)
    words = sum(len(line.split()) for line in lines)
    return tokens / characters, tokens / words


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--sample-kb", type=int, default=1024, help="training bytes per language, in KiB")
    parser.add_argument("--languages", default=",".join(TRANSLATIONS), help="comma-separated codes (default: all)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.vocab_sizes, args.sample_kb, args.languages = [512], 64, "en,ru,zh"
    env = environment_info("cpu")
    print_environment(env)
    languages = args.languages.split(",")
    texts = read_texts(languages)
    sample = balanced_sample({code: texts[code]["train"] for code in languages}, args.sample_kb * 1024)
    tokenizers: dict[str, TextTokenizer] = {"bytes": ByteTokenizer()}
    for size in args.vocab_sizes:
        tokenizers[f"bpe{size}"] = BPETokenizer.train(sample, size)
    rows = []
    for code in languages:
        row: dict[str, Any] = {"language": code, "script": SCRIPTS.get(code, "Latin")}
        for name, tokenizer in tokenizers.items():
            per_char, per_word = fertility(tokenizer, texts[code]["val"])
            row[f"{name}_per_char"], row[f"{name}_per_word"] = per_char, per_word
        rows.append(row)
    columns = ["language", "script"] + [f"{name}_{unit}" for name in tokenizers for unit in ("per_char", "per_word")]
    print_table(rows, columns)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(with_environment(rows, env), out / "tokenizers.csv")
    save_bar_chart(out / "tokenizers.png", [r["language"] for r in rows],
                   {name: [r[f"{name}_per_char"] for r in rows] for name in tokenizers},
                   ylabel="tokens per character (validation books)",
                   title=f"fertility: bytes vs BPE on a language-balanced sample ({args.sample_kb} KiB/language)")
    print(f"wrote {out / 'tokenizers.csv'}, {out / 'tokenizers.png'}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
