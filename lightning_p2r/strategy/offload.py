"""The block streamer of granular offloading (docs/offload.md): offloaded blocks live in host memory (a master
per parameter, and a gradient buffer) and visit the device while they run. Block hooks fetch a block (prefetching the
next ones) and release it; a hook on its output brings it back in backward, and its accumulated gradients go to the
host. Parameters are swapped by resizing their storage, as FSDP does: autograd's saved tensors share it and see the
restored values, and version counters stay untouched because the copy goes through ``param.data``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import partial

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .layered import BlockEvents
from .ties import check_offloaded_blocks_untied


@dataclass
class OffloadStats:
    """What the engine did during one optimizer step (all micro-batches of it)."""

    h2d_bytes: int = 0  # parameter bytes copied host -> device
    d2h_bytes: int = 0  # gradient bytes copied device -> host
    copy_wait_seconds: float = 0.0  # time the compute waited for copies (on CPU: the synchronous copy time)
    host_step_seconds: float = 0.0  # optimizer step on the host (offloaded blocks)
    device_step_seconds: float = 0.0  # optimizer step on the device (everything else)
    peak_resident_offloaded_blocks: int = 0
    peak_device_model_bytes: int = 0  # resident parameters, gradients and optimizer states
    fetches: int = 0  # host -> device block copies

    def as_metrics(self, prefix: str = "offload/") -> dict[str, float]:
        return {prefix + f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass
class _OffloadedBlock:
    index: int
    names: list[str]
    params: list[nn.Parameter]
    host: list[torch.Tensor]
    host_grads: list[torch.Tensor | None]  # made by the first gradient: setup holds only the parameters
    trainable: frozenset[int]  # positions of the parameters that take gradients (frozen ones only stream in)
    param_bytes: int
    resident: bool = False
    in_backward: bool = False
    grads_received: set[int] = field(default_factory=set)
    unwritten: set[int] = field(default_factory=set)  # host gradient buffers still holding an earlier step's
    ready_event: object | None = None
    copied_event: object | None = None
    """The copy stream's event after the block's last fetch: ``publish`` waits for it before overwriting the source
    that an asynchronous copy may still be reading (the host runs ahead of the device)."""
    reload_release: bool = False  # load_state_dict holds the block on the device only to write into it
    published: list[torch.Tensor] | None = None
    """Delayed host steps with streamed parameters: the values the model computes with (fetched from here), while the
    host step updates ``host`` in place; ``BlockStreamer.publish`` makes the update the model's (None: ``host`` is
    both)."""
    staging: list[torch.Tensor] | None = None
    """Delayed host steps: where the host-step thread copies the masters right after updating them
    (``BlockStreamer.stage``), so that ``publish`` on the main thread swaps buffers instead of copying them."""
    staged: bool = False

    @property
    def source(self) -> list[torch.Tensor]:
        """Where fetches copy the parameters from."""
        return self.published if self.published is not None else self.host


def _hidden_state(output: object) -> torch.Tensor | None:
    """The tensor a block hands to the next layer: the output, or the first item of a sequence, dict or dataclass."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output:
        first = output[0]
    elif isinstance(output, dict) and output:
        first = next(iter(output.values()))
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        first = getattr(output, dataclasses.fields(output)[0].name)
    else:
        return None
    return first if isinstance(first, torch.Tensor) else None


def out_of_order_message(holder: nn.Module, block: nn.Module, layer: int) -> str:
    """Why an offloaded model cannot run ``block`` as call ``layer`` since ``holder``'s forward last started."""
    name, layers = type(holder).__name__, list(holder.layer_to_block)
    ran = next((f"block {i}" for i, candidate in enumerate(holder.blocks) if candidate is block), "a block")
    if layer < len(layers):
        what = f"{ran} ran as call {layer + 1}, where layer_to_block {layers} runs block {layers[layer]}"
    else:
        what = f"{ran} ran as call {layer + 1}, past the {len(layers)} layers of layer_to_block"
    return (f"P2RStrategy offloading streams the blocks in the order {name}.forward (the block holder) runs them, "
            f"counted from its start: {what}. {name}.forward must run the blocks, once each, in order: a "
            "training_step or validation_step that calls the blocks without it, or activation checkpointing that "
            "re-runs a block, does not (declare the blocks on the module whose forward runs them: "
            "P2RStrategy(blocks=...) or block_holder())")


