"""Autoregressive sampling: the checks, one sampling step, and two decoding loops.

:func:`generate_tokens` decodes an :class:`M6Transformer`: the prompt runs once (prefill), then one position per new
token through the model's key/value cache, with MoE layers routing every token (no capacity drops; see
``MoEFeedForward``). :func:`generate_tokens_uncached` decodes any model that maps token ids to logits (a
``CausalLMModule``'s Hugging Face or litgpt decoder) by running the whole sequence so far at every step. Both draw
each token with :func:`sample_next`. A sequence never grows past the model's ``max_seq_len``: a request that would
is refused before anything runs (:func:`check_request`), rather than sliding the window, because the model was
trained on windows that start at position 0 and the cache would have to be recomputed at every step once the window
slides.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .models import M6Transformer


def check_sampling(temperature: float, top_k: int | None, vocab_size: int) -> None:
    """Refuse sampling settings that mean nothing: a negative or infinite temperature (infinity draws every token
    alike, whatever the model says), or a top_k outside [1, vocab_size]."""
    if not 0 <= temperature < math.inf:  # also NaN
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy decoding), got {temperature}")
    if top_k is not None and not 1 <= top_k <= vocab_size:
        raise ValueError(f"top_k must be between 1 and the vocabulary size {vocab_size} (or unset: no top-k "
                         f"truncation), got {top_k}")


def largest_new_tokens(prompt_length: int, max_seq_len: int) -> int:
    """How many tokens may follow a prompt of ``prompt_length`` tokens: prompt and continuation fit the context."""
    return max_seq_len - prompt_length


def check_request(prompt_length: int, max_new_tokens: int, max_seq_len: int) -> None:
    """Refuse an empty prompt, and a prompt plus ``max_new_tokens`` longer than the model's context, naming the
    largest ``max_new_tokens`` that fits."""
    if prompt_length < 1:
        raise ValueError("the prompt is empty (it tokenizes to no token): give at least one character of text")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_length >= max_seq_len:
        raise ValueError(prompt_too_long(prompt_length, max_seq_len))
    fits = largest_new_tokens(prompt_length, max_seq_len)
    if max_new_tokens > fits:
        raise ValueError(f"max_new_tokens={max_new_tokens} runs past the model's context (max_seq_len={max_seq_len} "
                         "positions for prompt and continuation; generation does not slide the window): at most "
                         f"{fits} new tokens fit after this {prompt_length}-token prompt")


def prompt_too_long(prompt_length: int, max_seq_len: int) -> str:
    return (f"the prompt is {prompt_length} tokens and the model's context is max_seq_len={max_seq_len}: no new token "
            f"fits after it; shorten it to at most {max_seq_len - 1} tokens")


def prompt_batch(prompt_ids: torch.Tensor | list[int], device: torch.device) -> tuple[torch.Tensor, bool]:
    """``prompt_ids`` as a (batch, prompt) LongTensor on ``device``, and whether it was one sequence (prompt,) (a
    batch of one here, whose result goes back in the caller's shape)."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if prompt.dim() not in (1, 2):
        raise ValueError(f"prompt_ids must be (prompt,) or (batch, prompt), got shape {tuple(prompt.shape)}")
    return prompt.reshape(-1, prompt.shape[-1]), prompt.dim() == 1


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each sequence from its last logits (batch, vocab) -> LongTensor (batch,).

    Temperature 0 is greedy (argmax, deterministic); otherwise the logits are divided by the temperature, all but
    the ``top_k`` largest masked out (ties at the k-th value are kept), and one token drawn from their softmax
    with ``generator`` (the same seed draws the same tokens).
    """
    if temperature < torch.finfo(torch.float32).tiny:  # 0, or so small that float32 cannot divide by it: greedy
        return logits.argmax(dim=-1)
    # Shifted to a maximum of 0 first: a tiny temperature then sends the others to -inf, never the maximum to inf.
    logits = logits.float()
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_tokens(model: M6Transformer, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                    top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue ``prompt_ids`` (batch, prompt) by ``max_new_tokens`` tokens -> (batch, prompt + max_new_tokens).

    The prompt runs once, filling the cache; each new token then runs alone (one position per step). The model is
    put in eval mode for the call (no dropout) and returned to its mode afterwards.
    """
    config = model.config
    check_request(prompt_ids.shape[1], max_new_tokens, config.max_seq_len)
    check_sampling(temperature, top_k, config.vocab_size)
    was_training = model.training
    model.eval()
    try:
        # The last new token is never fed back: the cache needs room for every position but that one.
        cache = model.new_cache(prompt_ids.shape[1] + max_new_tokens - 1)
        logits = model(prompt_ids, cache=cache, dropless=True).logits[:, -1]
        tokens = [prompt_ids]
        for step in range(max_new_tokens):
            token = sample_next(logits, temperature, top_k, generator)[:, None]
            tokens.append(token)
            if step + 1 < max_new_tokens:
                logits = model(token, cache=cache, dropless=True).logits[:, -1]
    finally:
        model.train(was_training)
    return torch.cat(tokens, dim=1)


@torch.no_grad()
def generate_tokens_uncached(model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, max_seq_len: int,
                             temperature: float = 1.0, top_k: int | None = None,
                             generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue ``prompt_ids`` (batch, prompt) by ``max_new_tokens`` tokens -> (batch, prompt + max_new_tokens), with
    a ``model`` called on (batch, length) token ids that returns (batch, length, vocab) logits.

    No key/value cache: each step runs the whole sequence so far, so a step costs a forward over up to
    ``max_seq_len`` positions. It works for any such model as it is, layers sharing a block included (a Hugging
    Face cache is indexed by each attention's ``layer_idx``, which the layers of a pseudo model share). Sampling is
    :func:`sample_next`'s, as for :func:`generate_tokens`; ``top_k`` is checked against the logits' width (the
    vocabulary) once the prompt has run, before anything is drawn. The model is put in eval mode for the call and
    returned to its mode afterwards.
    """
    check_request(prompt_ids.shape[1], max_new_tokens, max_seq_len)
    check_sampling(temperature, None, 1)  # the temperature now; top_k once the vocabulary is known
    was_training = model.training
    model.eval()
    try:
        logits = model(prompt_ids)[:, -1]
        check_sampling(temperature, top_k, logits.shape[-1])
        tokens = [prompt_ids]
        for step in range(max_new_tokens):
            tokens.append(sample_next(logits, temperature, top_k, generator)[:, None])
            if step + 1 < max_new_tokens:  # the last new token is never fed back
                logits = model(torch.cat(tokens, dim=1))[:, -1]
    finally:
        model.train(was_training)
    return torch.cat(tokens, dim=1)
