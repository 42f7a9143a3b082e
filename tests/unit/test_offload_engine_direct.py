"""The block streamer on its own (no Trainer): residency, gradients, byte counts, state-dict hooks.

On a CPU-only machine the engine's "device" is the CPU too: an offloaded parameter is still an empty placeholder
between uses and its values still live in a separate host master, so every residency rule and byte count below is
the one a GPU run follows.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import TINY, run_layered
from torch import nn

from lightning_p2r import M6Config, M6Transformer
from lightning_p2r.protocols import LayeredStages
from lightning_p2r.strategy.offload import BlockStreamer, OffloadStats, StreamerEvents

CPU = torch.device("cpu")
DIM = 8


class MLPBlock(nn.Module):
    """A pre-norm residual block; returns its hidden state alone, first in a tuple, or (wrongly) nothing."""

    def __init__(self, output: str = "tensor") -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.output = output

    def forward(self, x: torch.Tensor) -> object:
        hidden = x + self.fc2(torch.tanh(self.fc1(self.norm(x))))
        if self.output == "tuple":
            return hidden, None
        if self.output == "none":
            return None
        return hidden


class Stack(nn.Module):
    """A block sequence as ``find_block_sequence`` wants it: ``blocks`` and ``layer_to_block``, plus resident
    modules before and after the blocks."""

    def __init__(self, layer_to_block: tuple[int, ...] = (0, 1, 2, 3), output: str = "tensor") -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(MLPBlock(output) for _ in range(max(layer_to_block) + 1))
        self.layer_to_block = list(layer_to_block)
        self.head = nn.Linear(DIM, 1)

    def run_layer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks[self.layer_to_block[layer]](x)
        return out[0] if isinstance(out, tuple) else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in range(len(self.layer_to_block)):
            x = self.run_layer(layer, x)
        return self.head(x).square().mean()

    def stages(self) -> LayeredStages:
        return LayeredStages(embed=lambda batch: (self.embed(batch), None),
                             layer=lambda layer, x, context: (self.run_layer(layer, x), None),
                             head=lambda x, context: (self.head(x).square().mean(), {}),
                             layer_to_block=self.layer_to_block)


class Outer(nn.Module):
    """The block sequence one level down, so state-dict names carry a prefix ("model.blocks.")."""

    def __init__(self, layer_to_block: tuple[int, ...] = (0, 1, 2, 3), output: str = "tensor") -> None:
        super().__init__()
        self.model = Stack(layer_to_block, output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


PREFIX = "model.blocks."


def build(offloaded: tuple[int, ...], layer_to_block: tuple[int, ...] = (0, 1, 2, 3), *, prefetch: int = 1,
          offload_params: bool = True, seed: int = 0) -> tuple[Outer, Outer, BlockStreamer]:
    """(reference without an engine, the same model under an engine, the engine)."""
    torch.manual_seed(seed)
    reference = Outer(layer_to_block)
    model = copy.deepcopy(reference)
    engine = BlockStreamer(model.model, offloaded, CPU, prefetch=prefetch, param_prefix=PREFIX,
                           offload_params=offload_params)
    return reference, model, engine


def batch(seed: int = 1, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(seed))


def block_bytes(model: Outer, index: int) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.blocks[index].parameters())


def storage_size(param: torch.Tensor) -> int:
    return param.untyped_storage().size()


def released(model: Outer, index: int) -> bool:
    return all(storage_size(p) == 0 for p in model.model.blocks[index].parameters())


def gradients(model: nn.Module, engine: BlockStreamer | None = None) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient by state-dict name: the host buffer for an offloaded one, ``.grad`` otherwise."""
    grads = {name: p.grad for name, p in model.named_parameters()}
    if engine is not None:
        for block in engine.blocks.values():
            for name, buffer in zip(block.names, block.host_grads):
                grads[name] = buffer
    return grads


def assert_same_tensors(ours: dict, reference: dict) -> None:
    assert ours.keys() == reference.keys()
    for name, want in reference.items():
        got = ours[name]
        assert (got is None) == (want is None), name
        if want is not None:
            assert torch.equal(got, want), f"{name} differs by {(got - want).abs().max().item()}"