class BlockStreamer:
    """Streams the offloaded blocks of a block sequence (see the module docstring)."""

    def __init__(self, holder: nn.Module, offloaded: tuple[int, ...], device: torch.device, *, prefetch: int = 1,
                 pin_memory: bool = False, param_prefix: str = "", block_prefixes: dict[int, str] | None = None,
                 offload_params: bool = True, delayed: bool = False) -> None:
        self.holder = holder
        self.offload_params = offload_params
        self.delayed = delayed
        """Host steps are delayed (``host_step="delayed"``): the model computes with the published values, and the split
        optimizer publishes each block's update one step after its gradients (``publish``)."""
        self.wait_for_update: Callable[[int | None], None] | None = None
        """Delayed host steps: wait until block i's pending update (all blocks' for None) no longer reads its
        gradient buffers, before they are written or read again (the split optimizer sets it)."""
        self.device = device
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self.stats = OffloadStats()
        self.static_device_bytes = 0
        self.on_block_grads_ready: Callable[[int], None] | None = None
        self._handles: list[RemovableHandle] = []
        self._layer = 0
        self._grad_bytes_on_device = 0
        self._grad_landing: dict[torch.dtype, torch.Tensor] = {}  # see _on_host
        # Layered accumulation drives the blocks itself (StreamerEvents): the per-call hooks stand aside and
        # gradients stay on the device until the executor flushes them, once per block per step.
        self.manual = False
        is_cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if is_cuda else None
        self._compute_stream = torch.cuda.current_stream(device) if is_cuda else None
        # Release events of streamed blocks: the host waits on old ones before allocating more (see fetch).
        self._releases: deque = deque()
        check_offloaded_blocks_untied(holder, offloaded)  # before any parameter moves
        # Host masters are named as the module's state dict names them: ``block_prefixes`` (each block's own name),
        # else the list's ``param_prefix`` and the block's index.
        prefixes = block_prefixes or {}
        self.blocks = {index: self._offload(index, prefixes.get(index, f"{param_prefix}{index}."))
                       for index in offloaded}
        # Running totals for the telemetry, kept by fetch and release (the peak is checked on every hook).
        self._streamed_blocks = 0
        self._resident_param_bytes = 0 if offload_params else sum(b.param_bytes for b in self.blocks.values())
        self._install_hooks()

    # ------------------------------------------------------------------------------------------ placement
    def _offload(self, index: int, block_prefix: str) -> _OffloadedBlock:
        block = self.holder.blocks[index]
        names, params, host = [], [], []
        for name, param in block.named_parameters():
            master = param.detach()
            if master.device.type != "cpu" or not self.offload_params:
                master = master.to("cpu", copy=True)
            # else: the parameter already lives in host memory (built there, or on a CPU-only machine) and its
            # storage is about to be replaced by a placeholder, so it becomes the master as it is (no second copy).
            if self.pin_memory:
                master = master.pin_memory()
            if self.offload_params:
                placeholder = torch.empty(param.shape, dtype=param.dtype, device=self.device)
                placeholder.untyped_storage().resize_(0)
                param.data = placeholder
            else:  # ZeRO-Offload style: parameters stay on the device, gradients and optimizer go to the host
                param.data = param.data.to(self.device)
            names.append(f"{block_prefix}{name}")
            params.append(param)
            host.append(master)
        param_bytes = sum(h.numel() * h.element_size() for h in host)
        trainable = frozenset(position for position, param in enumerate(params) if param.requires_grad)
        # Delayed host steps update the masters while the device runs the next step: fetches read a second copy.
        published = staging = None
        if self.delayed and self.offload_params:
            published, staging = ([h.clone().pin_memory() if self.pin_memory else h.clone() for h in host]
                                  for _ in range(2))
        return _OffloadedBlock(index, names, params, host, [None] * len(host), trainable, param_bytes,
                               resident=not self.offload_params, unwritten=set(trainable), published=published,
                               staging=staging)

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """Host master of every offloaded parameter, by its name in the LightningModule's state dict."""
        return {name: tensor for b in self.blocks.values() for name, tensor in zip(b.names, b.host)}

    def detach(self, device: torch.device | str) -> None:
        """Remove the hooks and give every offloaded parameter its values back as an ordinary tensor on ``device``."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for block in self.blocks.values():
            for param, master in zip(block.params, block.host):
                param.data = master.detach().to(device, copy=True)
                param.grad = None
        self.blocks.clear()

    # ---------------------------------------------------------------------------------------------- hooks
    def _install_hooks(self) -> None:
        self._handles.append(self.holder.register_forward_pre_hook(self._start_forward))
        if self.blocks and self.offload_params:
            # Every block counts layers (a block does not know which layer is calling it); offloaded ones move.
            for block in self.holder.blocks:
                self._handles.append(block.register_forward_pre_hook(self._before_block))
                self._handles.append(block.register_forward_hook(self._after_block))
        for index, block in self.blocks.items():
            for position in block.trainable:
                self._handles.append(block.params[position].register_post_accumulate_grad_hook(
                    partial(self._on_grad, index, position)))
            # The module's own state dict must never read or write an empty placeholder (that is a segfault,
            # not an error): the host master is the value, whoever asks for it.
            module = self.holder.blocks[index]
            self._handles.append(module.register_state_dict_post_hook(partial(self._save_masters, index)))
            self._handles.append(module.register_load_state_dict_pre_hook(partial(self._load_masters, index)))
            self._handles.append(module.register_load_state_dict_post_hook(partial(self._after_load, index)))

    def _local_names(self, index: int) -> list[str]:
        return [name for name, _ in self.holder.blocks[index].named_parameters()]

    def _save_masters(self, index: int, module: nn.Module, state: dict, prefix: str, local_metadata: object) -> None:
        # The model's values are what it computes with: under delayed host steps the published copy (streamed) or
        # the device parameters (resident); a pending update is the optimizer's (``SplitOptimizer.state_dict``).
        block = self.blocks[index]
        values = block.source if self.offload_params else (block.params if self.delayed else block.host)
        for name, value in zip(self._local_names(index), values):
            if prefix + name in state:
                state[prefix + name] = value.detach()

    def _load_masters(self, index: int, module: nn.Module, state: dict, prefix: str, *args: object) -> None:
        block = self.blocks[index]
        with torch.no_grad():
            for position, name in enumerate(self._local_names(index)):
                if prefix + name in state:
                    block.host[position].copy_(state[prefix + name])
                    if block.published is not None:
                        block.published[position].copy_(state[prefix + name])
        block.staged = False  # a staged update predates these values
        # The module then copies the same values into its parameters: give them storage to land in.
        block.reload_release = not block.resident
        self.fetch(index, wait=True)

    def _after_load(self, index: int, module: nn.Module, incompatible_keys: object) -> None:
        block = self.blocks[index]
        if block.reload_release:
            block.reload_release = False
            self.release(index)

    def _start_forward(self, module: nn.Module, args: object) -> None:
        self._layer = 0

    def _upcoming(self, layer: int, step: int) -> list[int]:
        """The next ``prefetch`` distinct offloaded blocks after ``layer`` in direction ``step`` (+1 or -1)."""
        found: list[int] = []
        current = self.holder.layer_to_block[layer]
        position = layer + step
        while 0 <= position < len(self.holder.layer_to_block) and len(found) < self.prefetch:
            index = self.holder.layer_to_block[position]
            if index in self.blocks and index != current and index not in found:
                found.append(index)
            position += step
        return found

    def _before_block(self, block: nn.Module, args: object) -> None:
        if self.manual:
            return
        layer = self._layer
        index = self.holder.layer_to_block[layer] if layer < len(self.holder.layer_to_block) else None
        if index is None or self.holder.blocks[index] is not block:
            raise RuntimeError(out_of_order_message(self.holder, block, layer))
        self._layer += 1
        if index in self.blocks:
            self.fetch(index, wait=True)
        for upcoming in self._upcoming(layer, +1):
            self.fetch(upcoming, wait=False)

    def _after_block(self, block: nn.Module, args: object, output: object) -> None:
        if self.manual:
            return
        layer = self._layer - 1
        index = self.holder.layer_to_block[layer]
        if torch.is_grad_enabled():
            hidden = _hidden_state(output)
            if hidden is None:
                raise TypeError(
                    f"P2RStrategy offloading needs each block to return its hidden state as a tensor, or first in a "
                    f"tuple, list, dict or dataclass; got {type(output).__name__}")
            if hidden.requires_grad:
                # The block comes back when backward reaches its output. Other outputs (router losses) may only
                # depend on the block's parameters through paths that also feed the hidden state (a router's losses do).
                hidden.register_hook(partial(self._before_block_backward, layer))
        last = layer + 1 == len(self.holder.layer_to_block) or self.holder.layer_to_block[layer + 1] != index
        if last and index in self.blocks:  # the block's last layer in a row
            self.release(index)

    def _before_block_backward(self, layer: int, grad: torch.Tensor) -> None:
        index = self.holder.layer_to_block[layer]
        if index in self.blocks:
            self.blocks[index].in_backward = True
            self.fetch(index, wait=True)
        for upcoming in self._upcoming(layer, -1):
            self.fetch(upcoming, wait=False)

    def _on_grad(self, index: int, position: int, param: nn.Parameter) -> None:
        block = self.blocks[index]
        if position not in block.grads_received:  # accumulated in place after the first micro-batch
            self._grad_bytes_on_device += param.grad.numel() * param.grad.element_size()
        self._track_peak()
        block.grads_received.add(position)
        if self.manual:
            return
        # Autograd accumulates a leaf's gradient once per backward, after every layer that used it.
        if block.grads_received == block.trainable:
            self._offload_grads(block)

    # -------------------------------------------------------------------------------------- data movement
    def push_params(self, index: int) -> None:
        """After a host step: refresh the device copy of a block whose parameters stay resident."""
        if self.offload_params or self.delayed:
            return  # the next fetch copies the updated host masters in; delayed steps reach the model by ``publish``
        self._copy_masters_to_device(self.blocks[index])

    def _copy_masters_to_device(self, block: _OffloadedBlock) -> None:
        # May run on the host-step thread: name the device and the compute stream explicitly.
        with torch.no_grad(), _on_stream(self._compute_stream):
            for param, master in zip(block.params, block.host):
                param.data.copy_(master, non_blocking=self.pin_memory)
        self.stats.h2d_bytes += block.param_bytes

    def publish(self, index: int) -> None:
        """Delayed host steps, on the main thread once block ``index``'s update is complete: the model computes with it
        from now on (copied into the fetch source, or into the resident device parameters)."""
        block = self.blocks[index]
        if block.published is not None:
            if block.copied_event is not None:  # a fetch may still be reading the values being replaced
                block.copied_event.synchronize()
                block.copied_event = None
            if block.staged:  # the host-step thread copied the update already: swap, no copy on this thread
                block.published, block.staging = block.staging, block.published
                block.staged = False
            else:  # an update that was not staged (one restored from a checkpoint)
                with torch.no_grad():
                    for published, master in zip(block.published, block.host):
                        published.copy_(master)
        elif self.delayed:
            self._copy_masters_to_device(block)

    def stage(self, index: int) -> None:
        """Delayed host steps, on the host-step thread right after block ``index``'s update: copy the masters into the
        block's staging buffers, which ``publish`` later swaps in (the main thread, which drives the device, copies
        nothing). The staging buffers were last read by fetches before the previous ``publish``, which waited for
        them."""
        block = self.blocks[index]
        if block.staging is None:
            return
        with torch.no_grad():
            for staging, master in zip(block.staging, block.host):
                staging.copy_(master)
        block.staged = True

    def fetch(self, index: int, wait: bool) -> None:
        block = self.blocks[index]
        if not block.resident:
            start = time.perf_counter()
            if self._copy_stream is not None:
                # Bound how far the host runs ahead of the GPU: before allocating another block, wait until the
                # block released prefetch + 1 releases ago is really free (FSDP1's limit_all_gathers, per block).
                while len(self._releases) > self.prefetch:
                    self._releases.popleft().synchronize()
            # Allocate on the compute stream, so freed blocks return to the pool that activations use.
            for param, master in zip(block.params, block.host):
                param.data.untyped_storage().resize_(master.numel() * master.element_size())
            if self._copy_stream is not None:
                self._copy_stream.wait_stream(self._compute_stream)
                with torch.cuda.stream(self._copy_stream):
                    for param, master in zip(block.params, block.source):
                        param.data.copy_(master, non_blocking=self.pin_memory)
                        param.data.record_stream(self._copy_stream)
                    block.ready_event = self._copy_stream.record_event()
                    block.copied_event = block.ready_event if block.published is not None else None
            else:
                for param, master in zip(block.params, block.source):
                    param.data.copy_(master)
                self.stats.copy_wait_seconds += time.perf_counter() - start
            block.resident = True
            self._streamed_blocks += 1
            self._resident_param_bytes += block.param_bytes
            self.stats.h2d_bytes += block.param_bytes
            self.stats.fetches += 1
            self._track_peak()
        if wait and block.ready_event is not None:
            start = time.perf_counter()
            self._compute_stream.wait_event(block.ready_event)
            block.ready_event = None
            self.stats.copy_wait_seconds += time.perf_counter() - start

    def release(self, index: int) -> None:
        block = self.blocks[index]
        if not self.offload_params or not block.resident or block.in_backward:
            return
        if block.ready_event is not None:
            self.fetch(index, wait=True)  # never free storage a pending copy still writes to
        for param in block.params:
            param.data.untyped_storage().resize_(0)
        block.resident = False
        self._streamed_blocks -= 1
        self._resident_param_bytes -= block.param_bytes
        if self._compute_stream is not None:
            self._releases.append(self._compute_stream.record_event())

    def _offload_grads(self, block: _OffloadedBlock) -> None:
        if self.wait_for_update is not None:  # a delayed update still reading this block's buffers
            self.wait_for_update(block.index)
        start = time.perf_counter()
        for position, (param, buffer) in enumerate(zip(block.params, block.host_grads)):
            if param.grad is None:
                continue
            master = block.host[position]
            if buffer is None:  # made by the first gradient, as zeros: after zero_grad(set_to_none=False) it adds
                buffer = torch.zeros(master.shape, dtype=master.dtype, device="cpu", pin_memory=self.pin_memory)
                block.host_grads[position] = buffer
            if position in block.unwritten:
                buffer.copy_(param.grad)  # synchronous: the host step reads the buffer right after
                block.unwritten.discard(position)
            else:
                buffer.add_(self._on_host(param.grad))
            if isinstance(master, nn.Parameter):
                master.grad = buffer  # the host optimizer's gradient (zero_grad may have unlinked it)
            size = param.grad.numel() * param.grad.element_size()
            self.stats.d2h_bytes += size
            self._grad_bytes_on_device -= size
            param.grad = None
        block.grads_received.clear()
        block.in_backward = False
        self.stats.copy_wait_seconds += time.perf_counter() - start
        self.release(block.index)
        if self.on_block_grads_ready is not None:
            self.on_block_grads_ready(block.index)

    def _on_host(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` on the host, for adding into its buffer. From a device, through one reused pinned landing buffer
        when pinning: a copy into fresh pageable memory goes through a driver staging buffer and ran 10-15x slower on
        an H100 (1.1 s of a 1.5 s step for 8 offloaded blocks and 2 micro-batches). The copy is synchronous and the
        add follows at once, so one buffer per gradient dtype serves every parameter in turn."""
        if grad.device.type == "cpu":
            return grad
        if not self.pin_memory:
            return grad.to("cpu")
        landing = self._grad_landing.get(grad.dtype)
        if landing is None or landing.numel() < grad.numel():  # sized once, for the largest parameter
            largest = max(p.numel() for block in self.blocks.values() for p in block.params)
            landing = torch.empty(max(largest, grad.numel()), dtype=grad.dtype, device="cpu", pin_memory=True)
            self._grad_landing[grad.dtype] = landing
        view = landing[: grad.numel()].view(grad.shape)
        view.copy_(grad)
        return view

    def flush_grads(self, index: int) -> None:
        """Layered accumulation: the block's gradient of every micro-batch is complete; copy it to the host."""
        block = self.blocks[index]
        if block.grads_received or block.in_backward:
            self._offload_grads(block)

    def finish_backward(self) -> None:
        """After ``backward``: offload what a block left behind (parameters that got no gradient). Delayed updates
        are all complete from here on (clipping and the next updates read the gradient buffers)."""
        if self.wait_for_update is not None:
            self.wait_for_update(None)
        for block in self.blocks.values():
            self.flush_grads(block.index)
            self.release(block.index)

    def start_accumulation(self, set_to_none: bool = True) -> None:
        """A new optimizer step begins (``zero_grad``). ``set_to_none``: the host masters lose their ``.grad`` until a
        gradient of the new step overwrites the buffer, so nothing sees last step's gradient of a parameter that gets
        none now. Otherwise the buffers are zeroed and stay linked, as ``set_to_none=False`` leaves zero gradients."""
        for block in self.blocks.values():
            if set_to_none:
                block.unwritten = set(block.trainable)
                if self.delayed:
                    continue  # a delayed update may be stepping these masters: it unlinks their gradients itself
                for master in block.host:
                    if isinstance(master, nn.Parameter):
                        master.grad = None
            else:
                block.unwritten = set()
                for buffer in block.host_grads:
                    if buffer is not None:
                        buffer.zero_()

    def received_gradient(self, index: int, position: int) -> bool:
        """Whether the parameter's host buffer holds a gradient of the current optimizer step (zeros count, after
        ``start_accumulation(set_to_none=False)``)."""
        block = self.blocks[index]
        return (position in block.trainable and position not in block.unwritten
                and block.host_grads[position] is not None)

    # ------------------------------------------------------------------------------------------ telemetry
    def _track_peak(self) -> None:
        stats = self.stats
        stats.peak_resident_offloaded_blocks = max(stats.peak_resident_offloaded_blocks, self._streamed_blocks)
        current = self.static_device_bytes + self._resident_param_bytes + self._grad_bytes_on_device
        stats.peak_device_model_bytes = max(stats.peak_device_model_bytes, current)

    def take_stats(self) -> OffloadStats:
        """The stats since the last call; starts a new record."""
        self._track_peak()
        stats, self.stats = self.stats, OffloadStats()
        return stats


