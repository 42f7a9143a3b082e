"""Tiny Hugging Face model configs for the tests (random weights, nothing downloaded) and a plain-Trainer harness."""

import lightning as L
import torch

VOCAB = 64

CONFIGS = {
    "llama_tied": {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                   "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "tie_word_embeddings": True},
    "llama": {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "tie_word_embeddings": False},
    "gpt2": {"model_type": "gpt2", "vocab_size": VOCAB, "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "mixtral": {"model_type": "mixtral", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen3_moe": {"model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                  "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 8},
    # Dense Qwen3: per-head norms of the queries and keys (q_norm, k_norm) inside the attention.
    "qwen3": {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "tie_word_embeddings": False},
}


LITGPT = {"n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 64, "vocab_size": VOCAB, "padded_vocab_size": VOCAB,
          "bias": False}
"""A tiny litgpt ``GPT`` (``CausalLMModule(litgpt_config=LITGPT)``)."""


def causal_lm(family: str, **kwargs):
    """``CausalLMModule`` of a family of :data:`CONFIGS`, or litgpt's GPT for "litgpt"."""
    from lightning_p2r.causal_lm import CausalLMModule

    if family == "litgpt":
        return CausalLMModule(litgpt_config=LITGPT, **kwargs)
    return CausalLMModule(hf_config=CONFIGS[family], **kwargs)


class Losses(L.Callback):
    """The training loss of every step (each rank's own)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, *args) -> None:
        self.losses.append(float(outputs["loss"]))


def windows(rows: int = 16, seq: int = 16, seed: int = 1) -> torch.Tensor:
    """Token windows (rows, seq + 1) with a learnable pattern (each token the previous plus one), so the loss falls."""
    starts = torch.randint(0, VOCAB, (rows, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(seq + 1)) % VOCAB
