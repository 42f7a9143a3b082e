"""One optimizer to Lightning, two places to step: the device for resident parameters, the host for offloaded ones.

``SplitOptimizer`` shows the user's groups in their order, each offloaded parameter replaced by its host master;
underneath, one optimizer of the same class per side (one per offloaded block on the host) steps with the groups'
settings. Its state dict is in that canonical order, so a checkpoint loads under another offload plan, or none.

With ``host_step="delayed"`` (DeepSpeed's delayed parameter update) the host update of step t's gradients is
submitted at the end of step t and runs on a host thread while the device computes step t+1; it is published to the
model (``BlockStreamer.publish``) at the end of step t+1, so step t+2 computes with it. The thread owns a block's
masters, gradient buffers and host optimizer from submission until it completes: the block streamer waits for it
before writing that block's next gradients, and every update is complete when a backward ends (clipping and loss
scaling then read the new gradients, as without the delay). A checkpoint stores the model as it computes and the
pending update in the optimizer state (``delayed_params``), so a resumed run continues exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from ..sharing import optimizer_constructor_kwargs
from .accounting import local_bytes
from .offload import BlockStreamer
from .optimizers import optimizer_state_to, regrouped

# Group keys that choose an implementation rather than a hyperparameter: never copied between sides.
_IMPLEMENTATION_FLAGS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes this rank holds of an optimizer's per-parameter state tensors (local shards; scalar steps left out)."""
    if optimizer is None:
        return 0
    return sum(local_bytes(v) for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def device_optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Optimizer-state bytes on the device: only the device side of a :class:`SplitOptimizer`."""
    if isinstance(optimizer, SplitOptimizer):
        optimizer = optimizer.device_optimizer
    return optimizer_state_bytes(optimizer)


def host_step_overlap_allowed(overlap_host_step: bool | str, device: torch.device, module: L.LightningModule,
                              precision_plugin: Any) -> bool:
    """Whether offloaded blocks' host steps may run during backward (:meth:`SplitOptimizer.submit_host_step`): where
    wanted ("auto": with an accelerator; on a CPU the host step competes with the backward for its cores) and where
    nothing between backward and step can be skipped (clipping, a gradient scaler, accumulation, a custom step)."""
    trainer = module.trainer
    wanted = device.type != "cpu" if overlap_host_step == "auto" else overlap_host_step
    return (wanted and module.automatic_optimization and not trainer.gradient_clip_val
            and trainer.accumulate_grad_batches == 1 and getattr(precision_plugin, "scaler", None) is None
            and not is_overridden("configure_gradient_clipping", module, L.LightningModule)
            and not is_overridden("optimizer_step", module, L.LightningModule))


class SplitOptimizer(torch.optim.Optimizer):
    """The user's optimizer, split between the device and one host optimizer per offloaded block (module docs)."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: BlockStreamer) -> None:
        self.engine = engine
        self.optimizer_class = type(optimizer)
        offloaded_by_param = {id(p): (index, position) for index, block in engine.blocks.items()
                              for position, p in enumerate(block.params)}
        self._position_of: dict[int, tuple[int, int]] = {}  # id(host master) -> (block, position)
        canonical_groups = []
        # The groups of each side: None for the device, else an offloaded block's index.
        side_groups: dict[int | None, list[dict[str, Any]]] = {side: [] for side in (None, *engine.blocks)}
        for group_index, group in enumerate(optimizer.param_groups):
            settings = {k: v for k, v in group.items() if k != "params"}
            canonical, on_side = [], {side: [] for side in side_groups}
            for param in group["params"]:
                where = offloaded_by_param.get(id(param))
                if where is not None:
                    param = self._master(*where)
                    self._position_of[id(param)] = where
                canonical.append(param)
                on_side[None if where is None else where[0]].append(param)
            canonical_groups.append(settings | {"params": canonical})
            for side, params in on_side.items():
                side_groups[side].append(settings | {"params": params, "_canonical": group_index})
        super().__init__(canonical_groups, optimizer.defaults)
        self._kwargs = optimizer_constructor_kwargs(optimizer)
        self.device_optimizer = self._build(side_groups.pop(None), self._kwargs)
        # The host side uses torch's fused CPU kernel (~5x the foreach one) where the optimizer has one.
        host_kwargs = {k: v for k, v in self._kwargs.items() if k not in _IMPLEMENTATION_FLAGS}
        if "fused" in self._kwargs:
            host_kwargs["fused"] = True
            for groups in side_groups.values():
                for group in groups:
                    group.update({"fused": True, "foreach": None})
        self.host_optimizers = {index: self._build(groups, host_kwargs) for index, groups in side_groups.items()}
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self.delayed = engine.delayed
        self._unpublished: set[int] = set()
        """Delayed host steps: blocks whose update was submitted and is not yet the model's (``publish``)."""
        if self.delayed:
            engine.wait_for_update = self._wait_for_update
        self._initialized = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_initialized", False):
            raise NotImplementedError("P2RStrategy's split optimizer cannot take new parameter groups during "
                                      "training (e.g. fine-tuning callbacks that unfreeze layers)")
        super().add_param_group(param_group)

    def _master(self, index: int, position: int) -> torch.nn.Parameter:
        block = self.engine.blocks[index]
        master = block.host[position]
        if not isinstance(master, torch.nn.Parameter):
            master = torch.nn.Parameter(master, requires_grad=block.params[position].requires_grad)
            block.host[position] = master
        master.grad = block.host_grads[position]
        return master

    def _build(self, groups: list[dict[str, Any]], kwargs: dict[str, Any]) -> torch.optim.Optimizer | None:
        groups = [g for g in groups if g["params"]]
        if not groups:
            return None
        canonical = [g.pop("_canonical") for g in groups]
        optimizer = self.optimizer_class(groups, **kwargs)
        for group, index in zip(optimizer.param_groups, canonical):
            group["_canonical"] = index
        return optimizer

    # -------------------------------------------------------------------------------------------- stepping
    def _inner(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.device_optimizer, *self.host_optimizers.values()) if o is not None]

    def _sync_hyperparameters(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            canonical = self.param_groups[group["_canonical"]]
            group.update({k: v for k, v in canonical.items() if k != "params" and k not in _IMPLEMENTATION_FLAGS})

    def _host_step(self, index: int, received: set[int] | None = None) -> float:
        """Step block ``index``'s host optimizer. ``received``: the positions that got a gradient this step, taken
        on the main thread when the step is delayed (the main thread moves on to the next step meanwhile)."""
        optimizer = self.host_optimizers[index]
        if optimizer is None:
            return 0.0
        start = time.perf_counter()
        # A parameter whose host buffer holds no gradient of this step is skipped, as plain AdamW skips a
        # parameter whose .grad is None (no weight decay, no moment decay, no step count).
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if received is None:
            stale = [p for p in params if not self.engine.received_gradient(*self._position_of[id(p)])]
        else:
            stale = [p for p in params if self._position_of[id(p)][1] not in received]
        if len(stale) == len(params):
            return 0.0
        saved = [(p, p.grad) for p in stale]
        for p in stale:
            p.grad = None
        if not self.delayed:  # a delayed step's settings were taken when it was submitted (the LR has moved since)
            self._sync_hyperparameters(optimizer)
        try:
            optimizer.step()
        finally:
            for p, grad in saved:
                p.grad = grad
            if self.delayed:  # the next step's gradients link them again (the main thread left them alone)
                for p in params:
                    p.grad = None
        self.engine.push_params(index)
        if self.delayed:
            self.engine.stage(index)
        return time.perf_counter() - start

    def _wait_for_update(self, index: int | None) -> None:
        """Delayed host steps: wait for block ``index``'s pending update (every block's for None)."""
        for key in list(self._pending) if index is None else [index]:
            future = self._pending.pop(key, None)
            if future is not None:
                self.engine.stats.host_step_seconds += future.result()

    def _submit_delayed(self) -> None:
        """Publish the updates of the previous step, then submit this step's (their gradients are final: clipped and
        unscaled by now), each with the learning rate and settings of this step."""
        self.flush()
        # Last block first: the next backward needs the last block's gradient buffers first (its offload waits for
        # that block's update), the next forward only reads the published copies.
        for index, optimizer in sorted(self.host_optimizers.items(), reverse=True):
            if optimizer is None:
                continue
            block = self.engine.blocks[index]
            received = {position for position in block.trainable if self.engine.received_gradient(index, position)}
            if not received:
                continue
            self._sync_hyperparameters(optimizer)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2r-host-step")
            self._pending[index] = self._executor.submit(self._host_step, index, received)
            self._unpublished.add(index)

    def flush(self) -> None:
        """Delayed host steps: complete and publish every pending update (the model then has all of them)."""
        self._wait_for_update(None)
        for index in sorted(self._unpublished):
            self.engine.publish(index)
        self._unpublished.clear()

    def submit_host_step(self, index: int) -> None:
        """Start block ``index``'s host step now, while the device is still busy with earlier blocks' backward."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2r-host-step")
        self._pending[index] = self._executor.submit(self._host_step, index)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stats = self.engine.stats
        if self.delayed:
            self._submit_delayed()
        else:
            for index in self.host_optimizers:
                future = self._pending.pop(index, None)
                stats.host_step_seconds += future.result() if future is not None else self._host_step(index)
        if self.device_optimizer is not None:
            start = time.perf_counter()
            self._sync_hyperparameters(self.device_optimizer)
            self.device_optimizer.step()
            if self.device_optimizer.param_groups[0]["params"][0].device.type == "cuda":
                torch.cuda.synchronize()
            stats.device_step_seconds += time.perf_counter() - start
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.delayed and not set_to_none:
            raise ValueError("P2RStrategy(host_step='delayed') needs zero_grad(set_to_none=True), Lightning's default: "
                             "zeroing the host gradient buffers in place would race with the delayed update reading "
                             "them")
        if self.device_optimizer is not None:
            self.device_optimizer.zero_grad(set_to_none=set_to_none)
        # Host gradient buffers are persistent: the next step's first micro-batch overwrites them, and until it
        # does the masters show no gradient (or a zero one), as the plain optimizer's parameters would.
        self.engine.start_accumulation(set_to_none=set_to_none)

    # -------------------------------------------------------------------------------------------- state
    def _canonical_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def state(self) -> dict:  # type: ignore[override]
        return {param: state for optimizer in self._inner() for param, state in optimizer.state.items()}

    @state.setter
    def state(self, value: Any) -> None:
        # torch.optim.Optimizer.__init__ assigns an empty state; the real state lives in the inner optimizers.
        pass

    def state_dict(self) -> dict[str, Any]:
        self._wait_for_update(None)  # a delayed update in flight: its optimizer state and values are complete first
        merged = self.state  # each parameter is in exactly one inner optimizer
        params = self._canonical_params()
        state = {slot: dict(merged[p]) for slot, p in enumerate(params) if merged.get(p)}
        result = {"state": state, "param_groups": regrouped(self.param_groups)}
        if self._unpublished:  # updated values the model does not compute with yet (published after the next step)
            result["delayed_params"] = {slot: p.detach().clone() for slot, p in enumerate(params)
                                        if self._position_of.get(id(p), (None,))[0] in self._unpublished}
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, self.param_groups)):
            raise ValueError("the optimizer state does not match this model's parameter groups")
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        slot_of = {id(p): slot for slot, p in enumerate(self._canonical_params())}
        for optimizer in self._inner():
            slots = [slot_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
            local_state = {i: saved_state[slot] for i, slot in enumerate(slots) if slot in saved_state}
            optimizer.load_state_dict({"state": local_state, "param_groups": regrouped(optimizer.param_groups)})
            self._sync_hyperparameters(optimizer)
        self._load_delayed_params(state_dict.get("delayed_params") or {})

    @torch.no_grad()
    def _load_delayed_params(self, values: dict[Any, torch.Tensor]) -> None:
        """A checkpoint's pending (delayed) update: into the masters, published after the next step as it would have
        been; without a delay here, or on a parameter that is not offloaded now, it reaches the model at once."""
        params = self._canonical_params()
        for slot, value in values.items():
            param = params[int(slot)]
            param.copy_(value.to(param.device))
            where = self._position_of.get(id(param))
            if where is None:
                continue
            if self.delayed:
                self._unpublished.add(where[0])
                self.engine.blocks[where[0]].staged = False  # publish copies the restored masters
            else:
                self.engine.push_params(where[0])

    def shutdown(self) -> None:
        """Complete (and publish) every pending host step, then stop the thread."""
        self.flush()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def to_plain(self, params_by_slot: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """An ordinary optimizer of the original class over ``params_by_slot`` (the module's parameters in
        canonical order), carrying this optimizer's state and hyperparameters."""
        plain = self.optimizer_class(regrouped(self.param_groups, params_by_slot), **self._kwargs)
        plain.load_state_dict(self.state_dict())
        return plain


def detach_to_host(engine: BlockStreamer | None, optimizer: torch.optim.Optimizer,
                   module: nn.Module) -> torch.optim.Optimizer:
    """Put ``module`` and its optimizer wholly in host memory, detached from ``engine`` (not to be used afterwards);
    returns an ordinary optimizer over the module's own parameters, with the full state."""
    if isinstance(optimizer, SplitOptimizer):
        by_master = {id(master): param for block in engine.blocks.values()
                     for master, param in zip(block.host, block.params)}
        slots = [by_master.get(id(p), p) for group in optimizer.param_groups for p in group["params"]]
    release_to_host([optimizer], engine)
    module.to("cpu")
    plain = optimizer.to_plain(slots) if isinstance(optimizer, SplitOptimizer) else optimizer
    optimizer_state_to(plain, torch.device("cpu"))
    return plain


def split_single_optimizer(optimizers: list[torch.optim.Optimizer], engine: BlockStreamer,
                           carry_state_from: torch.optim.Optimizer | None = None) -> SplitOptimizer:
    """The one optimizer in ``optimizers`` split between the device and ``engine``'s offloaded blocks, with the
    state of ``carry_state_from`` (an optimizer over the same slots in canonical order, after delinking) if given."""
    if len(optimizers) != 1:
        raise ValueError(f"P2RStrategy offloading supports one optimizer, got {len(optimizers)}")
    split = SplitOptimizer(optimizers[0], engine)
    if carry_state_from is not None:
        split.load_state_dict(carry_state_from.state_dict())
    return split


def release_to_host(optimizers: list[Any], engine: BlockStreamer | None) -> None:
    """At teardown: stop the split optimizers' host-step threads and give every offloaded parameter its values back
    in host memory (all blocks may not fit on the device; Lightning's teardown moves the module to the CPU anyway).
    ``engine`` must not be used afterwards."""
    for optimizer in optimizers:
        if isinstance(optimizer, SplitOptimizer):
            optimizer.shutdown()
    if engine is not None:
        engine.detach("cpu")
