"""P2RStrategy(host_allocator=...): a CPU training process's malloc keeps the memory it frees (host_allocator.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest
from helpers import tiny_data, tiny_trainer

from lightning_p2r import M6Config, M6LanguageModel, P2RStrategy
from lightning_p2r.strategy.host_allocator import (
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    MMAP_THRESHOLD,
    TRIM_THRESHOLD,
    retain_freed_host_memory,
    user_choice,
    wants_retained,
)

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


class FakeMallopt:
    """Records ``mallopt`` calls; refuses mmap thresholds above ``largest_mmap``, and the trim threshold on demand."""

    def __init__(self, largest_mmap: int = 2**31, trim_ok: bool = True) -> None:
        self.calls: list[tuple[int, int]] = []
        self.largest_mmap, self.trim_ok = largest_mmap, trim_ok

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        if param == M_MMAP_THRESHOLD:
            return int(value <= self.largest_mmap)
        return int(self.trim_ok)


def test_auto_retains_on_the_cpu_only_and_the_explicit_values_decide() -> None:
    assert wants_retained("auto", "cpu") and not wants_retained("auto", "cuda")
    assert wants_retained("retain", "cuda") and not wants_retained("system", "cpu")
    with pytest.raises(ValueError, match="host_allocator must be one of"):
        wants_retained("jemalloc", "cpu")


def test_a_wrong_value_fails_when_the_strategy_is_built() -> None:
    with pytest.raises(ValueError, match=r"host_allocator must be one of \('auto', 'retain', 'system'\)"):
        P2RStrategy(host_allocator="tcmalloc")


@pytest.mark.parametrize(("environ", "named"), [
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc"),
    ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "tcmalloc"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES"),
])
def test_a_users_own_allocator_setting_is_left_alone(environ: dict[str, str], named: str) -> None:
    mallopt = FakeMallopt()
    choice = retain_freed_host_memory(environ, mallopt)
    assert not choice.retained and named in choice.reason
    assert mallopt.calls == []
    assert user_choice({"LD_PRELOAD": "libasan.so", "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX"}) is None


def test_both_thresholds_are_raised_the_mmap_one_first() -> None:
    mallopt = FakeMallopt()
    choice = retain_freed_host_memory({}, mallopt)
    assert choice.retained
    assert mallopt.calls == [(M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)]


def test_nothing_half_set_when_glibc_refuses_every_mmap_threshold() -> None:
    # Setting the trim threshold alone would turn off glibc's adaptation and leave the mmap threshold at 128 KiB.
    mallopt = FakeMallopt(largest_mmap=0)
    choice = retain_freed_host_memory({}, mallopt)
    assert not choice.retained and "refused" in choice.reason
    assert all(param == M_MMAP_THRESHOLD for param, _ in mallopt.calls)


def test_a_refused_trim_threshold_is_reported() -> None:
    choice = retain_freed_host_memory({}, FakeMallopt(trim_ok=False))
    assert not choice.retained and "trim" in choice.reason


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's; other C libraries are left alone")
def test_a_training_loop_stops_faulting_its_memory_in_again_once_retained() -> None:
    # A fresh interpreter: the test process may have retained already (any CPU fit in it does). The loop is an M6
    # MoE's forward and backward on 16 sequences, whose freed activations glibc's defaults give back every step.
    script = textwrap.dedent("""
        import torch
        from lightning_p2r import M6Config, M6LanguageModel
        from lightning_p2r.measure.memory import minor_faults
        from lightning_p2r.strategy.host_allocator import retain_freed_host_memory

        torch.manual_seed(0)
        config = M6Config(vocab_size=2048, max_seq_len=64, num_layers=2, dim=128, num_heads=4, num_experts=4,
                          capacity_factor=1.25)
        model = M6LanguageModel(config)
        model.configure_model()
        batch = torch.randint(0, 2048, (16, 65))

        def step_faults(steps):
            counts = []
            for _ in range(steps):
                start = minor_faults()
                model.losses(batch)["loss"].backward()
                model.zero_grad(set_to_none=True)
                counts.append(minor_faults() - start)
            return counts

        # glibc's defaults: the first steps after the first fault thousands of pages each (later ones may settle).
        before = sum(step_faults(5)[1:])
        choice = retain_freed_host_memory()
        # Retained: a few steps grow the heap to hold a step, then the median step faults nothing.
        after = sorted(step_faults(12)[6:])[3]
        print(before, after, choice.retained)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    before, after, retained = out.stdout.split()
    assert retained == "True"
    # Measured here: 3,500-9,600 faults in each of those steps with glibc's defaults; 0 once retained and grown.
    assert float(before) > 4000
    assert float(after) < 0.01 * float(before)


def test_a_cpu_fit_retains_and_system_leaves_the_process_alone(tmp_path, monkeypatch) -> None:
    calls: list[str] = []
    import lightning_p2r.strategy.strategy as strategy_module

    def recorded(environ=None, mallopt=None):
        calls.append("retain")
        return retain_freed_host_memory({}, FakeMallopt())

    monkeypatch.setattr(strategy_module, "retain_freed_host_memory", recorded)
    config = M6Config(vocab_size=256, max_seq_len=16, num_layers=2, dim=16, num_heads=2, num_experts=2)
    for choice, expected in (("system", []), ("auto", ["retain"])):
        calls.clear()
        strategy = P2RStrategy(host_allocator=choice)
        trainer = tiny_trainer(tmp_path / choice, max_steps=1, limit_val_batches=0, strategy=strategy)
        trainer.fit(M6LanguageModel(config), datamodule=tiny_data(tmp_path))
        assert calls == expected
        assert (strategy.host_allocator_choice is not None) == (choice == "auto")