# ------------------------------------------------------------------------------------------------ placement
def test_construction_leaves_empty_placeholders_and_host_masters() -> None:
    reference, model, engine = build(offloaded=(1, 3))
    blocks = model.model.blocks
    kept = {name: p.untyped_storage().data_ptr() for name, p in model.named_parameters()
            if not name.startswith((PREFIX + "1.", PREFIX + "3."))}
    for index in (1, 3):
        assert released(model, index)
        for param, original in zip(blocks[index].parameters(), reference.model.blocks[index].parameters()):
            assert param.shape == original.shape and param.device == CPU  # a placeholder of the right shape
    masters = engine.host_tensors()
    assert set(masters) == {f"{PREFIX}{i}.{n}" for i in (1, 3) for n, _ in blocks[i].named_parameters()}
    assert set(masters) <= set(model.state_dict())
    reference_state = reference.state_dict()
    for name, master in masters.items():
        assert master.device == CPU and storage_size(master) > 0
        assert torch.equal(master, reference_state[name]), name
    # resident blocks and the modules around them keep their own tensors, untouched
    for name, param in model.named_parameters():
        if name in kept:
            assert param.untyped_storage().data_ptr() == kept[name]
            assert torch.equal(param, reference_state[name]), name
    assert engine.stats == OffloadStats()


def test_tied_parameters_of_an_offloaded_block_are_refused() -> None:
    model = Stack()
    model.blocks[2].fc1.weight = model.blocks[0].fc1.weight
    with pytest.raises(ValueError, match="share a parameter"):
        BlockStreamer(model, (2,), CPU)
    model = Stack()
    model.embed.weight = model.blocks[0].fc2.weight  # tied by identity (the shapes never matter to the check)
    with pytest.raises(ValueError, match="outside the blocks"):
        BlockStreamer(model, (0,), CPU)
    BlockStreamer(Stack(), (1, 2), CPU)  # nothing tied: accepted


# ------------------------------------------------------------------------------------- forward and backward
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("offloaded", [(1, 3), (0, 1, 2, 3)])
def test_forward_backward_matches_the_plain_model(offloaded: tuple[int, ...], prefetch: int) -> None:
    reference, model, engine = build(offloaded, prefetch=prefetch)
    x = batch()
    want = reference(x)
    want.backward()

    loss = model(x)
    assert all(released(model, i) for i in offloaded)  # forward let go of every block it fetched
    assert engine.stats.fetches == len(offloaded)
    ready: list[int] = []

    def on_ready(index: int) -> None:
        # called after the block's gradients reached the host: nothing of it is left on the device
        assert released(model, index)
        assert all(p.grad is None for p in model.model.blocks[index].parameters())
        ready.append(index)

    engine.on_block_grads_ready = on_ready
    loss.backward()
    engine.finish_backward()

    assert torch.equal(loss, want)
    assert ready == sorted(offloaded, reverse=True)  # backward order, once each
    assert_same_tensors(gradients(model, engine), gradients(reference))
    assert all(released(model, i) for i in offloaded)
    stats = engine.take_stats()
    param_bytes = sum(block_bytes(reference, i) for i in offloaded)
    assert stats.fetches == 2 * len(offloaded)  # once for forward, once for backward
    assert stats.h2d_bytes == 2 * param_bytes
    assert stats.d2h_bytes == param_bytes  # fp32 gradients of every (trainable) parameter
    assert 1 <= stats.peak_resident_offloaded_blocks <= prefetch + 1
    assert engine.take_stats() == OffloadStats()  # take_stats starts a new record


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_peaks_follow_the_prefetch_window(prefetch: int) -> None:
    """All four (equal) blocks offloaded: ``prefetch + 1`` blocks are on the device at the peak, plus the gradients
    of the block whose backward is running."""
    reference, model, engine = build((0, 1, 2, 3), prefetch=prefetch)
    engine.static_device_bytes = 1000
    model(batch()).backward()
    stats = engine.take_stats()
    per_block = block_bytes(reference, 0)
    assert stats.peak_resident_offloaded_blocks == prefetch + 1
    assert stats.peak_device_model_bytes == 1000 + (prefetch + 2) * per_block


def test_gradient_accumulation_adds_into_host_buffers() -> None:
    reference, model, engine = build((0, 2), prefetch=1)
    for seed in (1, 2):
        reference(batch(seed)).backward()
        model(batch(seed)).backward()
        engine.finish_backward()
    assert_same_tensors(gradients(model, engine), gradients(reference))
    assert engine.take_stats().d2h_bytes == 2 * (block_bytes(reference, 0) + block_bytes(reference, 2))
    assert all(engine.received_gradient(0, position) for position in range(6))

    # a new optimizer step: the first micro-batch overwrites the buffers instead of adding
    engine.start_accumulation()
    assert not any(engine.received_gradient(0, position) for position in range(6))
    reference.zero_grad()
    model.zero_grad()  # the resident parameters' gradients are the optimizer's to clear
    reference(batch(3)).backward()
    model(batch(3)).backward()
    assert_same_tensors(gradients(model, engine), gradients(reference))


