"""``CausalLMModule``: the LightningModule that trains a decoder-only language model the package did not write (a
Hugging Face ``transformers`` model from its config, a litgpt ``GPT``, any model given whole) under every layout
``P2RStrategy`` offers, on the same token windows as M6 (``TextDataModule``). docs/your_model.md.

The model is built in ``configure_model``: under ``P2RStrategy`` on the meta device, then each tensor materialized
once where it lives with the model's own initialization (``models.module_init``); under any other strategy eagerly,
initialized by the same rule and seed, so both builds hold the same values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from . import register_strategies
from .generation import generate_tokens_uncached, prompt_batch
from .layout import ModelShape
from .models.decoders import (
    KNOWN_DECODERS,
    DecoderParts,
    check_stageable,
    decoder_parts,
    decoder_pipeline_parts,
    decoder_stages,
    family_of,
    next_token_loss,
)
from .models.gpt2_plan import declare_gpt2_plan
from .models.hf_configs import read_hf_config
from .models.litgpt_plan import declare_litgpt_plan
from .models.module_init import initialize_by_module, is_hf_pretrained
from .models.router_loss import aux_loss_coefficient
from .module import OptimizerConfig, _as_dataclass, adamw_with_schedule, check_schedule_covers_run, next_token_batch
from .protocols import LayeredStages, PipelineParts
from .sharing import delink, find_block_sequence, shallow_layers, share_layers

STRUCTURE_KEY = "causal_lm_structure"
"""Checkpoint key recording how many distinct blocks the decoder's layers run (Pseudo-to-Real)."""


def hf_config_as_held(hf_config: dict[str, Any], held: dict[str, Any], depth: int, depth_key: str) -> dict[str, Any]:
    """The Hugging Face config of the model a checkpoint holds, from ``module.structure_as_held``'s ``held``: a shallow
    pseudo model not yet grown to ``depth`` runs its first ``num_unique_blocks`` layers, and is that many layers deep
    (``depth_key``: the config's name for its number of layers, ``n_layer`` for GPT-2); its ``layer_types`` are cut
    to them. A shared pseudo model runs every layer, the shared blocks copied into each."""
    blocks = held.get("num_unique_blocks")
    if held.get("pseudo_depth") != "shallow" or blocks is None or blocks >= depth:
        return dict(hf_config)
    config = {key: value for key, value in hf_config.items() if key != "num_hidden_layers"}
    config[depth_key] = blocks
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:blocks]
    return config

register_strategies()  # Trainer(strategy="p2r") resolves once the model code is loaded


def read_causal_lm_config(hf_config: dict[str, Any]) -> Any:
    """The Hugging Face config object of ``hf_config`` (``model_type`` plus the family's fields), read by
    ``transformers``; a wrong type, a misspelled field or a value ``transformers`` refuses is a one-line ValueError.
    ``transformers`` is the ``[hf]`` extra."""
    try:
        import transformers  # noqa: F401
    except ImportError as error:
        raise ImportError("CausalLMModule(hf_config=...) builds Hugging Face models: pip install "
                          "'lightning-p2r[hf]' (transformers)") from error
    return hf_config_object(hf_config)


def hf_config_object(hf_config: dict[str, Any]) -> Any:
    """The ``transformers`` config of a config dict (``model_type`` plus the family's fields); a ValueError naming
    ``CausalLMModule.hf_config`` when it has no ``model_type`` or Hugging Face refuses a field."""
    fields = dict(hf_config)
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(f"CausalLMModule.hf_config needs a 'model_type' (such as 'qwen3_moe'), got {hf_config!r}")
    return read_hf_config(model_type, fields, "CausalLMModule.hf_config")


def build_hf_model(hf_config: dict[str, Any] | Any) -> nn.Module:
    """A Hugging Face causal LM from a config dict (or the config object :func:`read_causal_lm_config` read),
    randomly initialized, nothing downloaded."""
    from transformers import AutoModelForCausalLM

    config = read_causal_lm_config(hf_config) if isinstance(hf_config, dict) else hf_config
    return AutoModelForCausalLM.from_config(config)