class StreamerEvents(BlockEvents):
    """Layered accumulation on one process: an offloaded block is copied in once per direction for every micro-batch,
    and its gradient goes to the host once. A block several layers run (a pseudo model) stays on the device from its
    first layer to its last in each direction, and its gradient (a partial sum until then) leaves after the last.
    As on the per-call path, the next ``prefetch`` offloaded blocks in the pass's order are copied in while a layer
    runs all its micro-batches (on an H100 the compute waited 225-546 ms per step for copies without it)."""

    def __init__(self, engine: BlockStreamer) -> None:
        self.engine = engine
        self._uses_left: dict[str, Counter] = {}
        self._next_layer = {"forward": 0, "backward": 0}

    def __enter__(self) -> StreamerEvents:
        # Each block's layers left to run in each direction (the strategy enters once for the forward pass and
        # once for the backward pass of a step; either way the counts start full).
        self.engine.manual = True
        counts = Counter(self.engine.holder.layer_to_block)
        self._uses_left = {"forward": counts, "backward": counts.copy()}
        self._next_layer = {"forward": 0, "backward": len(self.engine.holder.layer_to_block) - 1}
        return self

    def _prefetch(self, direction: str, block: int) -> None:
        """Start copying the blocks after this layer's in the pass's order (forward: up the layers; backward: down)."""
        layer = self._next_layer[direction]
        step = 1 if direction == "forward" else -1
        self._next_layer[direction] += step
        layers = self.engine.holder.layer_to_block
        if not 0 <= layer < len(layers) or layers[layer] != block:
            return  # not the model's layer order (a caller of its own): fetch on demand only
        for upcoming in self.engine._upcoming(layer, step):
            self.engine.fetch(upcoming, wait=False)

    def _last_use(self, direction: str, block: int) -> bool:
        self._uses_left[direction][block] -= 1
        return self._uses_left[direction][block] <= 0

    def __exit__(self, *exc: object) -> None:
        self.engine.manual = False

    def before_forward(self, block: int) -> None:
        if block in self.engine.blocks:
            self.engine.fetch(block, wait=True)
        self._prefetch("forward", block)

    def after_forward(self, block: int) -> None:
        if block in self.engine.blocks and self._last_use("forward", block):
            self.engine.release(block)

    def before_backward(self, block: int) -> None:
        if block in self.engine.blocks:
            self.engine.blocks[block].in_backward = True
            self.engine.fetch(block, wait=True)
        self._prefetch("backward", block)

    def after_backward(self, block: int) -> None:
        if block in self.engine.blocks and self._last_use("backward", block):
            self.engine.flush_grads(block)


def _on_stream(stream: object | None) -> contextlib.AbstractContextManager:
    # torch.cuda.stream(None) is a no-op too, but it initializes CUDA on a machine that has it (a CPU run there).
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
