"""Scoring this package's checkpoints with EleutherAI's ``lm-evaluation-harness`` (the ``lm-eval`` package, the
``[eval]`` extra; issue 38, item 8).

:class:`P2RLM` is an ``lm_eval`` model: log-likelihoods of continuations, rolling log-likelihoods and greedy
generation, for any LightningModule here (``M6LanguageModel``, ``CausalLMModule``) with the tokenizer it trained with.
:func:`bible_choice_tasks` writes an offline multiple-choice task per language from ``bible-multi``'s held-out (test)
books: a verse's first half, and its true second half among four (the other three from other verses of the same
language); :func:`evaluate_languages` scores a model on them and returns one row per language.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import LM
except ImportError:  # the [eval] extra is not installed: the adapter refuses to be built, the module still imports
    LM = object  # type: ignore[assignment,misc]


def _logits(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    output = module(ids)
    return output if isinstance(output, torch.Tensor) else output.logits


class P2RLM(LM):  # type: ignore[misc,valid-type]
    """An ``lm_eval`` model over ``module`` (called on token ids, returning logits or an output with ``.logits``)
    and ``encode``/``decode`` (the tokenizer it trained with). ``max_length``: the context the model takes (longer
    inputs keep their last tokens); ``eot_token_id`` stands before a text scored from its start."""

    def __init__(self, module: torch.nn.Module, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 *, max_length: int, eot_token_id: int = 0) -> None:
        if LM is object:
            raise ImportError("the lm-eval adapter needs lm-evaluation-harness: pip install 'lightning-p2r[eval]'")
        super().__init__()
        self.module = module.eval()
        self.encode, self.decode = encode, decode
        self.max_length, self.eot_token_id = max_length, eot_token_id
        self._device = next(module.parameters()).device

    @torch.no_grad()
    def _continuation_scores(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of the continuation tokens' log-probabilities after ``context``, and whether each was the argmax. What
        does not fit in ``max_length`` is cut from the left (a continuation longer than that loses its first
        tokens, as lm-eval's own models truncate)."""
        ids = (context + continuation)[-(self.max_length + 1):]
        inputs = torch.tensor([ids[:-1]], device=self._device)
        logprobs = F.log_softmax(_logits(self.module, inputs).float(), dim=-1)[0]
        n = min(len(continuation), len(ids) - 1)
        targets = torch.tensor(ids[-n:], device=self._device)
        picked = logprobs[-n:].gather(-1, targets[:, None]).squeeze(-1)
        greedy = bool((logprobs[-n:].argmax(-1) == targets).all())
        return float(picked.sum()), greedy

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        results = []
        for request in requests:
            context, continuation = request.args
            # Tokenized apart, as lm-eval's own models do, so the continuation's tokens are its own.
            results.append(self._continuation_scores(self.encode(context) or [self.eot_token_id],
                                                     self.encode(continuation)))
        return results

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        results = []
        for request in requests:
            ids = self.encode(request.args[0])
            # Windows of max_length tokens, each scored after as many of the tokens before it as fit.
            results.append(sum(self._continuation_scores(ids[:start] or [self.eot_token_id],
                                                         ids[start:start + self.max_length])[0]
                               for start in range(0, len(ids), self.max_length)))
        return results

    @torch.no_grad()
    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        outputs = []
        for request in requests:
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = self.encode(context)
            new: list[int] = []
            for _ in range(int(options.get("max_gen_toks", 64))):  # greedy, as lm-eval's generation tasks expect
                window = torch.tensor([(ids + new)[-self.max_length:]], device=self._device)
                new.append(int(_logits(self.module, window)[0, -1].argmax()))
                text = self.decode(new)
                if any(stop in text for stop in until):
                    break
            text = self.decode(new)
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
        return outputs


def bible_choice_tasks(folder: str | Path, languages: Sequence[str], *, per_language: int = 50,
                       seed: int = 0) -> list[str]:
    """Write one lm-eval multiple-choice task per language into ``folder`` (JSONL documents + a YAML task each) from
    the held-out test books (``bible_multi.TEST_BOOKS``); returns the task names (``p2r_bible_choice_<code>``).
    A verse is cut at the space nearest its middle (between characters for scripts written without spaces); the
    distractors are second halves of other verses of the same language; the right answer's position is drawn."""
    from ..data.bible_multi import read_texts

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = []
    for code, texts in read_texts(list(languages)).items():
        verses = [line for line in texts["test"].splitlines() if len(line) >= 20]
        chosen = rng.sample(range(len(verses)), min(per_language, len(verses)))
        halves = [_cut(verses[i]) for i in chosen]
        documents = []
        for index, (context, ending) in enumerate(halves):
            others = rng.sample([h[1] for j, h in enumerate(halves) if j != index and h[1] != ending], 3)
            label = rng.randrange(4)
            choices = others[:label] + [ending] + others[label:]
            documents.append({"context": context, "choices": choices, "label": label})
        data = folder / f"bible_choice_{code}.jsonl"
        data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in documents), encoding="utf-8")
        name = f"p2r_bible_choice_{code}"
        (folder / f"{name}.yaml").write_text("\n".join([
            f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {data}",
            "test_split: test", "output_type: multiple_choice", "num_fewshot: 0", "doc_to_text: '{{context}}'",
            "doc_to_choice: choices", "doc_to_target: label", "target_delimiter: ''",
            "metric_list:", "  - metric: acc", "    aggregation: mean", "    higher_is_better: true", ""]),
            encoding="utf-8")
        names.append(name)
    return names


def _cut(verse: str) -> tuple[str, str]:
    middle = len(verse) // 2
    spaces = [i for i, ch in enumerate(verse) if ch == " "]
    at = min(spaces, key=lambda i: abs(i - middle)) if spaces else middle
    return verse[:at], verse[at:]  # the second half keeps its leading space: the delimiter is part of the answer


def evaluate_languages(lm: Any, languages: Sequence[str], folder: str | Path, *, per_language: int = 50,
                       seed: int = 0) -> list[dict[str, Any]]:
    """Score ``lm`` (an lm-eval model) on :func:`bible_choice_tasks`, offline; one row per language: accuracy, its
    standard error, the documents scored, and chance (0.25)."""
    from lm_eval import evaluate
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSON files only: nothing may download
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    names = bible_choice_tasks(folder, languages, per_language=per_language, seed=seed)
    # include_defaults=False: the tasks are all in ``folder``; indexing lm-eval's thousands of built-in task files
    # took 7-10 s of every call on 2 cores (under 0.1 s without them).
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    # lm-eval's evaluate, not simple_evaluate: the tasks are zero-shot in their own files, and simple_evaluate ends
    # by describing the machine (torch's collect_env, a fresh interpreter listing every package: 2.8 s of each call
    # here) and asking git for a commit, which printed "fatal: not a git repository" outside one.
    results = evaluate(lm=lm, task_dict=manager.load(names), log_samples=False)["results"]
    rows = []
    for code, name in zip(languages, names):
        scores = results[name]
        rows.append({"language": code, "accuracy": round(float(scores["acc,none"]), 4),
                     "stderr": round(float(scores.get("acc_stderr,none", float("nan"))), 4),
                     "documents": per_language, "chance": 0.25})
    return rows