def test_a_first_gradient_after_zero_grad_without_none_starts_from_zero() -> None:
    """zero_grad(set_to_none=False) before a parameter's first gradient ever: the host buffer is made then, and the
    gradient adds into it, so it must be made as zeros (an uninitialized buffer would add into garbage)."""
    reference, model, engine = build((0, 2), prefetch=1)
    engine.start_accumulation(set_to_none=False)
    torch.full((1 << 20,), 7.0).sum()  # leave freed memory behind that an uninitialized buffer could reuse
    reference(batch(1)).backward()
    model(batch(1)).backward()
    engine.finish_backward()
    assert_same_tensors(gradients(model, engine), gradients(reference))


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_block_shared_by_layers_offloads_its_gradient_once_after_all_uses(prefetch: int) -> None:
    reference, model, engine = build((0, 1), layer_to_block=(0, 0, 1, 1), prefetch=prefetch)
    ready: list[int] = []
    engine.on_block_grads_ready = ready.append
    x = batch()
    loss = model(x)
    assert released(model, 0) and released(model, 1)
    loss.backward()
    want = reference(x)
    want.backward()
    assert torch.equal(loss, want)
    assert ready == [1, 0]
    assert_same_tensors(gradients(model, engine), gradients(reference))
    stats = engine.take_stats()
    param_bytes = block_bytes(reference, 0) + block_bytes(reference, 1)
    # consecutive layers of one block reuse it: each block comes in once per direction
    assert stats.fetches == 4 and stats.h2d_bytes == 2 * param_bytes
    assert stats.d2h_bytes == param_bytes
    assert stats.peak_resident_offloaded_blocks == prefetch + 1


def test_zero_offload_style_keeps_parameters_resident_and_gradients_on_the_host() -> None:
    reference, model, engine = build((1, 3), offload_params=False)
    masters = engine.host_tensors()
    for name, param in model.named_parameters():
        assert storage_size(param) > 0
        if name in masters:
            assert torch.equal(param, masters[name])
            assert param.untyped_storage().data_ptr() != masters[name].untyped_storage().data_ptr()
    x = batch()
    model(x).backward()
    reference(x).backward()
    assert_same_tensors(gradients(model, engine), gradients(reference))
    assert all(model.get_parameter(name).grad is None for name in masters)  # moved to the host buffers
    stats = engine.take_stats()
    assert stats.fetches == 0 and stats.h2d_bytes == 0
    assert stats.d2h_bytes == block_bytes(reference, 1) + block_bytes(reference, 3)

    # after a host step, push_params refreshes the resident copy from the master
    with torch.no_grad():
        for name in masters:
            masters[name].add_(1.0)
    engine.push_params(1)
    for name, master in masters.items():
        param = model.get_parameter(name)
        assert torch.equal(param, master) == name.startswith(PREFIX + "1.")
    assert engine.take_stats().h2d_bytes == block_bytes(reference, 1)


def test_m6_transformer_with_shared_moe_blocks_matches_the_plain_model() -> None:
    config = TINY | {"num_layers": 4, "num_unique_blocks": 2, "init_seed": 5}
    reference = M6Transformer(M6Config(**config))
    model = copy.deepcopy(reference)
    engine = BlockStreamer(model, (0, 1), CPU, prefetch=1, param_prefix="blocks.")
    tokens = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_of(transformer: M6Transformer) -> torch.Tensor:
        out = transformer(tokens)
        ce = nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        return ce + 0.01 * out.aux_loss + 0.001 * out.z_loss

    want = loss_of(reference)
    want.backward()
    loss = loss_of(model)
    loss.backward()
    engine.finish_backward()
    assert torch.equal(loss, want)
    assert_same_tensors(gradients(model, engine), gradients(reference))
    assert all(storage_size(p) == 0 for p in model.blocks.parameters())
    stats = engine.take_stats()
    assert stats.fetches == 4 and stats.peak_resident_offloaded_blocks <= 2


def test_blocks_called_out_of_layer_order_or_without_a_hidden_state_are_refused() -> None:
    _, model, engine = build((1,))
    # Named by block and call, with what the holder's forward must do (not only "out of order").
    with pytest.raises(RuntimeError, match=r"block 2 ran as call 1, where layer_to_block \[0, .*\] runs block 0\. "
                                           r"\w+\.forward must run the blocks, once each, in order"):
        model.model.blocks[2](torch.zeros(1, DIM))
    torch.manual_seed(0)
    silent = Outer(output="none")
    BlockStreamer(silent.model, (1,), CPU)
    with pytest.raises(TypeError, match="hidden state"):
        silent(batch())