def build_litgpt_model(litgpt_config: dict[str, Any]) -> nn.Module:
    """A litgpt ``GPT`` from its ``Config`` fields, randomly initialized."""
    try:
        from litgpt import GPT, Config
    except ImportError as error:
        raise ImportError("CausalLMModule(litgpt_config=...) builds litgpt models: pip install --no-deps litgpt "
                          "(docs/your_model.md)") from error
    return GPT(Config(**litgpt_config))


def _is_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


class CausalLMModule(L.LightningModule):
    """Trains a decoder-only causal LM on (batch, seq + 1) token windows with the next-token cross-entropy.

    Args:
        hf_config: A Hugging Face config as a dict: ``model_type`` ("llama", "qwen3_moe", ...) and its fields; the
            model is built from it in ``configure_model`` (in place under ``P2RStrategy``).
        litgpt_config: A litgpt ``Config`` as a dict (``n_layer``, ``n_embd``, ...): a litgpt ``GPT`` built like
            ``hf_config``'s model (litgpt installs apart: ``pip install --no-deps litgpt``, docs/your_model.md).
        model: A model given whole instead (built by the caller; its weights are kept as they are).
        optimizer: AdamW and its schedule (``OptimizerConfig``).
        init_seed: Seed of the initial values when built from a config (the same in every layout).
        parts: Where the model keeps its parts, for layered accumulation and pipelines; None uses the family's
            ready declaration (``models.decoders.KNOWN_DECODERS``), else, for any other Hugging Face decoder, the
            parts its conventions show (``models.hf_parts``).
        vocab_size: Overrides the config's vocabulary size (``lightning-p2r fit`` links the data's here).
        num_unique_blocks: Train a Pseudo-to-Real "pseudo" model (M6-10T): the decoder's layers share this many
            blocks (``sharing.share_layers``), and ``PseudoToReal`` delinks them into the real model mid-run. None:
            every layer its own block.
        sharing: Which layers share a block: "sequence" (consecutive runs) or "cycle" (``M6Config.sharing``).
        pseudo_depth: "shared" (the pseudo model runs every layer, ``num_unique_blocks`` blocks shared among them)
            or "shallow" (it keeps and runs only its first ``num_unique_blocks`` layers; ``PseudoToReal`` grows it
            to the full depth by stacking, new layer i a copy of layer i mod ``num_unique_blocks``:
            ``sharing.shallow_layers``).
        growth_init: How layers gained by a shallow model start: "copy", or "zero_outputs" (their residual
            branches' output projections zeroed, ``DecoderParts.residual_outputs``, so growth keeps the function).
    """

    def __init__(self, hf_config: dict[str, Any] | None = None, litgpt_config: dict[str, Any] | None = None,
                 model: nn.Module | None = None, optimizer: OptimizerConfig | dict[str, Any] | None = None,
                 init_seed: int = 0, parts: DecoderParts | dict[str, Any] | None = None,
                 vocab_size: int | None = None, num_unique_blocks: int | None = None,
                 sharing: str = "sequence", pseudo_depth: str = "shared", growth_init: str = "copy") -> None:
        super().__init__()
        if sum(x is not None for x in (hf_config, litgpt_config, model)) != 1:
            raise ValueError("CausalLMModule needs exactly one of hf_config (a Hugging Face config dict), "
                             "litgpt_config and model")
        self.hf_config = dict(hf_config) if hf_config is not None else None
        self.litgpt_config = dict(litgpt_config) if litgpt_config is not None else None
        if vocab_size is not None:
            if self.hf_config is not None:
                self.hf_config["vocab_size"] = int(vocab_size)
            if self.litgpt_config is not None:
                self.litgpt_config["vocab_size"] = self.litgpt_config["padded_vocab_size"] = int(vocab_size)
        # Read here, when the module is made (LightningCLI makes it before the Trainer starts anything): a wrong
        # model_type or a misspelled field stops the run before processes, data or loggers start.
        self._hf_config_read = read_causal_lm_config(self.hf_config) if self.hf_config is not None else None
        self.optimizer_config = _as_dataclass(OptimizerConfig, optimizer)
        self.init_seed = int(init_seed)
        self.parts = DecoderParts(**{k: tuple(v) if k == "embed" else v for k, v in parts.items()}) \
            if isinstance(parts, dict) else parts
        if num_unique_blocks is not None and (isinstance(num_unique_blocks, bool) or num_unique_blocks < 1):
            raise ValueError(f"CausalLMModule.num_unique_blocks must be a positive integer or None, got "
                             f"{num_unique_blocks!r}")
        if sharing not in ("sequence", "cycle"):
            raise ValueError(f"CausalLMModule.sharing must be 'sequence' or 'cycle', got {sharing!r}")
        if pseudo_depth not in ("shared", "shallow"):
            raise ValueError(f"CausalLMModule.pseudo_depth must be 'shared' or 'shallow', got {pseudo_depth!r}")
        if growth_init not in ("copy", "zero_outputs"):
            raise ValueError(f"CausalLMModule.growth_init must be 'copy' or 'zero_outputs', got {growth_init!r}")
        if (pseudo_depth == "shallow" or growth_init != "copy") and num_unique_blocks is None:
            raise ValueError("CausalLMModule(pseudo_depth='shallow' or growth_init) grows a shallow pseudo model: "
                             "set num_unique_blocks to the layers it starts with")
        self.num_unique_blocks, self.sharing = num_unique_blocks, sharing
        self.pseudo_depth, self.growth_init = pseudo_depth, growth_init
        # Checkpoints are loaded with weights_only=True: hyperparameters are plain values (the model given whole is
        # not one; a checkpoint of it records none, and `convert --to hf` then needs its config).
        self.save_hyperparameters({"hf_config": self.hf_config, "litgpt_config": self.litgpt_config,
                                   "optimizer": dataclasses.asdict(self.optimizer_config),
                                   "init_seed": self.init_seed,
                                   "parts": dataclasses.asdict(self.parts) if self.parts is not None else None,
                                   "num_unique_blocks": num_unique_blocks, "sharing": sharing,
                                   "pseudo_depth": pseudo_depth, "growth_init": growth_init})
        self.model = model
        self._positional: bool | None = None
        self._parts_found: DecoderParts | None = None
        self.token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss
        """The training cross-entropy of logits against targets (``protocols.ComputesTokenLoss``): under tensor
        parallelism the strategy puts a vocabulary-parallel one here, and the head leaves each rank its vocabulary
        shard of the logits in training (never the whole logits, as Megatron-LM and torchtitan)."""

    def configure_model(self) -> None:
        if self.model is not None:
            self._declare_plan()
            return
        self.model = build_hf_model(self._hf_config_read) if self.hf_config is not None else build_litgpt_model(
            self.litgpt_config)
        self._declare_plan()
        if not _is_meta(self.model):  # built eagerly: the values a build in place gets (module_init.py)
            initialize_by_module(self, self.init_seed)
        layers = self._layers()
        if self.num_unique_blocks is not None and self.num_unique_blocks < len(layers):
            if self.pseudo_depth == "shallow":
                shallow_layers(self.model, layers, self.num_unique_blocks, self.growth_init,
                               self._declared().residual_outputs)
            else:
                share_layers(self.model, layers, self.num_unique_blocks, self.sharing)

    def setup(self, stage: str) -> None:
        # Before the model is built: ids past the embedding would fail mid-step (an IndexError on the CPU, a device-side
        # assert on CUDA), as M6LanguageModel.setup checks for its config.
        data_vocab = getattr(self.trainer.datamodule, "vocab_size", None)  # Lightning calls setup attached
        rows = self._embedding_rows()
        if isinstance(data_vocab, int) and rows is not None and data_vocab > rows[0]:
            size, where = rows
            raise ValueError(
                f"the data's tokenizer has {data_vocab} ids but {where} is {size}: ids >= {size} would index past the "
                f"embedding. Pass CausalLMModule(vocab_size={data_vocab}) (or a config with at least {data_vocab}), "
                f"or a tokenizer with at most {size} ids")

    def _embedding_rows(self) -> tuple[int, str] | None:
        """(rows of the token embedding, where that number is set), known before the model is built; None when not."""
        if self._hf_config_read is not None:
            return int(self._hf_config_read.vocab_size), "CausalLMModule.hf_config's vocab_size"
        if self.litgpt_config is not None:
            from litgpt import Config

            rows = Config(**self.litgpt_config).padded_vocab_size
            return int(rows), "CausalLMModule.litgpt_config's padded_vocab_size"
        if self.model is None:
            return None
        if self.parts is not None:
            embed = self.model.get_submodule(self.parts.embed[0])
        else:
            embed = self.model.get_input_embeddings() if is_hf_pretrained(self.model) else None
        if isinstance(embed, nn.Embedding):
            return embed.num_embeddings, f"the token embedding of {type(self.model).__name__} (its rows)"
        return None

    def model_shape(self) -> ModelShape | None:
        """The sizes the layout rules check, from the config, before the model is built (``protocols.StatesShape``):
        a tensor or expert degree that does not divide them is refused before any other rank starts. None for a
        model given whole without a Hugging Face or litgpt config (placement checks it)."""
        if self._hf_config_read is not None:
            return ModelShape.of_hf_config(self._hf_config_read, "CausalLMModule.hf_config")
        if self.litgpt_config is not None:
            from litgpt import Config  # installed where litgpt_config is used (build_litgpt_model says how)

            return ModelShape.of_litgpt_config(Config(**self.litgpt_config), "CausalLMModule.litgpt_config")
        config = getattr(self.model, "config", None)
        if family_of(self.model) == "litgpt":
            return ModelShape.of_litgpt_config(config, f"{type(self.model).__name__}.config")
        if isinstance(getattr(config, "model_type", None), str):
            return ModelShape.of_hf_config(config, f"{type(self.model).__name__}.config")
        return None

    def _declare_plan(self) -> None:
        """litgpt's GPT and Hugging Face's GPT-2 declare no parallel plan (other Hugging Face models carry theirs in
        their configs): the package's."""
        declare = {"litgpt": declare_litgpt_plan, "gpt2": declare_gpt2_plan}.get(family_of(self.model) or "")
        if declare is not None and not hasattr(self.model, "parallel_plan"):
            declare(self.model)

    def _layers(self) -> nn.ModuleList:
        """The decoder's own list of layers (``model.layers``, ``transformer.h``)."""
        return self.model.get_submodule(self._declared().blocks)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The hyperparameters describe the model as created (maybe pseudo); loading rebuilds the structure it has now.
        if self.model is not None:
            checkpoint[STRUCTURE_KEY] = {"num_unique_blocks": len({id(layer) for layer in self._layers()})}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this before load_state_dict: a checkpoint taken after delinking needs the real model (a
        # real checkpoint loaded into shared layers would write every layer's weights into one block).
        saved = checkpoint.get(STRUCTURE_KEY, {}).get("num_unique_blocks")
        if saved is None:
            return
        self.configure_model()
        current = len({id(layer) for layer in self._layers()})
        if saved == current:
            return
        if saved < current or saved % current:
            raise ValueError(f"the checkpoint holds a decoder with {saved} unique blocks, which cannot be built from "
                             f"this module's {current} by delinking; create it with num_unique_blocks={saved}")
        delink(self.model, num_unique_blocks=saved)

    def block_list(self) -> str:
        """Where the block list is, from this module (``protocols.NamesBlockList``)."""
        return f"model.{self._declared().blocks}"

    def block_holder(self) -> str:
        """The causal LM itself holds the block contract: its forward returns the logits (a pipeline replaces it;
        ``protocols.NamesBlockHolder``)."""
        return "model"

    def _declared(self) -> DecoderParts:
        # Found once, on the model as built: placement later wraps its modules (FSDP2's classes, offload's streams)
        # or stands in for another pipeline rank's, and delinking may rebuild it; the names stay.
        if self._parts_found is None:
            self._parts_found = decoder_parts(self.model, self.parts)
            if self.parts is None and family_of(self.model) is None:  # found, not declared: say what was found
                found = self._parts_found
                rank_zero_info(f"CausalLMModule: {type(self.model).__name__}'s parts found from Hugging Face's "
                               f"conventions: blocks {found.blocks}, embedding {list(found.embed)}, final norm "
                               f"{found.norm}, head {found.head}" + (f"; layered accumulation and pipelines "
                                                                     f"refuse it: {found.unstageable}"
                                                                     if found.unstageable else ""))
        return self._parts_found

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) of ``input_ids`` (batch, seq)."""
        output = self._model_output(input_ids)
        return output if isinstance(output, torch.Tensor) else output.logits

    def generate(self, prompt_ids: torch.Tensor | list[int], max_new_tokens: int, *, max_seq_len: int,
                 temperature: float = 1.0, top_k: int | None = None, seed: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample a continuation of ``prompt_ids`` with the sampling of ``M6LanguageModel.generate``
        (``generation.sample_next``); each step runs the model on the whole sequence so far, without a key/value
        cache (``generation.generate_tokens_uncached``).

        Args:
            prompt_ids: token ids, (prompt,) or (batch, prompt).
            max_new_tokens: tokens to add; prompt and continuation must fit ``max_seq_len``.
            max_seq_len: the longest sequence the model was trained on (``data.seq_len``): the model's own limit
                (``max_position_embeddings``) may be longer, but it never saw positions past its windows; a request
                that does not fit is refused (the window does not slide).
            temperature: 0 is greedy decoding (deterministic); higher flattens the distribution.
            top_k: sample among the k most likely tokens only (None: all).
            seed: seeds a generator for the draws (the same seed draws the same text); ignored with ``generator``.
            generator: the random generator to draw with, on the model's device.

        Returns:
            the prompt followed by the new tokens, shaped like ``prompt_ids`` with ``max_new_tokens`` more.
        """
        if self.model is None:
            self.configure_model()
        device = next(self.model.parameters()).device
        prompt, one_sequence = prompt_batch(prompt_ids, device)
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
        tokens = generate_tokens_uncached(self, prompt, max_new_tokens, max_seq_len, temperature=temperature,
                                          top_k=top_k, generator=generator)
        return tokens[0] if one_sequence else tokens

    def _model_output(self, input_ids: torch.Tensor) -> Any:
        if self._positional is None:  # the model's call style, from its declaration (read once: not per step)
            parts = self.parts or KNOWN_DECODERS.get(family_of(self.model) or "")
            self._positional = parts is not None and parts.call == "positional"
        return self.model(input_ids) if self._positional else self.model(input_ids=input_ids, use_cache=False)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """The next-token cross-entropy; plus, for a Hugging Face MoE with ``output_router_logits=True``, its
        load-balancing loss times its ``router_aux_loss_coef``, as the model's own loss adds it (logged apart as
        ``train/ce`` and ``train/aux_loss``)."""
        inputs, targets = next_token_batch(batch)
        output = self._model_output(inputs)
        logits = output if isinstance(output, torch.Tensor) else output.logits
        loss = self.token_loss(logits, targets)
        aux = getattr(output, "aux_loss", None)
        if isinstance(aux, torch.Tensor):
            ce, loss = loss, loss + aux_loss_coefficient(self.model) * aux.to(loss.device)
            self.log("train/ce", ce.detach(), sync_dist=False)
            self.log("train/aux_loss", aux.detach(), sync_dist=False)
        self.log("train/loss", loss.detach(), prog_bar=True, sync_dist=False)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = next_token_batch(batch)
        loss = next_token_loss(self(inputs), targets)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def layered_stages(self) -> LayeredStages:
        """The model in stages for layered accumulation, from its declaration (``models.decoders``)."""
        holder = find_block_sequence(self)  # the strategy declared the block list (strategy/blocks.py)
        return decoder_stages(self.model, self._declared(), list(holder.layer_to_block), next_token_batch,
                              log_metrics=self._log_stage_metrics,
                              token_loss=lambda logits, targets: self.token_loss(logits, targets))

    def pipeline_parts(self) -> PipelineParts:
        """The model as pipeline parallelism cuts it, from its declaration (``models.decoders``)."""
        check_stageable(self.model, self._declared(), "pipeline parallelism")
        return decoder_pipeline_parts(self.model, self._declared(), self.layered_stages(), next_token_batch)

    def _log_stage_metrics(self, metrics: dict[str, torch.Tensor]) -> None:
        self.log("train/loss", metrics["loss"], prog_bar=True, sync_dist=False)
        for name in ("ce", "aux_loss"):
            if name in metrics:
                self.log(f"train/{name}", metrics[name], sync_dist=False)

    def configure_optimizers(self) -> dict[str, Any]:
        return adamw_with_schedule(self, self.optimizer_config)

    def on_train_start(self) -> None:
        check_schedule_covers_run(self.trainer)  # a resumed schedule that ends before the run does
