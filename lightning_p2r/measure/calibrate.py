"""``lightning-p2r calibrate``: measure this machine's constants and write them as a cluster file.

    lightning-p2r calibrate --out cluster.yaml [--processes 2] [--threads N] [--quick]
                                   [--probe-rounds R] [--no-fit]

What it measures, each as the median of several timed repetitions after a warm-up:

- ``device_flops``: a linear layer's forward and backward, fp32 (CPU) or bf16 (CUDA), of training-like shapes;
- ``attention_flops``: causal scaled-dot-product attention, forward and backward;
- ``attention_rates``: the same attention's marginal FLOP/s on a grid of sequence lengths and head sizes
  (:func:`attention_rate`), which the planner reads by the model's shape;
- ``memory_bandwidth``: an add of large tensors (three of 64 MiB): plain memory traffic beyond the caches;
- ``elementwise_bandwidth`` / ``elementwise_small_bandwidth``: LayerNorm, GELU and a residual add, forward and
  backward, in the bytes the cost model counts for them, on activations of 32 MiB and of 256 KiB (which a CPU's
  caches hold);
- ``dense_layer_overhead``, ``moe_layer_overhead``, ``moe_expert_overhead``: the package's own transformer at a
  negligible size with 1 and 5 layers, dense and MoE, 2 and 16 experts: a layer's fixed cost (dispatch, autograd,
  Python), which on a CPU is several times its operator count at ``operator_overhead`` (:func:`layer_overheads`);
- ``hf_layer_overheads``: the same for one layer of each Hugging Face family the planner prices, dense and MoE (with
  ``transformers`` installed; :func:`hf_layer_overheads`);
- ``dense_checkpoint_overhead``, ``moe_checkpoint_overhead``, ``moe_expert_checkpoint_overhead``: the same five
  models with each layer checkpointed by the call a pipeline stage with recompute makes: what checkpointing adds to
  each fixed cost (the forward run again, and the saved-tensor hooks on every tensor a layer saves);
- ``dense_token_overhead``, ``moe_token_overhead`` and their ``..._width_overhead``: the same dense and MoE models
  on 16 sequences instead of one, at widths 16 and 64: what a layer's added tokens cost beyond the growth the cost
  model prices, per token, on a line in the width (:func:`token_overheads`);
- ``moe_expert_weight_overhead``: the 16- and 2-expert MoE models at widths 16 and 64: what each expert costs more at
  the wider width beyond the priced difference, per element of its weights (:func:`expert_weight_overhead`);
- ``dropout_element_overhead``: a dropout (p = 0.1) over 1M elements, forward and backward, less a multiply of the
  same, per element; ``attention_dropout_element_overhead``: causal attention with dropout less without, per
  probability (sequences x heads x length squared) (:func:`dropout_overheads`);
- ``operator_overhead``: the fixed cost of one operator in a chain of tiny ones, forward and backward (the
  dispatcher and autograd on CPU, the launch on CUDA);
- ``matmul_overhead``: a linear layer's forward and backward at 16 to 128 rows, fitted to a line in the rows: the
  intercept beyond the launches and weight traffic the cost model prices, per matmul call (efficiency by shape).
  On a CPU the layer is timed at four widths (weights of 16 KiB to 1 MiB) and the intercepts fitted to a line in
  the weight's bytes: its value at no weight, less the launches, is the call's cost, and its slope five passes over
  the weight in the caches (``memory_small_bandwidth``, the rate at which the planner prices a small model's weight
  traffic; :func:`matmul_costs`);
- ``host_device_bandwidth`` / ``host_device_latency``: pinned host-to-device copies on CUDA; on a CPU-only machine
  the memory copy the block streamer does instead, and then (without ``--no-fit``) the bandwidth those copies reach
  inside training, read off a model trained with every block offloaded and resident, in turn (into fresh pages
  they ran at a third to a fifth of the speed of a copy alone: :mod:`.offload_copies`);
- ``optimizer_seconds_per_param`` / ``host_optimizer_seconds_per_param``: fused ``torch.optim.AdamW`` steps on
  device and on host tensors;
- ``step_overhead``: the step of a ``Trainer`` with ``P2RStrategy`` on the same processes over a model too small
  to matter (the framework's fixed cost per step);
- ``batch_overhead``: the same ``Trainer`` accumulating 4 batches of the same size per step: the added step time,
  less the model work the cost model prices for the 3 added batches, per added batch (Lightning's batch loop);
- ``module_hook_overhead``: a stack of tiny blocks trained with and without FSDP2 over a mesh of each rank alone,
  per hooked module and micro-batch (:mod:`.module_hooks`);
- ``cpu_oversubscription`` (CPU only): training threads (processes x ``--threads``) per usable core, when above 1;
- ``intra_node_bandwidth``, ``collective_factors``: each collective kind (all-reduce, all-gather, reduce-scatter,
  all-to-all, broadcast) timed at three message sizes among ``--processes`` local processes (gloo on CPU, NCCL
  when as many GPUs exist); a line through its times gives its bus bandwidth (the slope), by the ring formula;
  all-reduce's is the link's, the other kinds' are kept relative to it;
- ``intra_node_latency``: the **mean** time of small all-reduces (1 and 16 KB) over rounds of back-to-back calls
  (the median round), in four windows spread over the collective timings (the median window), per ring step
  (:func:`latency_per_step`). A step pays the sum of its calls, so the mean,
  tail included, is what it pays; a single call's median and a line's intercept through larger sizes miss the
  calls that wait for a descheduled rank, which dominate on a CPU running more processes than cores;
- ``stage_overhead``, ``dtensor_overhead``, ``blocking_collective_overhead``, ``expert_wait_overhead`` (with
  ``--processes`` above one; ``--no-fit`` skips them): no microbenchmark isolates them, so a handful of small
  layouts that count them (pipeline, tensor, expert parallel, ZeRO) train for a few steps, as ``plan --trial`` runs
  a layout, each three times in turn (``--probe-rounds``), and the terms are fitted to their median steps;
  ``fitted_spread`` keeps each term's range over the fits that leave one layout out (:mod:`.fit_terms`).

While it times the device, each measuring process's share of its cores (CPU time over wall time) is watched: below
90% other work was running, and the command says so and writes it into the file (``BusyMachineWarning``).

One node is all this command sees: the inter-node constants are copied from the intra-node ones, and the file says
so.

With ``--processes`` above one, every measurement runs in all the processes at once, as training would load the
machine. On CPU every "device" is one training process with ``--threads`` threads (the benchmarks run one thread
per process); collectives and copies then share the cores with compute, so the file says they do not overlap it.

The probes live beside this module, one file per kind: :mod:`.device_probes` (one device's speeds),
:mod:`.layer_probes` (a layer's fixed and per-token costs), :mod:`.collective_probes` (every probe in all the
processes at once, then the collectives) and :mod:`.step_overhead` (a step's cost beyond its model); the fits from
timed layouts are :mod:`.fit_terms` and :mod:`.offload_copies`. This module runs them in order and writes the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings

import torch

from ..planning.cluster import Cluster, write_cluster
from .collective_probes import measure_processes, one_process_hooks
from .device_probes import device_constants, rate_rows
from .fit_terms import describe_fit, fit_framework_terms
from .layer_probes import HF_LAYER_SECONDS, LAYER_SECONDS, expert_weight_overhead, hf_token_overheads, token_overheads
from .offload_copies import fit_copy_bandwidth
from .run import core_share, host_threads, usable_cores
from .speed import machine_name, reference_step_seconds
from .step_overhead import ACCUMULATED_BATCHES, batch_call_overhead, modelled_added_batches, step_overhead


def cpu_oversubscription(processes: int, threads: int, cores: int) -> float:
    """Training threads per core when they outnumber the cores (1 otherwise): each process's share of a core is one
    over it."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    return max(1.0, processes * threads / cores)


