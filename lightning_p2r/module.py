"""``M6LanguageModel``: the LightningModule that trains an :class:`M6Transformer` as a causal language model."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics.text import Perplexity

from . import register_strategies
from .cli.options_diff import describe_differences, differing_options
from .console.known_warnings import silence_known_noise
from .data.language_eval import LanguageLosses
from .generation import generate_tokens, prompt_batch
from .models import M6Config, M6Output, M6Transformer, RoutingStats
from .models.moe import update_routing_biases
from .models.transformer import LayerContext
from .planning.model import model_forward_flops
from .protocols import LayeredStages, PipelineParts
from .sharing import delink, shared_experts

STRUCTURE_KEY = "lightning_p2r_structure"


def structure_as_held(hyper: dict[str, Any], structure: dict[str, Any] | None, depth: int) -> dict[str, Any]:
    """``num_unique_blocks``, ``pseudo_depth`` and ``growth_init`` of the model a checkpoint's tensors hold (the
    hyperparameters describe the model as created, maybe a pseudo one); ``depth``: the config's number of layers.
    After delinking or growth to ``depth`` the model is real; a staged delinking leaves fewer blocks."""
    held = {key: hyper.get(key, default) for key, default in
            (("num_unique_blocks", None), ("pseudo_depth", "shared"), ("growth_init", "copy"))}
    blocks = (structure or {}).get("num_unique_blocks")
    if blocks is not None and blocks != held["num_unique_blocks"]:
        if blocks >= depth:
            held.update(num_unique_blocks=None, pseudo_depth="shared", growth_init="copy")
        else:
            held["num_unique_blocks"] = blocks
    return held


def config_as_held(config: dict[str, Any], structure: dict[str, Any] | None) -> dict[str, Any]:
    """The model config (``M6Config`` as a dict) of the model a checkpoint's tensors hold. Its hyperparameters
    describe the model as created, maybe a pseudo one; the structure ``on_save_checkpoint`` records says what it is
    now: after delinking or growth its blocks are its layers' own (or fewer shared ones, staged), after upcycling
    every expert has its own FFN. Without a record (a checkpoint of an older version) the config is as saved."""
    held = {**config, **structure_as_held(config, structure, config["num_layers"])}
    if (structure or {}).get("experts_shared") is False:
        held["num_unique_experts"] = None
    return held

register_strategies()  # Trainer(strategy="p2r") resolves once the model code is loaded


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW with linear warmup, then cosine decay or warmup-stable-decay, stepped once per optimizer step."""

    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup. 0 is allowed (the weights stay put: measuring a run)."""

    weight_decay: float = 0.1
    """Decoupled weight decay for matrices; norms and biases are never decayed."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decay rates."""

    eps: float = 1e-8
    """AdamW's denominator epsilon."""

    warmup_steps: int = 50
    """Optimizer steps of linear warmup from 0 to lr."""

    min_lr_ratio: float = 0.1
    """The schedule decays to lr * min_lr_ratio at the last step (0 decays fully)."""

    schedule: Literal["cosine", "wsd"] = "cosine"
    """After warmup: "cosine" decays over the whole rest of the run; "wsd" (warmup-stable-decay) holds lr, then
    decays linearly over the last ``decay_fraction`` of the run. WSD lets runs of different lengths, or arms that
    branch from one trunk, share the stable phase and still end fully decayed."""

    decay_fraction: float = 0.2
    """"wsd" only: the share of all optimizer steps spent decaying at the end of the run."""

    fused: bool | None = None
    """Use torch's fused AdamW kernel; None uses it where the device supports it (CPU and CUDA do)."""

    nonfinite_loss: Literal["stop", "skip"] = "stop"
    """A NaN or infinite training loss: "stop" ends the run with an error naming the step (before its update, so the
    last checkpoint holds good weights); "skip" drops that step's update, warns and goes on. Under gradient
    accumulation one non-finite micro-batch stops or skips its whole step (the ranks decide once per step, before
    its update, as DeepSpeed and AMP's gradient scaler skip a step)."""

    def __post_init__(self) -> None:
        if self.lr < 0:  # 0 is legitimate: the weights stay put (measuring a run's cost, or its data)
            raise ValueError(f"OptimizerConfig.lr must be >= 0, got {self.lr!r}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"OptimizerConfig.betas must be two values in [0, 1), got {self.betas!r}")
        if self.eps <= 0:
            raise ValueError(f"OptimizerConfig.eps must be > 0, got {self.eps!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimizerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"OptimizerConfig.schedule must be 'cosine' or 'wsd', got {self.schedule!r}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"OptimizerConfig.decay_fraction must be in (0, 1], got {self.decay_fraction!r}")
        if self.nonfinite_loss not in ("stop", "skip"):
            raise ValueError(f"OptimizerConfig.nonfinite_loss must be 'stop' or 'skip', got {self.nonfinite_loss!r}")
        self.betas = tuple(self.betas)


class WarmupCosine:
    """LR multiplier: linear warmup, then cosine from 1 to ``min_lr_ratio`` over the remaining steps.

    A small class rather than a closure so ``LambdaLR.state_dict()`` stores its plain attributes and a resumed
    run (or a delinked one that rebinds the scheduler) continues the same curve.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = max(total_steps, warmup_steps + 2)
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        # Steps run 0 .. total_steps - 1: the last one trains at lr * min_lr_ratio.
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - 1 - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupStableDecay:
    """LR multiplier: linear warmup, 1 until the last ``decay_fraction`` of the run, then linear to ``min_lr_ratio``
    at the last step (Hu et al. 2024, MiniCPM's "WSD"). A class for the same reason as :class:`WarmupCosine`."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = max(total_steps, warmup_steps + 2)
        self.min_lr_ratio = min_lr_ratio
        # The decay never starts inside the warmup, and spans at least one step.
        decay_steps = max(1, round(decay_fraction * self.total_steps))
        self.decay_start = max(warmup_steps, self.total_steps - 1 - decay_steps)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if step <= self.decay_start:
            return 1.0
        progress = min(1.0, (step - self.decay_start) / (self.total_steps - 1 - self.decay_start))
        return 1.0 - (1.0 - self.min_lr_ratio) * progress


def lr_multiplier(config: OptimizerConfig, total_steps: int) -> WarmupCosine | WarmupStableDecay:
    """The LR multiplier ``config.schedule`` names, over a run of ``total_steps`` optimizer steps."""
    if config.schedule == "wsd":
        return WarmupStableDecay(config.warmup_steps, total_steps, config.min_lr_ratio, config.decay_fraction)
    return WarmupCosine(config.warmup_steps, total_steps, config.min_lr_ratio)


def parameter_groups(module: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (and embeddings), not norms or biases; each shared tensor appears once."""
    decay, no_decay = [], []
    for _, param in module.named_parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(params: list[dict[str, Any]], config: OptimizerConfig) -> torch.optim.AdamW:
    kwargs: dict[str, Any] = {"lr": config.lr, "betas": config.betas, "eps": config.eps}
    if config.fused is not None:
        return torch.optim.AdamW(params, fused=config.fused, **kwargs)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except RuntimeError:  # a device without the fused kernel: fall back to the default implementation
        return torch.optim.AdamW(params, **kwargs)


QKV_LAYOUT = "head_major"
"""How ``CausalSelfAttention.qkv``'s output rows are laid out, recorded in checkpoints (see ``on_load_checkpoint``)."""


def next_token_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed window (batch, seq + 1) -> inputs (batch, seq) and targets shifted by one."""
    if batch.dim() != 2 or batch.shape[1] < 2:
        raise ValueError(f"expected token windows of shape (batch, seq + 1), got {tuple(batch.shape)}")
    return batch[:, :-1], batch[:, 1:]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (batch, seq, vocab) against targets (batch, seq), computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def data_ranks(trainer: L.Trainer) -> int:
    """Ranks that read different batches: under tensor or pipeline parallelism several ranks read the same one (the
    strategy's sampler settings say how many differ), so tokens per second must not count it once per rank."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    return int(kwargs.get("num_replicas", trainer.world_size)) if kwargs else trainer.world_size


def loggers_write_this_step(trainer: L.Trainer) -> bool:
    """Whether Lightning hands the values logged during the current optimizer step to the loggers: on every
    ``log_every_n_steps``-th step and when the run is stopping (Lightning's rule, read through public attributes
    before the step is taken; ``on_train_batch_end`` sees ``global_step`` already advanced)."""
    every = trainer.log_every_n_steps
    return bool(every) and ((trainer.global_step + 1) % every == 0 or trainer.should_stop)


def loggers_write_after_this_batch(trainer: L.Trainer) -> bool:
    """:func:`loggers_write_this_step` read in ``on_train_batch_end``, where a completed step has already advanced
    ``global_step`` (the earlier micro-batches of a step, which have not, may answer True as well: a value logged
    there is overwritten by the step's last)."""
    every = trainer.log_every_n_steps
    return bool(every) and (trainer.global_step % every == 0 or trainer.should_stop)


def routing_metrics(routing: dict[int, RoutingStats]) -> dict[str, torch.Tensor]:
    """Balance and drop rate averaged over MoE layers and per layer, keyed by their logged names (moe/...)."""
    if not routing:
        return {}
    metrics = {
        "moe/load_max_over_mean": torch.stack([s.load_max_over_mean for s in routing.values()]).mean(),
        "moe/dropped_fraction": torch.stack([s.dropped_fraction for s in routing.values()]).mean(),
    }
    for layer, stats in routing.items():
        metrics[f"moe/layer{layer}/load_max_over_mean"] = stats.load_max_over_mean
        metrics[f"moe/layer{layer}/dropped_fraction"] = stats.dropped_fraction
    return metrics


@dataclass
class _MicroBatchContext:
    """One micro-batch's state between the layered stages. The router statistics are keyed by layer: a recomputed
    layer overwrites its entry instead of adding a second one."""

    layer: LayerContext
    targets: torch.Tensor
    aux: dict[int, torch.Tensor] = field(default_factory=dict)
    z: dict[int, torch.Tensor] = field(default_factory=dict)
    routing: dict[int, RoutingStats] = field(default_factory=dict)


# Shared defaults are safe: __init__ copies them. Non-None defaults let jsonargparse expose every field as
# --model.config.<field>.
_DEFAULT_CONFIG = M6Config()
_DEFAULT_OPTIMIZER = OptimizerConfig()


class M6LanguageModel(L.LightningModule):
    """Next-token cross-entropy on an M6 MoE transformer, plus the weighted router losses.

    Args:
        config: the model's shape (see :class:`M6Config`).
        optimizer: AdamW and LR schedule settings (see :class:`OptimizerConfig`).
    """

    def __init__(self, config: M6Config = _DEFAULT_CONFIG, optimizer: OptimizerConfig = _DEFAULT_OPTIMIZER) -> None:
        super().__init__()
        silence_known_noise()  # again here: a test runner or notebook may have reset the filters set on import
        # Checkpoints are loaded with weights_only=True, so hyperparameters are stored as plain dicts.
        self.config = _as_dataclass(M6Config, config)
        self.optimizer_config = _as_dataclass(OptimizerConfig, optimizer)
        self.save_hyperparameters({"config": self.config.to_dict(),
                                   "optimizer": dataclasses.asdict(self.optimizer_config)})
        self.transformer: M6Transformer | None = None
        self.token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss
        """The training cross-entropy of logits against targets. A strategy whose LM head leaves each rank a
        vocabulary shard of the logits in training (tensor parallelism) puts a vocabulary-parallel one here."""
        self.val_perplexity = Perplexity()
        self._language_losses: LanguageLosses | None = None
        self._last_batch_end: float | None = None
        self._step_loss: torch.Tensor | None = None
        """With several micro-batches per step: the step's latest loss while all were finite, then its first
        non-finite one (a tensor: no host sync until the ranks decide, before the update; what an error shows)."""

    # ------------------------------------------------------------------------------------------------ model
    def setup(self, stage: str) -> None:
        # Before the model is built: a vocabulary larger than the embedding would fail with an IndexError mid-step.
        data_vocab = getattr(self.trainer.datamodule, "vocab_size", None)  # Lightning calls setup attached
        if isinstance(data_vocab, int) and data_vocab > self.config.vocab_size:
            raise ValueError(
                f"the data's tokenizer has {data_vocab} ids but M6Config.vocab_size is {self.config.vocab_size}: ids "
                f">= {self.config.vocab_size} would index past the embedding. Set model.config.vocab_size to at "
                f"least {data_vocab} (or data.vocab_size to at most {self.config.vocab_size})")

    def configure_model(self) -> None:
        # Built here rather than in __init__ so a strategy can create it on the meta device or per rank.
        if self.transformer is None:
            self.transformer = M6Transformer(self.config)

    # -------------------------------------------------------------------------------------------- structure
    def _check_resumed_options(self, saved: dict[str, Any] | None) -> None:
        """Resuming training with model or optimizer options other than the checkpoint's is refused: the weights,
        the optimizer state and the LR schedule all come from the checkpoint, so the new options would be partly
        ignored. Loading for evaluation, or ``load_from_checkpoint(..., config=...)``, may change them."""
        try:
            resuming = self.trainer.state.fn == "fit"
        except RuntimeError:  # not attached to a Trainer: load_from_checkpoint
            return
        if not resuming or not saved:
            return
        requested = {"config": self.config.to_dict(), "optimizer": dataclasses.asdict(self.optimizer_config)}
        differences = differing_options(requested, saved)
        if differences:
            raise ValueError(
                f"this run's options differ from the checkpoint's: {describe_differences(differences)}. A resumed "
                "run continues the checkpoint's model and optimizer: drop these options (or set them to the "
                "checkpoint's values) to resume it, or leave out --ckpt_path / ckpt_path to start a new run")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The hyperparameters describe the model as it was created (maybe pseudo); record the structure it has
        # now, so loading rebuilds it before the weights arrive.
        if self.transformer is not None:
            checkpoint[STRUCTURE_KEY] = {"num_unique_blocks": len(self.transformer.blocks),
                                         "experts_shared": bool(shared_experts(self.transformer)),
                                         "qkv_layout": QKV_LAYOUT}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._check_resumed_options(checkpoint.get("hyper_parameters"))
        structure = checkpoint.get(STRUCTURE_KEY)
        if structure is not None and structure.get("qkv_layout") != QKV_LAYOUT:
            raise ValueError(
                "this checkpoint was saved before the attention's qkv rows became head-major (each head's q, k, v "
                "together, for tensor parallelism): its weights would load without error but the attention would "
                "read them as other heads' q, k and v. Train it again with this version, or use the lightning-p2r "
                "commit that saved it")
        # Lightning calls this before load_state_dict: a checkpoint taken after delinking needs the real shape.
        saved = checkpoint.get(STRUCTURE_KEY, {}).get("num_unique_blocks")
        if saved is None:
            return
        self.configure_model()
        current = len(self.transformer.blocks)
        upcycled = checkpoint[STRUCTURE_KEY].get("experts_shared") is False and shared_experts(self.transformer)
        if saved != current or upcycled:
            if saved < current or saved % current or (upcycled and saved == current < self.transformer.full_depth):
                raise ValueError(
                    f"the checkpoint holds a model with {saved} unique blocks, which cannot be built from this "
                    f"model's {current} by delinking; create the module with num_unique_blocks={saved}"
                )
            delink(self.transformer, num_unique_blocks=saved)

    def forward(self, input_ids: torch.Tensor) -> M6Output:
        if self.transformer is None:
            self.configure_model()
        return self.transformer(input_ids)

    def generate(self, prompt_ids: torch.Tensor | list[int], max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, seed: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample a continuation of ``prompt_ids`` with a key/value cache (one position per new token) and MoE
        layers that drop no token; see :mod:`lightning_p2r.generation`.

        Args:
            prompt_ids: token ids, (prompt,) or (batch, prompt).
            max_new_tokens: tokens to add; prompt and continuation must fit ``config.max_seq_len`` (refused
                otherwise: the window does not slide).
            temperature: 0 is greedy decoding (deterministic); higher flattens the distribution.
            top_k: sample among the k most likely tokens only (None: all).
            seed: seeds a generator for the draws (the same seed draws the same text); ignored with ``generator``.
            generator: the random generator to draw with, on the model's device.

        Returns:
            the prompt followed by the new tokens, shaped like ``prompt_ids`` with ``max_new_tokens`` more.
        """
        if self.transformer is None:
            self.configure_model()
        device = self.transformer.tok_embeddings.weight.device
        prompt, one_sequence = prompt_batch(prompt_ids, device)
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
        tokens = generate_tokens(self.transformer, prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                                 generator=generator)
        return tokens[0] if one_sequence else tokens

    def losses(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs, targets = next_token_batch(batch)
        out = self(inputs)
        ce = self.token_loss(out.logits, targets)
        total = ce + self.config.router_aux_loss_coef * out.aux_loss + self.config.router_z_loss_coef * out.z_loss
        return {"loss": total, "ce": ce, "aux": out.aux_loss, "z": out.z_loss, "output": out}

    def layered_stages(self) -> LayeredStages:
        """The model cut into stages for layered gradient accumulation (``lightning_p2r.strategy.layered``).

        Each micro-batch is a token-window batch (batch, seq + 1). The stages optimise the same objective as
        :meth:`losses`: the cross-entropy, plus per MoE layer ``aux_coef * aux + z_coef * z``, which sums to the
        weighted sums ``losses()`` adds. The stages snapshot the sharing map: build them again
        after the structure changes (``delink``).
        """

        if self.transformer is None:
            self.configure_model()
        transformer = self.transformer
        config = self.config
        layer_to_block = list(transformer.layer_to_block)

        def embed(batch: torch.Tensor) -> tuple[torch.Tensor, _MicroBatchContext]:
            inputs, targets = next_token_batch(batch)
            hidden, context = transformer.embed(inputs)
            return hidden, _MicroBatchContext(layer=context, targets=targets)

        def layer(index: int, hidden: torch.Tensor, context: _MicroBatchContext
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden, moe = transformer.run_layer(index, hidden, context.layer)
            if moe is None:
                return hidden, None
            context.aux[index] = moe.aux_loss.detach()
            context.z[index] = moe.z_loss.detach()
            context.routing[index] = moe.stats
            extra = config.router_aux_loss_coef * moe.aux_loss + config.router_z_loss_coef * moe.z_loss
            return hidden, extra

        def head(hidden: torch.Tensor, context: _MicroBatchContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            logits = transformer.head(hidden)
            ce = self.token_loss(logits, context.targets)
            return ce, self.micro_batch_metrics(ce, context)

        return LayeredStages(embed=embed, layer=layer, head=head, layer_to_block=layer_to_block,
                             log_metrics=self.log_train_metrics)

    def micro_batch_metrics(self, ce: torch.Tensor, context: _MicroBatchContext) -> dict[str, torch.Tensor]:
        """One micro-batch's detached metrics from its cross-entropy and the router records of its layers."""
        config = self.config
        zero = ce.new_zeros(())
        aux = torch.stack([context.aux[k] for k in sorted(context.aux)]).sum() if context.aux else zero
        z = torch.stack([context.z[k] for k in sorted(context.z)]).sum() if context.z else zero
        total = ce.detach() + config.router_aux_loss_coef * aux + config.router_z_loss_coef * z
        routing = {k: context.routing[k] for k in sorted(context.routing)}
        return {"ce": ce.detach(), "loss": total, "aux": aux, "z": z} | routing_metrics(routing)

    def pipeline_parts(self) -> PipelineParts:
        """The model as pipeline parallelism cuts it (``lightning_p2r.strategy.pipeline``): the layered stages, the
        modules of the first and last stage, and how a stage after the first rebuilds a micro-batch's context."""
        stages = self.layered_stages()
        transformer = self.transformer

        def context(batch: torch.Tensor) -> _MicroBatchContext:
            inputs, targets = next_token_batch(batch)
            return _MicroBatchContext(layer=transformer.layer_context(inputs), targets=targets)

        def records(context: _MicroBatchContext) -> dict[str, Any]:
            return {"aux": dict(context.aux), "z": dict(context.z), "routing": dict(context.routing)}

        def absorb(context: _MicroBatchContext, other: dict[str, Any]) -> None:
            context.aux.update(other["aux"])
            context.z.update(other["z"])
            context.routing.update(other["routing"])

        def output(logits: torch.Tensor) -> M6Output:
            # Evaluation reads the logits; the router losses stay on the stages that computed them.
            zero = logits.new_zeros((), dtype=torch.float32)
            return M6Output(logits=logits, aux_loss=zero, z_loss=zero)

        embed = [m for m in (transformer.tok_embeddings, transformer.pos_embeddings) if m is not None]
        return PipelineParts(stages=stages, context=context, embed_modules=embed,
                             head_modules=[transformer.norm, transformer.lm_head], logits=transformer.head,
                             window=lambda inputs: F.pad(inputs, (0, 1)), output=output, records=records,
                             absorb=absorb, metrics=self.micro_batch_metrics)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._decide_step_losses(optimizer)
        # Loss-free balancing (M6Config.router_balance="bias"): the routing biases move once per optimizer step, by
        # the whole step's load (every micro-batch, every process: the same update on every rank; a skipped step's
        # routing happened too, and its load is counted and cleared as any step's).
        if self.transformer is not None and self.config.router_balance == "bias":
            world = self.trainer.world_size if self._trainer is not None else 1
            reduce = (lambda load: self.trainer.strategy.reduce(load, reduce_op="sum")) if world > 1 else None
            update_routing_biases(self.transformer, reduce)

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one token's forward at ``seq_len`` (active experts and attention counted): what
        :class:`~lightning_p2r.callbacks.Throughput` turns into TFLOP/s and MFU."""
        return model_forward_flops(self.config, seq_len)

    # ------------------------------------------------------------------------------------------------ steps
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        result = self.losses(batch)
        self.log_train_metrics({"ce": result["ce"], "loss": result["loss"], "aux": result["aux"], "z": result["z"]}
                               | routing_metrics(result["output"].routing))
        loss = result["loss"]
        if self._trainer is None or self.trainer.accumulate_grad_batches == 1:
            return loss if self.loss_is_usable(loss) else None  # None: Lightning skips the backward and the update
        # Several micro-batches per step: each runs its backward whatever its loss (the reductions and the gradients
        # held outside .grad stay in step on every rank), and the ranks decide once, before the update
        # (on_before_optimizer_step). Deciding here cost a blocking cross-rank all-reduce, and on a GPU a host sync,
        # every micro-batch: up to a tenth of a 2-process step of 8 micro-batches on a 2-vCPU machine
        # (docs/benchmarks.md, "The loss check once per step").
        shown = loss.detach()
        if self._step_loss is not None:  # keep the first non-finite loss (a selection on the device: no sync)
            shown = torch.where(torch.isfinite(self._step_loss), shown, self._step_loss)
        self._step_loss = shown
        return loss

    def _decide_step_losses(self, optimizer: torch.optim.Optimizer) -> None:
        """The once-per-step decision on the micro-batches' losses (see ``training_step``), before the update. A
        skipped step leaves every gradient None, so the optimizer leaves every parameter alone (no decay, no moments;
        the strategy's optimizer also forgets the gradients it holds on the host)."""
        shown, self._step_loss = self._step_loss, None
        if shown is not None and not self.loss_is_usable(shown):
            optimizer.zero_grad(set_to_none=True)

    def loss_is_usable(self, loss: torch.Tensor) -> bool:
        """Whether this step's loss may update the weights: True when finite. A NaN or infinite loss raises
        (``nonfinite_loss="stop"``) or returns False (``"skip"``). Every rank decides alike (the decision is reduced),
        as a step skipped on one rank only would hang the others' gradient reduction. The layered and pipeline
        paths call this with the whole step's loss, as ``training_step`` does with one micro-batch per step; with
        several, the step's micro-batches are decided together before the update (``on_before_optimizer_step``):
        a non-finite one anywhere skips, or stops, the whole step."""
        if self.trainer.strategy.reduce_boolean_decision(bool(torch.isfinite(loss.detach()).all()), all=True):
            return True
        step = self.trainer.global_step
        if self.optimizer_config.nonfinite_loss == "skip":
            rank_zero_warn(f"non-finite training loss ({float(loss)}) at step {step}: its update is skipped "
                           "(model.optimizer.nonfinite_loss=skip)")
            return False
        raise FloatingPointError(
            f"the training loss is {float(loss)} at step {step}: stopping before this step's update (the last "
            "checkpoint holds the weights before it). Lower model.optimizer.lr, clip gradients "
            "(--trainer.gradient_clip_val=1.0), use bf16 rather than fp16, or set model.optimizer.nonfinite_loss="
            "skip to skip such steps")

    def log_train_metrics(self, metrics: dict[str, torch.Tensor]) -> None:
        """Log one training step's metrics: ``ce`` (as ``train/loss``), ``loss`` (total), ``aux``, ``z`` and any
        ``moe/...`` keys.

        Shared by ``training_step`` and the layered stages (whose strategy passes the micro-batch means), so both
        paths log the same names. ``train/loss`` is logged on every batch, for the progress bar; the others only on
        the steps whose values reach the loggers (:func:`loggers_write_this_step`; always without a Trainer). Each
        ``self.log`` is about 0.3 ms of Lightning's Python on a CPU, whatever the model, and the values of the other
        steps were never written anywhere: logged on every batch, a 4-layer model of width 32 with 4 micro-batches
        stepped in 16.9 ms against 13.8 (docs/benchmarks.md, "Per-token layer costs, and logging").
        """
        self.log("train/loss", metrics["ce"], prog_bar=True)
        if self._trainer is not None and not loggers_write_this_step(self.trainer):
            return
        self.log("train/total_loss", metrics["loss"])
        self.log("train/aux_loss", metrics["aux"])
        self.log("train/z_loss", metrics["z"])
        for key, value in metrics.items():
            if key.startswith("moe/"):
                self.log(key, value)

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_batch_end is not None:
            tokens = (batch.shape[1] - 1) * batch.shape[0] * data_ranks(self.trainer)
            self.log("train/tokens_per_sec", tokens / max(now - self._last_batch_end, 1e-9), prog_bar=True)
        self._last_batch_end = now
        if not loggers_write_after_this_batch(self.trainer):  # the rest reaches no logger on this batch
            return
        schedulers = self.lr_schedulers()
        if schedulers is not None:
            scheduler = schedulers[0] if isinstance(schedulers, list) else schedulers
            self.log("lr", scheduler.get_last_lr()[0])
        mixture = getattr(self.trainer.datamodule, "realized_mixture", None)
        for code, share in (mixture() if mixture is not None else {}).items():
            self.log(f"data/mixture/{code}", share)

    def on_train_epoch_start(self) -> None:
        self._last_batch_end = None  # the gap across validation or epoch boundaries is not throughput

    def on_validation_start(self) -> None:
        self._last_batch_end = None

    def _start_languages(self) -> None:
        """A multilingual data module gives one evaluation loader per language (or per mixed prepared directory): sum
        each one's loss."""
        languages = getattr(self.trainer.datamodule, "eval_streams", None) if self._trainer is not None else None
        self._language_losses = LanguageLosses(list(languages)) if languages else None

    def _log_languages(self, split: str) -> None:
        """Each language's loss, perplexity and bits per byte over the whole pass, summed over the ranks."""
        if self._language_losses is None:
            return
        sums = torch.stack([self._language_losses.loss_sums, self._language_losses.tokens]).to(self.device)
        sums = self.trainer.strategy.reduce(sums, reduce_op="sum").double().cpu()
        self._language_losses.loss_sums, self._language_losses.tokens = sums[0], sums[1]
        metrics = self._language_losses.metrics(split, self.trainer.datamodule.tokens_per_byte(split))
        self.log_dict(metrics, prog_bar=False)
        self._language_losses = None

    def on_validation_epoch_start(self) -> None:
        self._start_languages()

    def on_validation_epoch_end(self) -> None:
        self._log_languages("val")

    def on_test_epoch_start(self) -> None:
        self._start_languages()

    def on_test_epoch_end(self) -> None:
        self._log_languages("test")

    def validation_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        inputs, targets = next_token_batch(batch)
        out = self(inputs)
        loss = next_token_loss(out.logits, targets)
        if self._language_losses is not None:  # logged per language, and overall, at the end of the pass
            self._language_losses.add(dataloader_idx, loss, targets.numel())
            return
        self.val_perplexity(out.logits.float(), targets)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", self.val_perplexity)

    def test_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        inputs, targets = next_token_batch(batch)
        loss = next_token_loss(self(inputs).logits, targets)
        if self._language_losses is not None:
            self._language_losses.add(dataloader_idx, loss, targets.numel())
            return
        self.log("test/loss", loss, sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """Greedy next-token prediction for every input position of a window (batch, seq + 1): LongTensor (batch,
        seq); the window's last token is the target of the last prediction, not an input."""
        inputs = batch[:, :-1] if batch.shape[1] > 1 else batch
        return self(inputs).logits.argmax(dim=-1)

    # ------------------------------------------------------------------------------------------------ optim
    def configure_optimizers(self) -> dict[str, Any]:
        return adamw_with_schedule(self, self.optimizer_config)

    def on_train_start(self) -> None:
        check_schedule_covers_run(self.trainer)  # a resumed schedule that ends before the run does


def total_optimizer_steps(trainer: L.Trainer) -> int:
    """Steps the schedule spans: Lightning's estimate, which honours max_steps, max_epochs and batch limits."""
    total = trainer.estimated_stepping_batches
    if not math.isfinite(total):
        raise ValueError("the warmup-cosine schedule needs a finite run: set Trainer max_steps or max_epochs")
    return int(total)


def check_schedule_covers_run(trainer: L.Trainer) -> None:
    """A resumed run keeps its checkpoint's LR schedule, length included (``LambdaLR`` restores the multiplier's
    attributes): past the schedule's last step it trains at the last step's rate, ``min_lr_ratio`` times the peak.
    Refuse a run that goes on past it at a rate of 0, which would train nothing (steps of weight decay aside),
    silently; warn when the rate is above 0. Fresh runs are never past their schedule. Called before the first step,
    once the checkpoint's states are restored."""
    total = total_optimizer_steps(trainer)
    for scheduler_config in trainer.lr_scheduler_configs:
        for multiplier in getattr(scheduler_config.scheduler, "lr_lambdas", []):
            if not isinstance(multiplier, (WarmupCosine, WarmupStableDecay)) or total <= multiplier.total_steps:
                continue
            what = (f"this run goes to step {total} (Trainer max_steps, or its epochs and batch limits), past the "
                    "end of the learning-rate schedule "
                    f"it resumed, which spans the checkpoint's {multiplier.total_steps} steps: steps "
                    f"{multiplier.total_steps} to {total - 1} would train at the schedule's last rate, "
                    f"min_lr_ratio={multiplier.min_lr_ratio} times the peak")
            if multiplier.min_lr_ratio == 0:
                raise ValueError(f"{what}, that is at learning rate 0, training nothing. Resume with "
                                 f"--trainer.max_steps={multiplier.total_steps}, or start a new run (a new schedule) "
                                 "from the checkpoint's weights: M6LanguageModel.load_from_checkpoint(path, "
                                 "weights_only=True) (or CausalLMModule's), then Trainer.fit without ckpt_path")
            rank_zero_warn(f"{what} (docs/quickstart.md, resuming)")


def adamw_with_schedule(module: L.LightningModule, config: OptimizerConfig) -> dict[str, Any]:
    """``configure_optimizers``'s answer for ``config``: AdamW over ``module``'s parameter groups (no decay on norms
    and biases) and its warmup schedule, stepped every optimizer step."""
    if config.fused is None and module.trainer.gradient_clip_val and isinstance(
            module.trainer.precision_plugin, MixedPrecision):
        # Lightning refuses to clip gradients of a fused optimizer under mixed precision (its kernel would
        # unscale inside step, after clipping): use the foreach kernel then.
        config = dataclasses.replace(config, fused=False)
    optimizer = build_adamw(parameter_groups(module, config.weight_decay), config)
    total_steps = total_optimizer_steps(module.trainer)
    if config.warmup_steps >= total_steps:
        rank_zero_warn(f"OptimizerConfig.warmup_steps={config.warmup_steps} is not shorter than the run "
                       f"({total_steps} optimizer steps): the learning rate never reaches its peak lr="
                       f"{config.lr} or decays. Lower model.optimizer.warmup_steps (a few % of the run is usual).")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config, total_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _as_dataclass(cls: type, value: Any) -> Any:
    if value is None:
        return cls()
    if isinstance(value, cls):
        return dataclasses.replace(value)
    if isinstance(value, dict):
        return cls(**value)
    raise TypeError(f"expected {cls.__name__} or a dict of its fields, got {type(value).__name__}")
