"""Per-language evaluation of the multilingual recipe: loss, perplexity and bits per byte after a short fit.

    python -m lightning_p2r.benchmarks.multilingual [--max-steps 300] [--languages en,fr,zh] [--out DIR]

Trains ``recipes/multilingual.yaml`` (its data prepared by the first run, under ``runs/data``) for ``--max-steps``
steps, then validates on every chosen language's held-out books (all of them: no batch limit) and prints the
per-language table, with a bar chart of bits per byte. Bits per byte compare across languages and tokenizers;
loss and perplexity per token do not (a language whose words take more tokens has an easier next token).
Extra ``--section.option=value`` flags go to the recipe.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from lightning_p2r.benchmarks.report import (
    base_parser,
    environment_info,
    print_environment,
    save_bar_chart,
    with_environment,
    write_csv,
)
from lightning_p2r.data.language_eval import language_rows, language_table

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "multilingual.yaml"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning_p2r.cli import P2RCLI
    from lightning_p2r.data import TextDataModule
    from lightning_p2r.module import M6LanguageModel

    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--languages", default=None, help="comma-separated codes (default: the recipe's, all 22)")
    parser.add_argument("--prepared", default="runs/data/bible-multi-bpe8192",
                        help="the prepared directory (made by the first run; default: the recipe's)")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.max_steps, args.languages = 3, args.languages or "en,zh"
        overrides = ["--data.vocab_size=512", "--data.seq_len=32", "--data.batch_size=4",
                     "--trainer.limit_val_batches=2", *overrides]
    env = environment_info(args.device)
    print_environment(env)
    with tempfile.TemporaryDirectory(prefix="p2r-multilingual-bench-") as root:
        prepared = f"{root}/prepared" if args.quick else args.prepared  # quick: a small vocabulary of its own
        warmup = max(1, args.max_steps // 10)
        cli_args = ["--config", str(RECIPE), f"--trainer.max_steps={args.max_steps}",
                    f"--trainer.default_root_dir={root}", "--trainer.logger=false",
                    "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
                    "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=null",
                    f"--trainer.val_check_interval={args.max_steps}", f"--trainer.accelerator={args.device}",
                    f"--data.prepared={prepared}", f"--model.optimizer.warmup_steps={warmup}",
                    *([f"--data.languages=[{args.languages}]"] if args.languages else []), *overrides]
        print("cli args: " + " ".join(cli_args))
        with mock.patch.object(sys, "argv", sys.argv[:1]):
            cli = P2RCLI(M6LanguageModel, TextDataModule, args=cli_args, run=False, save_config_callback=None)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        metrics = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    rows = language_rows(metrics, "val", cli.datamodule.eval_streams)
    print(language_table(metrics, "val", cli.datamodule.eval_streams))  # what `lightning-p2r validate` prints
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(with_environment(rows, env), out / "multilingual.csv")
    save_bar_chart(out / "multilingual.png", [r["language"] for r in rows],
                   {"bits per byte": [r["bpb"] for r in rows]}, ylabel="validation bits per byte",
                   title=f"multilingual recipe after {args.max_steps} steps, held-out books per language")
    print(f"wrote {out / 'multilingual.csv'}, {out / 'multilingual.png'}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
