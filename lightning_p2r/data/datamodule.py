"""Text corpora, tokenizers and the Lightning data module that feeds next-token training.

The pipeline is: ``load_corpus`` (KJV Bible or local text) -> tokenizer (byte-level BPE or raw bytes) -> one long
stream of token ids cached as ``.npy`` -> contiguous train/validation split -> fixed windows of ``seq_len + 1``
tokens, so a model computes inputs ``w[:-1]`` and targets ``w[1:]`` from each row.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from .corpus import load_corpus
from .mixture import check_directory_list, chosen_languages, read_mixture
from .prepared import MANIFEST, PreparedDataError, PreparedFromOtherInputs, load_prepared_tokenizer, prepare_data
from .streaming import check_windows, streaming_loader
from .tokenizer import (
    BYTE_VOCAB,
    DEFAULT_BPE_VOCAB,
    MIN_BPE_VOCAB,
    TextTokenizer,
    TokenizerKind,
    _sha256,
    _tokenize_cached,
    build_tokenizer,
)
from .windows import EpochShuffleSampler, _ResumableLoader, _Rows, pack_sequences, split_train_val

# --------------------------------------------------------------------------------------------- data module


def _default_cache_dir() -> Path:
    """``$LIGHTNING_P2R_CACHE`` if set, else ``~/.cache/lightning_p2r``."""
    env = os.environ.get("LIGHTNING_P2R_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_p2r"


def _auto_prepared_dir(corpus: str, tokenizer: str | None, vocab_size: int | None, val_fraction: float,
                       languages: list[str] | None, cache_dir: str | None) -> Path:
    """Where ``prepared="auto"`` keeps a corpus's prepared directory: under the cache folder, one per corpus,
    tokenizer, vocabulary, split and languages, so a recipe's overrides never meet another run's directory. The
    corpus's content is not in the name: ``prepare_data`` compares its hash and rebuilds the directory when it
    changed."""
    tokenizer = tokenizer or "bpe"
    vocab_size = vocab_size or (DEFAULT_BPE_VOCAB if tokenizer == "bpe" else BYTE_VOCAB)
    source = corpus if corpus in ("kjv", "bible-multi") else str(Path(corpus).expanduser().resolve())
    key = _sha256(repr((source, tokenizer, vocab_size, val_fraction, languages)))[:12]
    name = corpus if corpus in ("kjv", "bible-multi") else Path(source).stem
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
    return root / "prepared" / f"{name}-{tokenizer}{vocab_size}-{key}"


SEED_MAX = 2**32 - 1


def other_inputs_in_fit(error: PreparedFromOtherInputs, corpus: Any) -> str:
    """The refusal of a ``data.prepared`` directory prepared from other inputs than ``data.corpus``, with the fixes a
    training run has: train on the directory as it is, or prepare the corpus into another folder."""
    return (f"{error.out} was prepared from other inputs than data.corpus={corpus!r} ({', '.join(error.changed)} "
            "differ): pass --data.corpus null to train on it as it is, or another --data.prepared folder to prepare "
            "the corpus into")


def _check_integer(name: str, value: Any, low: int, high: int | None = None) -> None:
    """Refuse ``value`` unless it is an integer in [low, high] (True and 2.0 are not: a batch of True windows is a
    typo, not a batch of one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"data.{name} must be an integer {bound}, got {value!r}")


