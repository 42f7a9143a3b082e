"""``P2RStrategy``: Lightning hooks over the planner, the streaming engine and the split optimizer.

The hooks only decide *when*; what happens lives in ``plan.py`` (which blocks), ``offload.py`` (moving them) and
``split_optimizer.py`` (stepping them where they live).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from ..sharing import OptimizerStatePolicy, delink, find_block_sequence, rebind_scheduler
from .offload import OffloadEngine, OffloadStats
from .plan import OffloadPlan, block_footprints, device_total_memory, parameter_footprint, parse_bytes, plan_offload
from .split_optimizer import SplitOptimizer, optimizer_state_bytes

OffloadState = Literal["params", "grads", "optimizer"]


class P2RStrategy(DDPStrategy):
    """Granular CPU offloading (M6-10T) for any LightningModule whose model declares a block sequence.

    Give at most one of ``offload_fraction``, ``offload_blocks`` and ``device_memory_budget``; none keeps every
    block on the device.

    Args:
        offload_fraction: share of the blocks kept in host memory, spread evenly through the depth.
        offload_blocks: explicit block indices to keep in host memory.
        device_memory_budget: bytes (or "12GB", "512MiB", "80%" of the device) for model states on the device;
            the planner keeps as many blocks resident as fit.
        activation_allowance: bytes (or a size string) the budget reserves for activations.
        offload_states: what offloaded blocks keep on the host: always "grads" and "optimizer" (their optimizer
            step runs on the host), and "params" unless the parameters should stay resident on the device.
        prefetch: offloaded blocks copied in ahead of use (in forward and in backward order).
        pin_memory: page-locked host buffers for asynchronous copies; "auto" pins only when an accelerator exists
            (CPU-only torch cannot pin memory).
        overlap_host_step: run an offloaded block's host optimizer step as soon as its gradients reach the host,
            while the device computes the backward of earlier blocks. Used only where it cannot change the result:
            no gradient clipping, no gradient scaler, no gradient accumulation. "auto" turns it on only with an
            accelerator: on a CPU-only machine the host step would compete with the backward for the same cores
            (measured: 476 ms instead of 345 ms per step on 2 cores).
        log_telemetry: log the offload statistics (``offload/*``) through the Trainer's loggers.
    """

    strategy_name = "p2r"

    def __init__(
        self,
        offload_fraction: float | None = None,
        offload_blocks: list[int] | None = None,
        device_memory_budget: int | str | None = None,
        activation_allowance: int | str = 0,
        offload_states: list[OffloadState] | None = None,
        prefetch: int = 1,
        pin_memory: bool | Literal["auto"] = "auto",
        overlap_host_step: bool | Literal["auto"] = "auto",
        log_telemetry: bool = True,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout)
        given = [n for n, v in (("offload_fraction", offload_fraction), ("offload_blocks", offload_blocks),
                                ("device_memory_budget", device_memory_budget)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"P2RStrategy takes one of offload_fraction, offload_blocks, device_memory_budget; "
                             f"got {given}")
        if offload_fraction is not None and not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"P2RStrategy.offload_fraction must be in [0, 1], got {offload_fraction}")
        if offload_blocks is not None and any(not isinstance(i, int) or i < 0 for i in offload_blocks):
            raise ValueError(f"P2RStrategy.offload_blocks must be block indices >= 0, got {offload_blocks}")
        if device_memory_budget is not None and not isinstance(device_memory_budget, str):
            if device_memory_budget <= 0:
                raise ValueError(f"P2RStrategy.device_memory_budget must be > 0, got {device_memory_budget}")
        if isinstance(device_memory_budget, str):
            parse_bytes(device_memory_budget, total=1)  # syntax check now; the percentage base comes at setup
        states = set(offload_states or ["params", "grads", "optimizer"])
        unknown = states - {"params", "grads", "optimizer"}
        if unknown or not {"grads", "optimizer"} <= states:
            raise ValueError(
                "P2RStrategy.offload_states must include 'grads' and 'optimizer' (an offloaded block's optimizer "
                f"step runs on the host, from host gradients) and may add 'params'; got {sorted(states)}"
            )
        if prefetch < 0:
            raise ValueError(f"P2RStrategy.prefetch must be >= 0, got {prefetch}")
        if pin_memory not in (True, False, "auto"):
            raise ValueError(f"P2RStrategy.pin_memory must be True, False or 'auto', got {pin_memory!r}")
        if overlap_host_step not in (True, False, "auto"):
            raise ValueError(f"P2RStrategy.overlap_host_step must be True, False or 'auto', got {overlap_host_step!r}")
        self.offload_fraction = offload_fraction
        self.offload_blocks = offload_blocks
        self.device_memory_budget = device_memory_budget
        self.activation_allowance = activation_allowance
        self.offload_states = states
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self.overlap_host_step = overlap_host_step
        self.log_telemetry = log_telemetry
        self.plan: OffloadPlan | None = None
        self.engine: OffloadEngine | None = None
        self.telemetry: OffloadStats | None = None
        self.telemetry_history: list[OffloadStats] = []
        self._resident_model_bytes = 0

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "p2r" not in strategy_registry:
            strategy_registry.register("p2r", cls, description="lightning_p2r: granular offload (nothing offloaded "
                                       "unless configured)")
        if "p2r_offload" not in strategy_registry:
            strategy_registry.register("p2r_offload", cls, description="lightning_p2r: half the blocks offloaded "
                                       "to host memory", offload_fraction=0.5)

    # ------------------------------------------------------------------------------------------ environment
    @override
    def setup_environment(self) -> None:
        if self.world_size > 1:
            raise ValueError(
                f"P2RStrategy runs one process per job for now ({self.world_size} requested); sharding across "
                "ranks is not available yet"
            )
        self.accelerator.setup_device(self.root_device)
        self.set_world_ranks()  # one process: no process group is needed

    @property
    def resolved_pin_memory(self) -> bool:
        if self.pin_memory == "auto":
            return self.root_device.type == "cuda"
        if self.pin_memory and self.root_device.type == "cpu":
            raise ValueError("P2RStrategy(pin_memory=True) needs an accelerator: CPU-only torch cannot pin memory; "
                             "use pin_memory='auto' or False")
        return bool(self.pin_memory)

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: L.Trainer) -> None:
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self._attach()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _holder(self) -> nn.Module:
        module = self.lightning_module
        try:
            return find_block_sequence(module)
        except ValueError as error:
            raise ValueError(f"P2RStrategy needs a model made of a block sequence: {error}") from None

    def make_plan(self, holder: nn.Module) -> OffloadPlan:
        """The offload plan for the model as it is now (also after delinking changed its blocks)."""
        num_blocks = len(holder.blocks)
        budget = None
        footprints = block_footprints(holder.blocks)
        other = []
        if self.device_memory_budget is not None:
            budget = parse_bytes(self.device_memory_budget, total=device_total_memory(self.root_device))
            in_blocks = {id(p) for p in holder.blocks.parameters()}
            other = [p for p in self.lightning_module.parameters() if id(p) not in in_blocks and p.requires_grad]
        return plan_offload(
            num_blocks, offload_fraction=self.offload_fraction, offload_blocks=self.offload_blocks,
            budget_bytes=budget, footprints=footprints,
            other_bytes=parameter_footprint(other, 8).total if other else 0,
            activation_bytes=parse_bytes(self.activation_allowance, name="activation_allowance"),
            prefetch=self.prefetch,
        )

    def _attach(self) -> None:
        holder = self._holder()
        self.plan = self.make_plan(holder)
        prefix = _blocks_prefix(self.lightning_module, holder)
        pin = self.resolved_pin_memory
        self.engine = OffloadEngine(holder, self.plan.offloaded, self.root_device, prefetch=self.prefetch,
                                    pin_memory=pin, param_prefix=prefix,
                                    offload_params="params" in self.offload_states)
        self.model_to_device()  # the offloaded blocks' parameters are already empty device placeholders
        self.engine.on_block_grads_ready = self._on_block_grads_ready
        # Resident parameters and their gradients do not change size until the next re-plan: count them once.
        offloaded = {id(p) for index in self.engine.blocks for p in holder.blocks[index].parameters()}
        resident = [p for p in self.lightning_module.parameters() if id(p) not in offloaded]
        self._resident_model_bytes = sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1)
                                         for p in resident)

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        super().setup_optimizers(trainer)
        self._split_optimizer()

    def _split_optimizer(self, carry_state_from: torch.optim.Optimizer | None = None) -> None:
        if self.engine is None or not self.engine.blocks:
            if carry_state_from is not None:
                _optimizer_to_device(carry_state_from, self.root_device)
            self._update_static_bytes()
            return
        if len(self.optimizers) != 1:
            raise ValueError(f"P2RStrategy offloading supports one optimizer, got {len(self.optimizers)}")
        original = self.optimizers[0]
        split = SplitOptimizer(original, self.engine)
        if carry_state_from is not None:
            split.load_state_dict(carry_state_from.state_dict())
        for config in self.lr_scheduler_configs:
            config.scheduler = rebind_scheduler(config.scheduler, split)
        self.optimizers = [split]
        self._update_static_bytes()

    def _overlap_allowed(self) -> bool:
        """Stepping a block during backward must not skip anything that happens between backward and step."""
        module = self.lightning_module
        trainer = module.trainer
        wanted = self.root_device.type != "cpu" if self.overlap_host_step == "auto" else self.overlap_host_step
        return (wanted and module.automatic_optimization and not trainer.gradient_clip_val
                and trainer.accumulate_grad_batches == 1 and getattr(self.precision_plugin, "scaler", None) is None
                and not is_overridden("configure_gradient_clipping", module, L.LightningModule)
                and not is_overridden("optimizer_step", module, L.LightningModule))

    def _on_block_grads_ready(self, index: int) -> None:
        optimizer = self.optimizers[0] if self.optimizers else None
        if isinstance(optimizer, SplitOptimizer) and self.lightning_module.trainer.training and self._overlap_allowed():
            optimizer.submit_host_step(index)

    # ---------------------------------------------------------------------------------------------- steps
    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.finish_backward()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._record_telemetry()
        return output

    def _update_static_bytes(self) -> None:
        """Device model-state bytes that do not stream: resident parameters, their gradients, the device
        optimizer's state (which grows at the first step)."""
        if self.engine is None:
            return
        optimizer = self.optimizers[0] if self.optimizers else None
        if isinstance(optimizer, SplitOptimizer):
            optimizer = optimizer.device_optimizer
        self.engine.static_device_bytes = self._resident_model_bytes + optimizer_state_bytes(optimizer)

    def _record_telemetry(self) -> None:
        if self.engine is None:
            return
        self._update_static_bytes()
        stats = self.engine.take_stats()
        self.telemetry = stats
        self.telemetry_history.append(stats)
        trainer = self.lightning_module.trainer
        if self.log_telemetry and trainer.loggers and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            for logger in trainer.loggers:
                logger.log_metrics(stats.as_metrics(), step=trainer.global_step)

    # ------------------------------------------------------------------------------------------ delinking
    def delink_model(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer,
                     num_unique_blocks: int | None, optimizer_state: OptimizerStatePolicy) -> torch.optim.Optimizer:
        """Delink with the whole model gathered in host memory, then re-plan and re-offload.

        The real model may not fit on the device (that is why it was trained pseudo first), so the copies are
        made on the host, where memory is plentiful, and only the blocks the new plan keeps resident move back.
        """
        plain = self._detach_to_host(optimizer)
        new_optimizer = delink(pl_module, plain, num_unique_blocks=num_unique_blocks,
                               optimizer_state=optimizer_state)
        self._attach()
        self.optimizers = [new_optimizer]
        self._split_optimizer(carry_state_from=new_optimizer)
        return self.optimizers[0]

    def _detach_to_host(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if isinstance(optimizer, SplitOptimizer):
            by_master = {id(master): param for block in self.engine.blocks.values()
                         for master, param in zip(block.host, block.params)}
            slots = [by_master.get(id(p), p) for group in optimizer.param_groups for p in group["params"]]
            self.engine.detach("cpu")
            optimizer.shutdown()
            self.lightning_module.to("cpu")
            plain = optimizer.to_plain(slots)
        else:
            if self.engine is not None:
                self.engine.detach("cpu")
            self.lightning_module.to("cpu")
            plain = optimizer
        _optimizer_to_device(plain, torch.device("cpu"))
        self.engine = None
        return plain

    # ----------------------------------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = self.lightning_module.state_dict()
        if self.engine is not None:
            for name, tensor in self.engine.host_tensors().items():
                state[name] = tensor.detach()
        return state

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self.engine is None or not self.engine.blocks:
            return super().load_model_state_dict(checkpoint, strict=strict)
        state = dict(checkpoint["state_dict"])
        with torch.no_grad():
            for name, tensor in self.engine.host_tensors().items():
                tensor.copy_(state.pop(name))
        self.engine.refresh_resident_copies()
        missing, unexpected = self.lightning_module.load_state_dict(state, strict=False)
        offloaded = set(self.engine.host_tensors())
        missing = [key for key in missing if key not in offloaded]
        if strict and (missing or unexpected):
            raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
            if not isinstance(optimizer, SplitOptimizer):  # a split optimizer keeps host state on the host
                _optimizer_to_device(optimizer, self.root_device)
        self._update_static_bytes()

    # -------------------------------------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        for optimizer in self.optimizers:
            if isinstance(optimizer, SplitOptimizer):
                optimizer.shutdown()
        if self.engine is not None:
            # To the host: putting every offloaded block on the device at once could run out of memory, and
            # Strategy.teardown moves the module to the CPU anyway.
            self.engine.detach("cpu")
            self.engine = None
        super().teardown()


def _blocks_prefix(module: nn.Module, holder: nn.Module) -> str:
    for name, candidate in module.named_modules():
        if candidate is holder:
            return f"{name}.blocks." if name else "blocks."
    raise ValueError("the block sequence is not part of the LightningModule")
