"""Speed and memory benchmarks: each is a module run as ``python -m lightning_p2r.benchmarks.<name>``.

Every benchmark prints the environment and a table of what it measured, and writes ``<name>.csv`` and
``<name>.png`` to ``--out`` (default ``runs/benchmarks``; ``--update-docs`` writes to ``docs/benchmarks``, the figures
the docs show, and is the only way a benchmark changes them). Common flags: ``--device`` (cuda when available, else
cpu) and ``--quick`` (tiny sizes, for smoke tests only: its numbers mean nothing).

- ``moe``: forward + backward tokens/s of one :class:`~lightning_p2r.models.moe.MoEFeedForward` layer (top-1,
  top-2, M6-T prototyping with k = 2 and 4; dropless and capacity 1.25) against a dense FFN with the same active
  parameters per token.
- ``quickstart``: time to the first optimizer step and steady-state step time / tokens/s of
  ``recipes/quickstart.yaml``, built through the project's LightningCLI.
- ``pseudo_to_real``: the same model trained real from scratch against Pseudo-to-Real with several delink
  points and optimizer-state policies (same data order, token budget and LR schedule): validation loss against
  steps and training seconds, and the pseudo stage's training-state bytes against the real model's.
- ``offload``: ``P2RStrategy`` with 0 to 100% of the blocks offloaded: tokens/s, telemetry (peak device
  model-state bytes, bytes moved, copy wait, host/device optimizer step) and, on CUDA, peak allocated memory;
  Lightning's ``ModelParallelStrategy`` with FSDP2's ``CPUOffloadPolicy`` as the peer; fused vs foreach host AdamW.
- ``layered``: standard against layered gradient accumulation for m = 1, 2, 4, 8 micro-batches per step: the
  collectives per optimizer step (calls and bytes, measured) and tokens/s of zero3 on 2 CPU processes, and the
  host->device parameter bytes with every block offloaded on one process.
- ``capacity``: the largest dense M6 that trains a few steps under a per-rank memory limit, for one process, ZeRO-3
  on 2 ranks, full offload and both; per rank the memory growth while the model is built and placed (over its fp32
  parameter bytes) and the peak of the run. Its measurement, :mod:`lightning_p2r.measure.memory`
  (``SetupMemoryProbe``, a callback: peak RSS growth from ``setup`` to the first batch, and on CUDA
  ``max_memory_allocated``), is shared with the tests.
- ``accumulation_sync``: standard accumulation under ZeRO-3 on 2 CPU processes, gradients reduced once per step
  (the default) against after every micro-batch (``reduce_every_micro_batch=True``): median step time.
- ``host_allocator``: CPU training with glibc's malloc as it comes against freed host memory kept for reuse
  (``P2RStrategy(host_allocator=...)``), on 1 and 2 processes: median step time and page faults per step.

- ``parallel``: tensor, expert and sequence parallelism (and combinations, with ZeRO-3) on 2 and 4 CPU
  processes: the bytes of each collective kind per step, counted, next to the formulas of
  :mod:`lightning_p2r.planning.traffic`; per-rank parameter and optimizer-state bytes; tokens/s.

- ``planner``: the layout planner's predicted step time (:mod:`lightning_p2r.planning`, with this machine
  calibrated) against measured CPU steps of ten layouts (one process, ZeRO-1/3, layered + offload, tp2, ep2,
  1F1B and looped pipelines): error per layout, and the prediction's parts.
- ``projections``: the planner's projections (no run) of M6-10T on 512 V100s, a 1T dense model on 1,024 to 8,192
  A100s (layered + looped breadth-first pipeline against 1F1B + ZeRO-3, and a network bandwidth sweep) and ZeRO's
  100B model on 400 V100s.

- ``attention``: locally banded attention, chunked (cost grows with T x window) and through a dense (T, T) mask,
  against dense causal attention: forward + backward seconds over the sequence length.

Shared helpers (CSV, plain-text tables, plots, environment, timing) live in :mod:`lightning_p2r.benchmarks.report`.
Timings belong here and never in tests: the tests only check that each benchmark runs and writes its outputs.
"""