def test_tuple_outputs_and_a_no_grad_forward() -> None:
    torch.manual_seed(0)
    reference = Outer(output="tuple")
    model = copy.deepcopy(reference)
    engine = BlockStreamer(model.model, (0, 2), CPU, prefetch=0, param_prefix=PREFIX)
    x = batch()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert released(model, 0) and released(model, 2)
    assert engine.take_stats().fetches == 2  # evaluation streams each block in once, and nothing for backward
    model(x).backward()
    reference(x).backward()
    assert_same_tensors(gradients(model, engine), gradients(reference))


# ------------------------------------------------------------------------------------------ detach, state dict
def test_detach_restores_ordinary_parameters_with_the_masters_values() -> None:
    reference, model, engine = build((0, 2))
    model(batch()).backward()
    masters = engine.host_tensors()
    with torch.no_grad():  # as a host optimizer step would
        for name, master in masters.items():
            master.mul_(0.5)
            reference.get_parameter(name).mul_(0.5)
    engine.take_stats()
    engine.detach(CPU)
    assert engine.blocks == {} and engine.host_tensors() == {}
    for name in masters:
        param = model.get_parameter(name)
        assert storage_size(param) > 0 and param.grad is None
        assert torch.equal(param, reference.get_parameter(name))
    # the hooks are gone: a forward fetches nothing and gradients stay on the parameters
    reference.zero_grad()
    model.zero_grad()
    x = batch(2)
    loss = model(x)
    loss.backward()
    want = reference(x)
    want.backward()
    assert torch.equal(loss, want)
    assert engine.take_stats() == OffloadStats()
    assert_same_tensors(gradients(model), gradients(reference))


@pytest.mark.parametrize("offload_params", [True, False])
def test_module_state_dict_reads_the_host_masters(offload_params: bool) -> None:
    reference, model, engine = build((1, 3), offload_params=offload_params)
    with torch.no_grad():  # masters moved on (a host step) while the module's placeholders stayed empty
        for name, master in engine.host_tensors().items():
            master.add_(0.25)
            reference.get_parameter(name).add_(0.25)
    state = model.state_dict()
    assert_same_tensors(state, reference.state_dict())
    assert all(storage_size(tensor) > 0 for tensor in state.values())
    assert engine.stats.fetches == 0  # read from the masters, nothing streamed in
    if offload_params:
        assert released(model, 1) and released(model, 3)
    # the block's own state dict (no prefix) goes through the same hook
    block_state = model.model.blocks[3].state_dict()
    assert torch.equal(block_state["fc1.weight"], reference.model.blocks[3].fc1.weight)


@pytest.mark.parametrize("offload_params", [True, False])
def test_module_load_state_dict_writes_into_the_host_masters(offload_params: bool) -> None:
    _, model, engine = build((1, 3), offload_params=offload_params)
    torch.manual_seed(7)
    other = Outer()
    incompatible = model.load_state_dict(other.state_dict())
    assert not incompatible.missing_keys and not incompatible.unexpected_keys
    for name, master in engine.host_tensors().items():
        assert torch.equal(master, other.get_parameter(name)), name
    if offload_params:
        assert released(model, 1) and released(model, 3)  # only held on the device while being written
    else:
        for name in engine.host_tensors():
            assert torch.equal(model.get_parameter(name), other.get_parameter(name))
    assert_same_tensors(model.state_dict(), other.state_dict())
    x = batch()
    assert torch.equal(model(x), other(x))
    # a block loaded on its own, without a prefix
    torch.manual_seed(8)
    replacement = MLPBlock()
    model.model.blocks[1].load_state_dict(replacement.state_dict())
    assert torch.equal(engine.host_tensors()[PREFIX + "1.fc2.bias"], replacement.fc2.bias)


