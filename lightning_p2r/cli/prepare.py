"""``lightning-p2r prepare-data``: tokenize a corpus once into a directory that ``data.prepared`` streams."""

from __future__ import annotations

import argparse
import sys
import time

from ..data.prepared import PreparedDataError, prepare_data


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-p2r prepare-data",
        description="Tokenize a corpus into litdata chunks of token ids, split into train and val, with a manifest; "
                    "a recipe then trains from it with data.prepared: OUT (docs/data.md).",
        usage="lightning-p2r prepare-data --source SOURCE --out OUT [options]")
    parser.add_argument("--source", required=True, metavar="SOURCE",
                        help="'kjv' (the bundled King James Bible), 'bible-multi' (22 languages, the [multilingual] "
                             "extra), a UTF-8 .txt file, or a folder of .txt files")
    parser.add_argument("--out", required=True, metavar="OUT", help="the prepared directory to write")
    parser.add_argument("--tokenizer", choices=("bpe", "bytes"), default=None,
                        help="byte-level BPE trained on the corpus, or raw UTF-8 bytes (default: bpe)")
    parser.add_argument("--tokenizer_from", default=None, metavar="DIR",
                        help="reuse the tokenizer of this prepared directory instead of training one (its kind and "
                             "vocabulary too), so that a recipe can mix the two: data.prepared: [DIR, OUT]")
    parser.add_argument("--vocab_size", type=int, default=None, metavar="N",
                        help="vocabulary size: 512 or more for bpe (default 4096), 256 for bytes")
    parser.add_argument("--val_fraction", type=float, default=0.05, metavar="F",
                        help="the corpus's last fraction of bytes, cut at a line end, held out (default: 0.05)")
    parser.add_argument("--num_workers", type=int, default=1, metavar="N",
                        help="processes that encode pieces of the corpus in parallel (default: 1)")
    parser.add_argument("--languages", default=None, metavar="CODES",
                        help="bible-multi only: comma-separated language codes, e.g. en,fr,zh (default: all 22)")
    parser.add_argument("--overwrite", action="store_true",
                        help="rebuild OUT when it was prepared from other inputs (default: refuse)")
    return parser


def main(argv: list[str]) -> None:
    """Entry point of ``lightning-p2r prepare-data`` (``argv``: the arguments after ``prepare-data``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        manifest = prepare_data(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                                val_fraction=args.val_fraction, num_workers=args.num_workers,
                                languages=args.languages.split(",") if args.languages else None,
                                overwrite=args.overwrite, tokenizer_from=args.tokenizer_from,
                                log=lambda line: print(line, file=sys.stderr))
    except PreparedDataError as error:
        parser.error(str(error))
    seconds = time.perf_counter() - start
    size = sum(split["bytes"] for split in manifest.splits.values())
    counts = ", ".join(f"{name} {split['tokens']:,} tokens" for name, split in manifest.splits.items())
    print(f"{args.out}: {counts} ({manifest.tokenizer}, vocab {manifest.vocab_size}); {size / 1e6:.1f} MB of text "
          f"in {seconds:.1f} s")