def host_memory_bytes() -> float:
    try:
        with open("/proc/meminfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


class BusyMachineWarning(UserWarning):
    """Other work shared the machine while ``calibrate`` measured it."""


BUSY_SHARE = 0.9
"""The share of its cores below which a measuring process is taken to have shared the machine with other work."""


def busy_warnings(share: float) -> list[str]:
    """What to tell the user when other work shared the machine with the measurement (a CPU run's constants are then
    slower and noisier than the machine's, and the planner's figures with them), from the measuring processes'
    share of their cores while they timed the device. (The load average is no such sign: it stays high for a minute
    after the user's previous ``calibrate``.)"""
    if share >= BUSY_SHARE:
        return []
    return [f"the measuring processes got {share:.0%} of their cores while timing this machine: other work was "
            "running, and the constants are slower and noisier than the machine's; calibrate again with nothing else "
            "running"]


SPEED_MOVED = 0.10
"""How far the reference step may move between a calibration's start and end before the command says the machine's
speed changed while it measured."""


def speed_moved(before: float, after: float) -> str | None:
    """A warning when the reference step (``lightning_p2r.measure.speed``) timed before and after the calibration
    differs by more than ``SPEED_MOVED``: the constants then mix two speeds of the machine."""
    change = after / before - 1
    if abs(change) <= SPEED_MOVED:
        return None
    return (f"the machine's speed moved while it was measured: the reference step took {1e3 * before:.3g} ms before "
            f"and {1e3 * after:.3g} ms after ({100 * change:+.0f}%); the constants mix both speeds: calibrate again "
            "with nothing else running")


def calibrate(*, processes: int = 2, threads: int = 1, quick: bool = False, name: str = "this-machine") -> Cluster:
    """Measure this machine (see the module docstring) and return its :class:`Cluster`."""
    if processes < 1 or threads < 1:
        raise ValueError(f"processes and threads must be >= 1, got {processes} and {threads}")
    cuda = torch.cuda.is_available()
    if processes > 1:
        measured = measure_processes(processes, threads, quick)
    else:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        device = torch.device("cuda") if cuda else torch.device("cpu")
        try:
            measured, measured["core_share"] = core_share(lambda: device_constants(device, quick), threads)
            measured["module_hook_overhead"] = one_process_hooks(device, quick)
        finally:
            torch.set_num_threads(previous)
        # Nothing to communicate with: the collective constants are unused on one device.
        measured |= {"intra_node_bandwidth": measured["memory_bandwidth"], "intra_node_latency": 0.0}
    share = measured.pop("core_share")
    if not cuda:  # beside a GPU the device's timings do not hang on the host's cores
        for message in busy_warnings(share):
            warnings.warn(message, BusyMachineWarning, stacklevel=2)
    measured["attention_rates"] = rate_rows(measured)
    layer_seconds = {name: measured.pop(name) for name in (*LAYER_SECONDS, *HF_LAYER_SECONDS) if name in measured}
    measured["step_overhead"] = step_overhead(processes, threads, quick)
    accumulated = step_overhead(processes, threads, quick, accumulate=ACCUMULATED_BATCHES)
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else host_memory_bytes() / processes
    cluster = Cluster(name=name, accelerator="cuda" if cuda else "cpu", devices=processes,
                      devices_per_node=processes, device_memory=float(memory),
                      host_memory_per_node=host_memory_bytes(), inter_node_bandwidth=measured["intra_node_bandwidth"],
                      inter_node_latency=measured["intra_node_latency"], overlap_collectives=cuda,
                      overlap_copies=cuda, cpu_oversubscription=1.0 if cuda else cpu_oversubscription(
                          processes, threads, usable_cores()), **measured)
    cluster = dataclasses.replace(cluster, **token_overheads(cluster, layer_seconds),
                                  **expert_weight_overhead(cluster, layer_seconds))
    cluster = dataclasses.replace(cluster, **hf_token_overheads(cluster, layer_seconds))
    extra = modelled_added_batches(cluster, ACCUMULATED_BATCHES)
    return dataclasses.replace(cluster, batch_overhead=batch_call_overhead(
        measured["step_overhead"], accumulated, ACCUMULATED_BATCHES, extra))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightning-p2r calibrate",
                                     description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--out", required=True, help="the cluster YAML to write (replaced atomically)")
    parser.add_argument("--processes", type=int, default=2,
                        help="training processes (devices) on this machine; collectives are timed among them")
    parser.add_argument("--threads", type=int,
                        help="torch threads per process (default: 1 on CPU, where each process is a device; beside "
                             "GPUs the usable cores divided among the processes, as a run's host work uses them)")
    parser.add_argument("--name", default="this-machine")
    parser.add_argument("--quick", action="store_true", help="smaller, fewer measurements (seconds, noisier)")
    parser.add_argument("--probe-rounds", type=int, default=None,
                        help="times each probe layout of the fits is timed, the probes in turn; the fits read "
                             "medians (default: 3 for the framework waits and for the offload copies; "
                             "--quick: 1)")
    parser.add_argument("--no-fit", action="store_true",
                        help="skip the fits from timed probe layouts: the framework waits (their terms stay 0; the "
                             "planner warns where a layout counts one) and, on CPU, the offloaded copies' "
                             "bandwidth inside training (the copy alone stands)")
    args = parser.parse_args(argv)
    if args.probe_rounds is not None and args.probe_rounds < 1:
        parser.error(f"--probe-rounds must be at least 1, got {args.probe_rounds}")
    if args.probe_rounds is not None and args.no_fit:
        parser.error("--probe-rounds shapes the fits from timed probe layouts, which --no-fit skips")
    if args.threads is None:
        args.threads = host_threads("cuda" if torch.cuda.is_available() else "cpu", args.processes, usable_cores())
    reference_device = "cuda" if torch.cuda.is_available() else "cpu"
    reference_before = reference_step_seconds(reference_device)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", BusyMachineWarning)
            cluster = calibrate(processes=args.processes, threads=args.threads, quick=args.quick, name=args.name)
    except ValueError as error:
        parser.error(str(error))
    busy = []
    for warning in caught:
        if issubclass(warning.category, BusyMachineWarning):
            busy.append(f"Warning: {warning.message}.")
            print(f"warning: {warning.message}", file=sys.stderr)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    copies = ""
    if not args.no_fit:
        cluster, copies = fit_copy_bandwidth(cluster, quick=args.quick, threads=args.threads,
                                             rounds=args.probe_rounds)
    if args.processes > 1 and not args.no_fit:
        cluster, _ = fit_framework_terms(cluster, quick=args.quick, threads=args.threads,
                                         rounds=args.probe_rounds)
    reference_after = reference_step_seconds(reference_device)
    cluster = dataclasses.replace(cluster, reference_step_seconds=(reference_before + reference_after) / 2,
                                  calibrated_on=machine_name(cluster.accelerator))
    if moved := speed_moved(reference_before, reference_after):
        busy.append(f"Warning: {moved}.")
        print(f"warning: {moved}", file=sys.stderr)
    comment = (f"Measured by `lightning-p2r calibrate` on {time.strftime('%Y-%m-%d')} with {args.processes} "
               f"process(es) of {args.threads} thread(s).\nOne node was measured: inter-node constants repeat the "
               f"intra-node ones; edit them for a multi-node cluster.\n{describe_fit(cluster, skipped=args.no_fit)}"
               + "".join(f"\n{line}" for line in (copies, *busy) if line))
    write_cluster(cluster, args.out, comment)
    for key, value in cluster.to_dict().items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