# ------------------------------------------------------------------------------------------ manual (layered)
class RecordingEvents(StreamerEvents):
    """StreamerEvents that checks, at every event, where the block's parameters and gradients are."""

    def __init__(self, engine: BlockStreamer, model: Outer) -> None:
        super().__init__(engine)
        self.model = model
        self.log: list[tuple[str, int]] = []

    def params(self, block: int) -> list[nn.Parameter]:
        return list(self.model.model.blocks[block].parameters())

    def after_forward(self, block: int) -> None:
        assert all(storage_size(p) > 0 for p in self.params(block))  # fetched by before_forward
        super().after_forward(block)
        assert released(self.model, block)
        self.log.append(("forward", block))

    def before_backward(self, block: int) -> None:
        super().before_backward(block)
        assert all(storage_size(p) > 0 for p in self.params(block))
        assert self.engine.blocks[block].in_backward

    def after_backward(self, block: int) -> None:
        # manual mode: the gradients of every micro-batch stay on the device until the block is flushed
        assert self.engine.manual
        assert all(p.grad is not None for p in self.params(block))
        super().after_backward(block)
        assert all(p.grad is None for p in self.params(block))
        assert released(self.model, block)
        self.log.append(("backward", block))


def test_engine_events_stream_each_block_once_per_direction_for_all_micro_batches() -> None:
    reference, model, engine = build((0, 1, 2, 3), prefetch=1)
    micro = list(batch(rows=6).split(2))
    want = run_layered(reference.model.stages(), micro)
    events = RecordingEvents(engine, model)
    with events as entered:
        assert entered is events and engine.manual
        result = run_layered(model.model.stages(), micro, events)
    assert not engine.manual
    assert torch.equal(result.loss, want.loss)
    assert_same_tensors(gradients(model, engine), gradients(reference))
    assert events.log == [("forward", i) for i in range(4)] + [("backward", i) for i in reversed(range(4))]
    stats = engine.take_stats()
    param_bytes = sum(block_bytes(reference, i) for i in range(4))
    assert stats.fetches == 8 and stats.h2d_bytes == 2 * param_bytes  # not once per micro-batch
    assert stats.d2h_bytes == param_bytes
    assert stats.peak_resident_offloaded_blocks == 2  # the next block comes in while a layer runs (prefetch 1)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_engine_events_prefetch_the_next_blocks_of_each_pass(prefetch: int) -> None:
    """While a layer runs its micro-batches, the next ``prefetch`` offloaded blocks of the pass are already asked
    for (without waiting), up the layers in forward and down them in backward; results are unchanged."""
    reference, model, engine = build((0, 1, 2, 3), prefetch=prefetch)
    micro = list(batch(rows=6).split(2))
    want = run_layered(reference.model.stages(), micro)
    calls: list[tuple[int, bool]] = []
    fetch = engine.fetch

    def recording_fetch(index: int, wait: bool) -> None:
        calls.append((index, wait))
        fetch(index, wait)

    engine.fetch = recording_fetch
    with StreamerEvents(engine) as events:
        result = run_layered(model.model.stages(), micro, events)
    assert torch.equal(result.loss, want.loss)
    assert_same_tensors(gradients(model, engine), gradients(reference))
    forward = [(i, True) for i in range(4)]
    asked_early = [call for call in calls if not call[1]]
    expected = [(j, False) for i in range(4) for j in range(i + 1, min(4, i + 1 + prefetch))]
    expected += [(j, False) for i in reversed(range(4)) for j in range(i - 1, max(-1, i - 1 - prefetch), -1)]
    assert asked_early == expected
    assert [call for call in calls if call[1]][:4] == forward
    assert engine.take_stats().peak_resident_offloaded_blocks == prefetch + 1


def test_engine_events_ignore_resident_blocks() -> None:
    # No prefetch: with it, the layer before block 2 would rightly ask for block 2 ahead of its forward.
    reference, model, engine = build((2,), prefetch=0)
    events = StreamerEvents(engine)
    with events:
        for index in (0, 1, 3):
            events.before_forward(index)
            events.after_forward(index)
            events.before_backward(index)
            events.after_backward(index)
    assert engine.stats.fetches == 0
    assert_same_tensors(model.state_dict(), reference.state_dict())


def test_engine_events_signal_a_shared_block_once_after_all_its_layers() -> None:
    reference, model, engine = build((0, 1), layer_to_block=(0, 0, 1, 1))
    ready: list[int] = []
    engine.on_block_grads_ready = ready.append
    micro = list(batch(rows=4).split(2))
    run_layered(reference.model.stages(), micro)
    with StreamerEvents(engine) as events:
        run_layered(model.model.stages(), micro, events)
    # The shared block's gradient is summed on the device over all its layers and goes to the host once, after
    # its last layer (the host step the strategy starts from this callback must never see a partial sum).
    assert_same_tensors(gradients(model, engine), gradients(reference))
    assert ready == [1, 0]
