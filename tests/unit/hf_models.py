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
    # Qwen2-MoE: a shared expert beside the routed ones, with its own sigmoid gate, and a dense layer between MoE
    # layers (decoder_sparse_step 2).
    "qwen2_moe": {"model_type": "qwen2_moe", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                  "decoder_sparse_step": 2},
    # Mistral: attention over a sliding window (8 of the tests' 16 positions), its mask derived from the whole sequence.
    "mistral": {"model_type": "mistral", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 8},
    # Qwen3-MoE with its load-balancing loss in the training loss (Hugging Face adds it over all layers at once).
    "qwen3_moe_balanced": {"model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                           "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 8,
                           "output_router_logits": True, "router_aux_loss_coef": 0.5},
    # Dense Qwen3: per-head norms of the queries and keys (q_norm, k_norm) inside the attention.
    "qwen3": {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "tie_word_embeddings": False},
    # Qwen3 with sliding windows (4 of the tests' 16 positions) on its last two layers: its forward passes those
    # layers another attention mask than the first two.
    "qwen3_sliding": {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                      "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                      "tie_word_embeddings": False, "use_sliding_window": True, "sliding_window": 4,
                      "max_window_layers": 2},
    # Families without a ready declaration: their parts are found from Hugging Face's conventions
    # (models/hf_parts.py). Gemma 3: an embedding scaled by a buffer, sliding-window layers, per-head norms.
    "gemma3": {"model_type": "gemma3_text", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
               "sliding_window": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    # GPT-NeoX (Pythia): its own names (gpt_neox.layers, embed_in), a packed query/key/value projection, attention
    # and MLP in parallel off one residual, an untied head.
    "gpt_neox": {"model_type": "gpt_neox", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 4, "num_attention_heads": 4, "rotary_pct": 0.5, "pad_token_id": 0,
                 "bos_token_id": 1, "eos_token_id": 2},
    # Qwen3-Next: three gated-delta-net (linear attention) layers and one full attention layer, a sparse MoE with a
    # shared expert in each; its _init_weights draws each router's weight from the MoE block's branch, not the
    # router's own.
    "qwen3_next": {"model_type": "qwen3_next", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                   "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 16, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 8, "linear_value_head_dim": 8, "pad_token_id": 0, "bos_token_id": 1,
                   "eos_token_id": 2},
    # OLMoE: 4 experts, top-2, in every layer, per-layer query/key norms.
    "olmoe": {"model_type": "olmoe", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 16,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
              "num_experts_per_tok": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    # OLMo 2: norms after the attention and the MLP, and q/k norms over all heads at once (its tensor-parallel plan
    # gathers q, k and v whole: "colwise_gather_output", then "rowwise_split_input").
    "olmo2": {"model_type": "olmo2", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2},
    # Bloom: ALiBi positions, a norm between the embedding and the first block (word_embeddings_layernorm), a tied
    # head.
    "bloom": {"model_type": "bloom", "vocab_size": VOCAB, "hidden_size": 32, "n_layer": 4, "n_head": 4,
              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    # DeepSeek-V3: multi-head latent attention (low-rank q and kv), a dense first layer, then 4 routed experts (top-2,
    # grouped routing) beside a shared expert; its plan splits only the MLPs and experts.
    "deepseek_v3": {"model_type": "deepseek_v3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "pad_token_id": 0,
                    "bos_token_id": 1, "eos_token_id": 2},
    # Granite: its causal LM divides the logits by logits_scaling after the head, which stages would skip.
    "granite": {"model_type": "granite", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "logits_scaling": 4.0,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
}


LITGPT = {"n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 64, "vocab_size": VOCAB, "padded_vocab_size": VOCAB,
          "bias": False}
"""A tiny litgpt ``GPT`` (``CausalLMModule(litgpt_config=LITGPT)``)."""
LITGPT_GQA = LITGPT | {"n_query_groups": 2, "mlp_class_name": "LLaMAMLP", "intermediate_size": 64,
                       "norm_class_name": "RMSNorm"}
"""A Llama-shaped litgpt ``GPT``: grouped queries (4 heads, 2 key/value groups), a gated MLP, RMSNorm."""
LITGPT_MOE = LITGPT_GQA | {"mlp_class_name": "LLaMAMoE", "n_expert": 4, "n_expert_per_token": 2,
                           "moe_intermediate_size": 16, "n_shared_expert": 1, "first_k_dense_replace": 1}
"""litgpt's MoE (``LLaMAMoE``, DeepSeek's shape): a list of 4 gated-MLP experts, top-2, one shared expert beside
them, and a dense first layer."""
LITGPT_CONFIGS = {"litgpt": LITGPT, "litgpt_gqa": LITGPT_GQA, "litgpt_moe": LITGPT_MOE}


class NanoBlock(torch.nn.Module):
    """A pre-norm block as users write it (nanoGPT's shape): one fused q/k/v linear, SDPA, a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.c_attn, self.c_proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc, self.proj = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)
                   for t in self.c_attn(self.ln_1(x)).split(dim, dim=2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(batch, length, dim))
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln_2(x))))


class NanoGPT(torch.nn.Module):
    """A user's own decoder with no config object: learned positions and a head tied to the token embedding."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 4, length: int = 64) -> None:
        super().__init__()
        self.transformer = torch.nn.ModuleDict({
            "wte": torch.nn.Embedding(VOCAB, dim), "wpe": torch.nn.Embedding(length, dim),
            "h": torch.nn.ModuleList(NanoBlock(dim, heads) for _ in range(layers)), "ln_f": torch.nn.LayerNorm(dim)})
        self.lm_head = torch.nn.Linear(dim, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(ids) + self.transformer.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def nano_parts():
    """The declaration a user writes for :class:`NanoGPT` (its own module names)."""
    from lightning_p2r.models.decoders import DecoderParts

    return DecoderParts(blocks="transformer.h", embed=("transformer.wte", "transformer.wpe"), norm="transformer.ln_f",
                        head="lm_head", base="", call="positional")


class OwnCausalLM(L.LightningModule):
    """A user's own LightningModule around a Hugging Face causal LM built in ``configure_model``: no block list, holder
    or plan declared (the strategy detects them), with ``CausalLMModule``'s loss, optimizer and initial values (its
    ``init_seed``; an eager build takes them from ``initialize_by_module``), so that it compares with its runs."""

    def __init__(self, hf_config: dict, optimizer: dict, init_seed: int) -> None:
        super().__init__()
        self.hf_config, self.optimizer_options, self.init_seed = hf_config, optimizer, init_seed
        self.model = None

    def configure_model(self) -> None:
        from lightning_p2r.causal_lm import build_hf_model
        from lightning_p2r.models.module_init import initialize_by_module

        if self.model is None:
            self.model = build_hf_model(self.hf_config)
            if self.model.device.type != "meta":  # built eagerly: the values a build in place gets
                initialize_by_module(self, self.init_seed)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        from lightning_p2r.module import next_token_batch, next_token_loss

        inputs, targets = next_token_batch(batch)
        return next_token_loss(self.model(input_ids=inputs, use_cache=False).logits, targets)

    def configure_optimizers(self):
        from lightning_p2r.module import OptimizerConfig, adamw_with_schedule

        return adamw_with_schedule(self, OptimizerConfig(**self.optimizer_options))


def causal_lm(family: str, **kwargs):
    """``CausalLMModule`` of a family of :data:`CONFIGS`, litgpt's GPT for "litgpt", or a user's own decoder given
    whole with its declaration for "nanogpt"."""
    from lightning_p2r.causal_lm import CausalLMModule

    if kwargs.pop("own_module", False):
        return OwnCausalLM(CONFIGS[family], kwargs.pop("optimizer"), kwargs.pop("init_seed"))
    if family in LITGPT_CONFIGS:
        return CausalLMModule(litgpt_config=LITGPT_CONFIGS[family], **kwargs)
    if family == "nanogpt":
        kwargs.pop("init_seed", None)  # a model given whole keeps its own weights
        return CausalLMModule(model=NanoGPT(), parts=nano_parts(), **kwargs)
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
