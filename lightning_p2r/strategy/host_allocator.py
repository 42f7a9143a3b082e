"""Freed host memory kept for reuse: glibc's malloc tuned for training on a CPU.

On a CPU a training step's activations, gradients and collective buffers are host memory, allocated and freed in the
same pattern every step. glibc's defaults give large freed blocks back to the kernel: blocks above its mmap threshold
(which adapts, from 128 KiB up to 32 MiB) are unmapped when freed, and the top of the heap is trimmed once more than
its trim threshold (twice the mmap threshold) is free. The next step maps that memory again, and the kernel faults
in and zeroes every 4 KiB page on first touch. Measured on a 2-vCPU EPYC VM (docs/benchmarks.md, "Freed host memory kept
for reuse"): the quickstart recipe's model (a 4-layer width-128 MoE, 16 sequences of 64 tokens) on one process took
about 8,000 page faults per step with the defaults and 107 ms, against about 20 faults and 97 ms with both thresholds
raised; `calibrate`'s elementwise probe of 32 MB ran at 12 GB/s with the defaults and at 32 GB/s without the faults.

Raising one threshold alone is worse than neither: setting either turns off glibc's adaptation of both, so the
other stays at its 128 KiB default (the trim threshold alone gave 51,000 faults per step on that model). Both are set
together, once per process, through ``mallopt`` (glibc's public tuning call; the environment variables
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` do the same at process start, and torch's CPU launcher,
``python -m torch.backends.xeon.run_cpu``, preloads jemalloc configured never to return memory, for the same
reason). The process then holds its peak heap between steps, which it reaches again every step anyway.

Nothing is changed where the user already chose: a preloaded allocator (``LD_PRELOAD`` naming jemalloc, tcmalloc or
mimalloc), a ``MALLOC_*_`` variable or a ``glibc.malloc`` tunable, or a C library other than glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

HostAllocator = Literal["auto", "retain", "system"]
HOST_ALLOCATORS: tuple[str, ...] = get_args(HostAllocator)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters (glibc's malloc.h)."""

MMAP_THRESHOLD = 32 * 2**20
"""Allocations from this size on are still mapped on their own and given back when freed, as glibc's own adaptive
threshold, whose ceiling on 64-bit Linux this is, makes them at most: only memory below it is kept. A higher threshold
kept FSDP2's gathered buffers as well and raised ZeRO-3's peak: at 256 MiB, two ranks training 8 layers of width 1024
peaked at 2,613 and 3,028 MiB against 1,692 and 1,695 with glibc's defaults, and at 1,702 and 1,842 with this one
(docs/benchmarks.md, "Freed host memory kept for reuse")."""
TRIM_THRESHOLD = 2**31 - 1
"""Free memory at the top of the heap kept rather than trimmed: ``mallopt`` takes an int, this is its largest."""

PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
ALLOCATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


@dataclass(frozen=True)
class AllocatorChoice:
    """What :func:`retain_freed_host_memory` did: ``retained`` True when it raised the thresholds, else the reason."""

    retained: bool
    reason: str


def check_host_allocator(host_allocator: object) -> None:
    """A clear error for a value ``P2RStrategy(host_allocator=...)`` does not take."""
    if host_allocator not in HOST_ALLOCATORS:
        raise ValueError(f"P2RStrategy.host_allocator must be one of {HOST_ALLOCATORS}, got {host_allocator!r}")


def wants_retained(host_allocator: str, device_type: str) -> bool:
    """Whether ``P2RStrategy(host_allocator=...)`` keeps freed host memory in a process training on ``device_type``:
    "retain" always, "system" never, "auto" when the device is the CPU (its activations are host memory; beside an
    accelerator the host's allocations are few and long-lived, and a host short of memory keeps glibc's giving back)."""
    check_host_allocator(host_allocator)
    if host_allocator == "auto":
        return device_type == "cpu"
    return host_allocator == "retain"


def user_choice(environ: Mapping[str, str]) -> str | None:
    """The allocator setting the user already made in ``environ``, in words, or None."""
    preload = environ.get("LD_PRELOAD", "")
    for name in PRELOADED_ALLOCATORS:
        if name in preload:
            return f"LD_PRELOAD loads {name}"
    for name in ALLOCATOR_VARIABLES:
        if name in environ:
            return f"{name} is set"
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    return None


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None


def retain_freed_host_memory(environ: Mapping[str, str] | None = None,
                             mallopt: Callable[[int, int], int] | None = None) -> AllocatorChoice:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring), unless the user chose an
    allocator setting or the C library is not glibc. Calling it again changes nothing more. ``environ`` and
    ``mallopt`` default to the process's own (tests pass theirs)."""
    chosen = user_choice(os.environ if environ is None else environ)
    if chosen is not None:
        return AllocatorChoice(False, f"left as the user set it ({chosen})")
    mallopt = mallopt or _glibc_mallopt()
    if mallopt is None:
        return AllocatorChoice(False, "left as it is (not glibc on Linux)")
    # The mmap threshold first: a glibc that refuses it changes nothing, and glibc accepts the trim threshold always
    # (2.36, the version measured), so the two end up set together or not at all.
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return AllocatorChoice(False, "left as it is (glibc refused the mmap threshold)")
    if not mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return AllocatorChoice(False, f"mmap threshold {MMAP_THRESHOLD // 2**20} MiB set but glibc refused the trim "
                                      "threshold: set MALLOC_TRIM_THRESHOLD_ or host_allocator='system'")
    return AllocatorChoice(True, f"freed host memory kept for reuse (below glibc's mmap threshold, "
                                 f"{MMAP_THRESHOLD // 2**20} MiB; no trimming)")
