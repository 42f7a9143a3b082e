"""Which blocks live in host memory (M6-10T's granular offload): the spread, the budget search, the options."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .names import _UNITS, OFFLOAD_STATES


def spread(count: int, num_blocks: int) -> tuple[int, ...]:
    """``count`` block indices spread evenly, the last block always among them when count > 0 (the offload plan).

    With at most half the blocks offloaded, every offloaded block follows a resident one, whose compute hides
    the offloaded block's copy; and the first block stays resident so the forward pass starts without waiting.
    """
    if count <= 0:
        return ()
    return tuple(sorted({int((i + 1) * num_blocks / count) - 1 for i in range(count)}))


def offload_count(fraction: float, num_blocks: int) -> int:
    """How many of ``num_blocks`` an ``offload_fraction`` offloads: half a block rounds up."""
    return math.floor(fraction * num_blocks + 0.5)


def parse_bytes(value: int | str, total: int | None = None, name: str = "device_memory_budget") -> int:
    """``12e9``, ``"12GB"``, ``"512MiB"`` or ``"80%"`` (of ``total``) -> bytes; errors name the option ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be bytes or a size string, got {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    text = value.strip().lower().replace(" ", "")
    if text.endswith("%"):
        if total is None:
            raise ValueError(f"{name} as a percentage needs the device's total memory")
        share = float(text[:-1])
        if not 0 < share <= 100:
            raise ValueError(f"{name} percentage must be in (0, 100], got {value!r}")
        return int(total * share / 100)
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([kmgt]i?b|b)?", text)
    if not match:
        sizes = "bytes, '12GB', '512MiB' or '80%'" if total is not None else "bytes, '12GB' or '512MiB'"
        raise ValueError(f"{name} {value!r} is not a size: use {sizes}")
    if value.strip().endswith("b"):
        # A lowercase b reads as bits to some (12Gb = 1.5 GB) and as bytes to others; cluster files refuse it too.
        number, prefix = match.group(1), value.strip()[len(match.group(1)):-1].strip()
        raise ValueError(f"{name} {value!r} is ambiguous, bits to some readers and bytes to others: write "
                         f"'{number}{prefix[:1].upper()}{prefix[1:]}B' for bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _check_budget(budget: int | float | str) -> None:
    """A budget of more than zero bytes. A plain number below one (``0.5``) is refused naming what was likely meant:
    a number is bytes, so it would read as 0 bytes at setup (a share of the memory is a percentage, a share of the
    blocks ``offload_fraction``). A string's syntax is checked now, a percentage of a large stand-in: its base, the
    device's memory, comes at setup."""
    if isinstance(budget, str):
        size = parse_bytes(budget, total=2**50)  # refuses what is not a size
        try:
            plain: float | None = float(budget)
        except ValueError:  # a size with a unit or a percentage
            plain = None
    else:
        if not math.isfinite(budget):
            raise ValueError(f"P2RStrategy.device_memory_budget must be a finite number of bytes, got {budget!r}")
        size, plain = budget, budget
    if plain is not None and 0 < plain < 1:
        raise ValueError(f"P2RStrategy.device_memory_budget={budget!r} is bytes, less than one: for a share of the "
                         f"device's memory write '{plain * 100:g}%', for a share of the blocks "
                         f"offload_fraction={plain}")
    if size <= 0:
        raise ValueError(f"P2RStrategy.device_memory_budget must be > 0, got {budget!r}")


def check_offload_options(*, offload_fraction: float | None, offload_blocks: Sequence[int] | None,
                          device_memory_budget: int | str | None, offload_states: Sequence[str] | None, prefetch: int,
                          pin_memory: object, overlap_host_step: object, host_step: object = "exact",
                          activation_allowance: object = 0) -> set[str]:
    """Validate ``P2RStrategy``'s offload options; returns the offload states to use (all three by default)."""
    given = [n for n, v in (("offload_fraction", offload_fraction), ("offload_blocks", offload_blocks),
                            ("device_memory_budget", device_memory_budget)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"P2RStrategy takes one of offload_fraction, offload_blocks, device_memory_budget; "
                         f"got {given}")
    if offload_fraction is not None and not 0.0 <= offload_fraction <= 1.0:
        raise ValueError(f"P2RStrategy.offload_fraction must be in [0, 1], got {offload_fraction}")
    if offload_blocks is not None and any(not isinstance(i, int) or i < 0 for i in offload_blocks):
        raise ValueError(f"P2RStrategy.offload_blocks must be block indices >= 0, got {offload_blocks!r}")
    if device_memory_budget is not None:
        _check_budget(device_memory_budget)
    _check_activation_allowance(activation_allowance, budget_given=device_memory_budget is not None)
    states = set(offload_states or OFFLOAD_STATES)
    unknown = states - set(OFFLOAD_STATES)
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
    if host_step not in HOST_STEPS:
        raise ValueError(f"P2RStrategy.host_step must be one of {HOST_STEPS}, got {host_step!r}")
    if host_step == "delayed" and not given:
        raise ValueError("P2RStrategy(host_step='delayed') delays offloaded blocks' host optimizer steps, but nothing "
                         "is offloaded: add offload_fraction, offload_blocks or device_memory_budget")
    return states


def _check_activation_allowance(value: object, *, budget_given: bool) -> None:
    """Bytes (or a size, not a percentage: of what?) that ``device_memory_budget`` keeps for activations; without a
    budget it would be ignored, so it is refused instead."""
    name = "P2RStrategy.activation_allowance"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name} must be bytes or a size string such as '2GB', got {value!r}")
    if isinstance(value, str) and value.strip().endswith("%"):
        raise ValueError(f"{name} is bytes or a size such as '2GB', not a percentage, got {value!r}")
    allowance = parse_bytes(value, name=name)
    if allowance < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    if allowance and not budget_given:
        raise ValueError(f"{name}={value!r} reserves part of device_memory_budget for activations, but no "
                         "device_memory_budget is given: add one, or leave activation_allowance at 0")


HOST_STEPS = ("exact", "delayed")
"""When an offloaded block's host optimizer update reaches the model: "exact" (before the next forward) or "delayed"
(computed during the next step, used from the one after: DeepSpeed's delayed parameter update)."""


def check_delayed_host_step(host_step: str, path: str) -> None:
    """The delayed update belongs to the one-process block streamer, whose split optimizer steps offloaded blocks on
    the host itself; FSDP2's CPU offload steps the host shards inside the optimizer's own step."""
    if host_step == "delayed" and path != "local":
        raise ValueError("P2RStrategy(host_step='delayed') runs on one process with sharding 'none' or 'zero1' (the "
                         "block streamer); FSDP2's CPU offload (zero2/zero3, or several processes) steps the host "
                         "shards inside the optimizer step and cannot delay them: use host_step='exact' there")


@dataclass(frozen=True)
class BlockFootprint:
    """Bytes one block needs while it is resident and trained."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def streaming(self) -> int:
        """What an offloaded block occupies on the device while it runs: parameters and, in backward, gradients."""
        return self.param_bytes + self.grad_bytes


@dataclass(frozen=True)
class OffloadPlan:
    num_blocks: int
    offloaded: tuple[int, ...]

    @property
    def resident(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_blocks) if i not in self.offloaded)


def plan_offload(
    num_blocks: int,
    *,
    offload_fraction: float | None = None,
    offload_blocks: list[int] | None = None,
    budget_bytes: int | None = None,
    footprints: list[BlockFootprint] | None = None,
    other_bytes: int = 0,
    activation_bytes: int = 0,
    prefetch: int = 1,
) -> OffloadPlan:
    """Choose the offloaded blocks from exactly one of fraction, explicit list or budget."""
    given = [name for name, value in (("offload_fraction", offload_fraction), ("offload_blocks", offload_blocks),
                                      ("device_memory_budget", budget_bytes)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one of offload_fraction, offload_blocks, device_memory_budget; got {given}")
    if offload_blocks is not None:
        bad = [i for i in offload_blocks if not 0 <= i < num_blocks]
        if bad:
            raise ValueError(f"offload_blocks {bad} are not block indices of a model with {num_blocks} blocks")
        return OffloadPlan(num_blocks, tuple(sorted(set(offload_blocks))))
    if budget_bytes is not None:
        if footprints is None:
            raise ValueError("a device_memory_budget plan needs the blocks' footprints")
        return plan_for_budget(footprints, budget_bytes, other_bytes, activation_bytes, prefetch)
    fraction = offload_fraction or 0.0
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload_fraction must be in [0, 1], got {fraction}")
    # Half rounds up (Python's round() would send 0.5 of one block to 0 and 0.5 of three blocks to 2).
    return OffloadPlan(num_blocks, spread(offload_count(fraction, num_blocks), num_blocks))


def device_bytes_needed(footprints: list[BlockFootprint], offloaded: tuple[int, ...], other_bytes: int,
                        activation_bytes: int, prefetch: int) -> int:
    """Model-state bytes on the device under a plan (plus the activation allowance)."""
    resident = sum(f.total for i, f in enumerate(footprints) if i not in offloaded)
    largest_streamed = max((footprints[i].streaming for i in offloaded), default=0)
    streaming = min(prefetch + 1, len(offloaded)) * largest_streamed
    return other_bytes + activation_bytes + resident + streaming


def plan_for_budget(footprints: list[BlockFootprint], budget: int, other_bytes: int, activation_bytes: int,
                     prefetch: int) -> OffloadPlan:
    num_blocks = len(footprints)
    # Try the most resident blocks first; for each count, offload an evenly spread set.
    for count in range(num_blocks + 1):
        offloaded = spread(count, num_blocks)
        if device_bytes_needed(footprints, offloaded, other_bytes, activation_bytes, prefetch) <= budget:
            return OffloadPlan(num_blocks, offloaded)
    minimum = device_bytes_needed(footprints, tuple(range(num_blocks)), other_bytes, activation_bytes, prefetch)
    raise ValueError(
        f"device_memory_budget of {budget:,} bytes is smaller than the least this model needs with every block "
        f"offloaded: {minimum:,} bytes (non-block states {other_bytes:,}, activation allowance "
        f"{activation_bytes:,}, streaming buffers for {min(prefetch + 1, num_blocks)} block(s)). Raise the "
        "budget, lower prefetch or the activation allowance, or shard the model"
    )


def check_fsdp_offload_states(offload_states: set[str]) -> None:
    """On FSDP2 an offloaded block keeps its parameter shard in host memory too (``CPUOffloadPolicy`` moves
    parameters, gradients and optimizer states together), so "params" cannot be left out."""
    if "params" not in offload_states:
        raise ValueError(
            "P2RStrategy: with sharding zero2/zero3, or offloading across processes, an offloaded block keeps its "
            "parameter shard in host memory (FSDP2's CPUOffloadPolicy); offload_states must include 'params'")


def pin_memory_for(pin_memory: bool | str, device_type: str) -> bool:
    """Whether host buffers are page-locked: "auto" pins only on CUDA (CPU-only torch cannot pin)."""
    if pin_memory == "auto":
        return device_type == "cuda"
    if pin_memory and device_type == "cpu":
        raise ValueError("P2RStrategy(pin_memory=True) needs an accelerator: CPU-only torch cannot pin memory; "
                         "use pin_memory='auto' or False")
    return bool(pin_memory)


def format_bytes(count: float) -> str:
    """``count`` bytes for a person: "512 B", "1.5 KiB" ... "2.0 TiB" (:func:`parse_bytes` reads them back)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} TiB"


def plan_summary(*, engine: str, sharding: str, world_size: int, plan: OffloadPlan, footprints: list[BlockFootprint],
                 other_bytes: int, prefetch: int, budget: int | None) -> str:
    """The one line P2RStrategy logs at setup: the engine, the layout, which blocks live in host memory, and the
    model-state bytes the plan keeps on each rank's device against the budget (sharded layouts divide them by the
    ranks: FSDP2's shards at rest)."""
    device = device_bytes_needed(footprints, plan.offloaded, other_bytes, 0, prefetch)
    device //= world_size if sharding in ("zero2", "zero3") else 1
    limit = "no budget" if budget is None else f"budget {format_bytes(budget)}"
    return (f"P2RStrategy: engine {engine}, sharding {sharding} on {world_size} process(es), offloaded blocks "
            f"{list(plan.offloaded)} of {plan.num_blocks}, planned device model states {format_bytes(device)} per "
            f"rank ({limit})")