class TextDataModule(pl.LightningDataModule):
    """Next-token windows of a text corpus; each batch is a long tensor of shape (batch_size, seq_len + 1).

    Args:
        corpus: 'kjv' for the bundled King James Bible (the default), or a path to a UTF-8 .txt file or a folder of
            .txt files; with ``prepared``, also 'bible-multi', and the source the run prepares that directory from
            when it is not there yet.
        tokenizer: 'bpe' (byte-level BPE trained on the corpus and cached; the default) or 'bytes' (raw UTF-8 bytes).
        vocab_size: Tokenizer vocabulary size; default 4096 for bpe (minimum 512) and 256 for bytes (the only value).
        seq_len: Tokens the model sees per sample; each row holds seq_len + 1 tokens for the shifted targets.
        batch_size: Windows per batch (per device).
        val_fraction: Fraction of the token stream, taken from its end, held out for validation (0 < f < 1).
        num_workers: DataLoader worker processes; 0 loads batches in the main process.
        cache_dir: Folder for the tokenizer and token-id cache; default $LIGHTNING_P2R_CACHE or ~/.cache/lightning_p2r.
        seed: Seed of the training shuffle order (0 to 2**32 - 1, as Lightning's ``seed_everything``).
        prepared: A directory written by ``lightning-p2r prepare-data``: training and validation then stream its
            token chunks with litdata (allocated memory flat in the corpus size, exact mid-epoch resume from Lightning's
            checkpoint), and its manifest gives the tokenizer and vocabulary (``tokenizer``/``vocab_size``, if
            given, must match it). Without ``corpus`` the directory must exist; with it, ``fit`` prepares it first
            (``prepare_data``, once per node) with these tokenizer, vocabulary and ``val_fraction`` settings. A list
            of prepared single-corpus directories with one tokenizer (``prepare-data --tokenizer_from``) is mixed
            window by window (``prepared_weights``) and validated per directory, named by the last path component.
            ``"auto"`` (the quickstart's): a directory in ``cache_dir``/prepared named by the corpus, tokenizer,
            vocabulary, ``val_fraction`` and languages, prepared by the first fit and rebuilt when the corpus's
            content changes.
        languages: With a multilingual prepared directory (``prepare-data --source bible-multi``), the languages to
            train and validate on; default all it holds.
        language_alpha: With several languages, each training window's language is drawn with probability
            proportional to (its training tokens) ** language_alpha: 1 as the corpus is, 0 uniform (mGPT, XLM).
        language_weights: With a multilingual prepared directory, explicit sampling weights per language, e.g.
            {en: 3, fr: 1} (normalised; they replace language_alpha). Its keys are the languages trained and
            evaluated on (data.languages, if also given, must name the same ones); a language weighted 0 is
            evaluated but never drawn for training. Negative, non-finite or all-zero weights are refused.
        prepared_weights: With a list of prepared directories in ``prepared``, each one's sampling weight, in the
            list's order (normalised); default: in proportion to their training tokens, as if concatenated.
    """

    def __init__(
        self,
        corpus: str | None = None,
        tokenizer: TokenizerKind | None = None,
        vocab_size: int | None = None,
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        cache_dir: str | None = None,
        seed: int = 1234,
        prepared: str | list[str] | None = None,
        languages: list[str] | None = None,
        language_alpha: float = 0.3,
        language_weights: dict[str, float] | None = None,
        prepared_weights: list[float] | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= language_alpha <= 1.0:
            raise ValueError(f"language_alpha must be between 0 (uniform) and 1 (as the corpus is), got "
                             f"{language_alpha}")

        self.manifest, self.prepared = None, prepared
        self.mixture: dict[str, float] = {}  # each language's (or listed directory's) share of training windows
        self._streams: dict[str, Any] = {}  # mixture.Stream by name; one named "" for a single corpus
        check_directory_list(corpus, prepared, prepared_weights)
        self._languages = chosen_languages(corpus, prepared, languages, language_weights)
        self._language_alpha, self._language_weights = language_alpha, language_weights
        self._prepared_weights = prepared_weights
        # "auto": a prepared directory in the cache, named by the inputs, rebuilt when the corpus changes.
        self._rebuild_prepared = prepared == "auto"
        if self._rebuild_prepared:
            prepared = self.prepared = str(_auto_prepared_dir(corpus or "kjv", tokenizer, vocab_size, val_fraction,
                                                              self._languages, cache_dir))
            corpus = corpus or "kjv"
        if prepared is not None:

            if corpus is None or (Path(prepared).expanduser() / MANIFEST).is_file():
                # Prepared already (or nothing to prepare it from: refused here, naming prepare-data).
                self._open_prepared(tokenizer, vocab_size)
                tokenizer, vocab_size = self.manifest.tokenizer, self.manifest.vocab_size
        tokenizer = tokenizer or "bpe"
        if tokenizer not in ("bpe", "bytes"):
            raise ValueError(f"tokenizer must be one of 'bpe', 'bytes', got {tokenizer!r}")
        if vocab_size is None:
            vocab_size = DEFAULT_BPE_VOCAB if tokenizer == "bpe" else BYTE_VOCAB
        if tokenizer == "bytes" and vocab_size != BYTE_VOCAB:
            raise ValueError(f"vocab_size must be {BYTE_VOCAB} (or None) with tokenizer='bytes', got {vocab_size}")
        if tokenizer == "bpe" and vocab_size < MIN_BPE_VOCAB:
            raise ValueError(f"vocab_size must be >= {MIN_BPE_VOCAB} with tokenizer='bpe', got {vocab_size}")
        _check_integer("seq_len", seq_len, 1)
        _check_integer("batch_size", batch_size, 1)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be strictly between 0 and 1, got {val_fraction}")
        _check_integer("num_workers", num_workers, 0)
        # The range of Lightning's seed_everything; litdata's shuffle (numpy) refuses anything outside it, but only
        # when the first epoch starts.
        _check_integer("seed", seed, 0, SEED_MAX)
        corpus = corpus or ("kjv" if prepared is None else None)
        if corpus == "bible-multi" and prepared is None:
            raise ValueError("corpus 'bible-multi' is streamed: set data.prepared to the directory to prepare it in")
        if corpus not in (None, "kjv", "bible-multi") and not Path(corpus).expanduser().exists():
            raise FileNotFoundError(
                f"corpus path {corpus} does not exist. Pass corpus='kjv' for the bundled Bible, or an existing "
                ".txt file or folder of .txt files."
            )
        self.save_hyperparameters()
        self.corpus = corpus
        self.tokenizer_kind: TokenizerKind = tokenizer
        self._vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
        self.seed = seed
        self.prepared = prepared
        self.tokenizer: TextTokenizer | None = None
        self.train_windows: torch.Tensor | None = None
        self.val_windows: torch.Tensor | None = None
        self._resume_position = (0, 0)  # (epoch, batches done) of a mid-epoch checkpoint
        self._train_sampler: EpochShuffleSampler | None = None

    @property
    def vocab_size(self) -> int:
        """The resolved vocabulary size: every id is below it, so the model's embedding needs this many rows."""
        return self._vocab_size

    def _load(self) -> tuple[TextTokenizer, torch.Tensor]:
        return _tokenize_cached(self.corpus, self.tokenizer_kind, self._vocab_size, self.cache_dir)

    def _open_prepared(self, tokenizer: str | None, vocab_size: int | None) -> None:
        """Read the prepared directory's manifest (once it exists) and what follows from it: the tokenizer and
        vocabulary it must match, and the language mixture."""

        mixture = read_mixture(self.prepared, tokenizer, vocab_size, self._languages, self._language_alpha,
                               self._language_weights, self._prepared_weights)
        self.manifest, self.mixture, self._streams = mixture.manifest, mixture.weights, mixture.streams

    @property
    def _first_directory(self) -> Path:
        """The prepared directory (the first of a list): its tokenizer is every listed directory's."""
        return next(iter(self._streams.values())).directory

    def load_tokenizer(self) -> TextTokenizer:
        """The tokenizer the model's ids come from: the prepared directory's, or the one built for ``corpus``."""
        if self.prepared is not None:

            if self.manifest is None:
                self._open_prepared(self.tokenizer_kind, self._vocab_size)
            return load_prepared_tokenizer(self._first_directory, self.manifest)
        text = load_corpus(self.corpus) if self.tokenizer_kind == "bpe" else ""
        return build_tokenizer(self.tokenizer_kind, self._vocab_size, text, self.cache_dir)

    def prepare_data(self) -> None:
        """Build the tokenizer and token-id cache once (Lightning runs this on one process per node); with
        ``prepared`` and ``corpus``, prepare the directory from the corpus (a no-op once it is, refused if it was
        prepared from other inputs)."""
        if self.prepared is None:
            self.tokenizer, _ = self._load()
        elif self.corpus is not None:

            try:
                prepare_data(self.corpus, self.prepared, tokenizer=self.tokenizer_kind, vocab_size=self._vocab_size,
                             val_fraction=self.val_fraction, num_workers=max(1, self.num_workers),
                             languages=self._languages if self.corpus == "bible-multi" else None,
                             overwrite=self._rebuild_prepared, log=rank_zero_info)
            except PreparedFromOtherInputs as error:
                # prepare-data's fix (--overwrite, --out) names flags fit does not have.
                raise PreparedDataError(other_inputs_in_fit(error, self.corpus)) from None
            except PreparedDataError as error:
                if error.in_fit is None:
                    raise
                raise PreparedDataError(error.in_fit) from None

    def _data_parallel_ranks(self) -> tuple[int, int]:
        """(replicas, rank) of this process's data-parallel group: tensor-parallel ranks share their batches."""
        strategy = self.trainer.strategy if self.trainer else None
        if isinstance(strategy, ParallelStrategy):
            kwargs = strategy.distributed_sampler_kwargs
            return kwargs["num_replicas"], kwargs["rank"]
        return 1, 0

    def setup(self, stage: str | None = None) -> None:
        """Load cached ids (building them if needed), split into train/validation and cut them into windows; with
        ``prepared``, check the prepared corpus holds a step's windows instead (the loaders stream it)."""
        if self.prepared is not None:

            self._open_prepared(self.tokenizer_kind, self._vocab_size)
            self.tokenizer = self.load_tokenizer()
            for directory, manifest in {s.directory: s.manifest for s in self._streams.values()}.items():
                check_windows(manifest, directory, self.seq_len, self.batch_size, self._data_parallel_ranks()[0])
            return
        if self.train_windows is not None and self.val_windows is not None:
            return  # Lightning calls setup once per stage; the windows do not depend on it.
        self.tokenizer, ids = self._load()
        train_ids, val_ids = split_train_val(ids, self.val_fraction)
        if val_ids.numel() < self.seq_len + 1:
            raise ValueError(
                f"The validation split has {val_ids.numel()} tokens (val_fraction={self.val_fraction} of "
                f"{ids.numel()}), fewer than seq_len + 1 = {self.seq_len + 1} needed for one window. "
                "Lower seq_len, raise val_fraction, or use a larger corpus."
            )
        if train_ids.numel() < self.seq_len + 1:
            raise ValueError(
                f"The training split has {train_ids.numel()} tokens, fewer than seq_len + 1 = {self.seq_len + 1}. "
                "Lower seq_len or val_fraction, or use a larger corpus."
            )
        train = pack_sequences(train_ids, self.seq_len)
        if train.shape[0] < self.batch_size:
            # With drop_last=True a short training set would silently yield zero batches.
            raise ValueError(
                f"The training split makes {train.shape[0]} windows, fewer than batch_size={self.batch_size}. "
                "Lower batch_size or seq_len, or use a larger corpus."
            )
        self.train_windows = train
        self.val_windows = pack_sequences(val_ids, self.seq_len)

    def _loader(self, rows: torch.Tensor | None, shuffle: bool) -> DataLoader[torch.Tensor]:
        if self.prepared is not None:

            replicas, rank = self._data_parallel_ranks()
            folders = {name: stream.folder("train" if shuffle else "val") for name, stream in self._streams.items()}
            return streaming_loader(self._first_directory, folders, self.seq_len, self.batch_size, shuffle=shuffle,
                                    seed=self.seed, num_workers=self.num_workers, replicas=replicas, rank=rank,
                                    weights=self.mixture, consumed=self._batches_trained)
        if rows is None:
            raise RuntimeError("TextDataModule.setup() must run before requesting a dataloader")
        if self.num_workers > 0:
            # Workers only index tensors; this silences the tokenizers fork warning without affecting speed.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        sampler = None
        if shuffle:
            world, rank = self._data_parallel_ranks()
            sampler = EpochShuffleSampler(rows.shape[0], self.seed, num_replicas=world, rank=rank)
            epoch, done = self._resume_position
            if 0 < done < len(sampler) // self.batch_size:
                sampler.resume(epoch, done * self.batch_size)
            self._resume_position = (0, 0)
            self._train_sampler = sampler
        loader_class = _ResumableLoader if shuffle else DataLoader
        return loader_class(
            _Rows(rows),
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def _batches_trained(self) -> int | None:
        """Batches of the current epoch handed to training so far (counting those before a resume): Lightning's
        own count, which a streamed mixture's loader checkpoints its position by."""
        if self.trainer is None:
            return None
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.ready

    def state_dict(self) -> dict[str, Any]:
        """How far into the current epoch training got, so a resumed run continues with the next batch."""
        done = 0
        if self.trainer is not None:
            done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
            if done >= self.trainer.num_training_batches:
                done = 0  # the epoch is over (also when limit_train_batches ended it early)
        epoch = self._train_sampler.last_epoch if self._train_sampler is not None else 0
        return {"epoch": int(epoch), "train_batches_done": int(done)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_position = (int(state_dict.get("epoch", 0)), int(state_dict.get("train_batches_done", 0)))

    def train_dataloader(self) -> DataLoader[torch.Tensor]:
        """Shuffled training windows; the order is fixed by ``seed`` and partial batches are dropped."""
        return self._loader(self.train_windows, shuffle=True)

    @property
    def eval_streams(self) -> list[str]:
        """The mixture's streams (a multilingual directory's chosen languages, or the names of the listed prepared
        directories): validation and test have one loader each, in this order (empty for a single corpus)."""
        return list(self.mixture)

    def realized_mixture(self) -> dict[str, float]:
        """The share of this epoch's training windows (on this rank) that each stream (language or listed directory)
        has given so far, as counted by litdata's loader: what the requested ``mixture`` turned into (empty for one
        stream)."""
        loader = self.trainer.train_dataloader if self.trainer is not None else None
        if len(self.mixture) < 2 or not hasattr(loader, "state_dict"):
            return {}
        per_worker = loader.state_dict()["num_samples_yielded"].values()
        counts = [sum(column) for column in zip(*per_worker)]
        total = sum(counts)
        return {code: count / total for code, count in zip(self.mixture, counts)} if total else {}

    def tokens_per_byte(self, split: str) -> dict[str, float]:
        """Per evaluated stream, the split's tokens per byte of text (bits per byte = loss * this / ln 2)."""
        counts = {name: self._streams[name].counts(split) for name in self.eval_streams}
        return {name: count["tokens"] / count["bytes"] for name, count in counts.items()}

    def _stream_loaders(self, split: str) -> list[Any]:

        replicas, rank = self._data_parallel_ranks()
        return [streaming_loader(self._first_directory, self._streams[name].folder(split), self.seq_len,
                                 self.batch_size, shuffle=False, seed=self.seed, num_workers=self.num_workers,
                                 replicas=replicas, rank=rank)
                for name in self.eval_streams]

    def val_dataloader(self) -> Any:
        """Validation windows in stream order; one loader per language of a multilingual prepared directory, or per
        directory of a list."""
        if self.eval_streams:
            return self._stream_loaders("val")
        return self._loader(self.val_windows, shuffle=False)

    def test_dataloader(self) -> Any:
        """The held-out test books of each language of a multilingual prepared directory; otherwise the validation
        windows (a single corpus keeps no separate test split), one loader per directory of a list."""
        if self.eval_streams:
            return self._stream_loaders("test")
        return self._loader(self.val_windows, shuffle=False)

    def predict_dataloader(self) -> DataLoader[torch.Tensor]:
        """The validation windows, in order."""
        return self._loader(self.val_windows, shuffle=False)
