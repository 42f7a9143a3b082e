"""The planner judged on a fresh draw of model shapes and one-device layouts (issue 41: held-out shapes, not only
held-out layouts; item 2: the same on a GPU).

    python -m lightning_p2r.benchmarks.planner_draw [--seed 11] [--count 24] [--processes 1] [--rounds 1]
                                                    [--budget-s 150] [--cluster FILE] [--measured CSV] [--out DIR]
                                                    [--memory-savers P] [--speed-check] [--models m6|hf]

1. **Draw.** A seeded random sample of models (depth, width, dense or MoE with 4-16 experts and top-1 or top-2,
   sequence length; the package's M6, or with ``--models hf`` Hugging Face decoders of the families ``plan`` prices,
   family, grouped-query heads, FFN width and tied head drawn too) and one-device layouts (offloaded fraction, micro-
   batches, standard or layered accumulation, recompute), sized for the device (a GPU gets models of 10-300 M
   parameters in bf16, a CPU small ones in fp32); layouts the strategy's rulebook refuses are redrawn. With
   ``--processes N`` above one, each model's layout is drawn from the planner's own search space on N devices (ZeRO
   stage, tensor / expert / pipeline degrees, schedules, micro-batches, accumulation), and with ``--memory-savers P``
   a share P of them get recompute or an offload fraction (what ``plan`` adds when a layout does not fit the device).
2. **Measure.** Each draw trains for a few steps on random tokens (the planner's trial worker's fit: in this
   process on one device, in ``plan --trial``'s worker processes on several); the measured step is rank 0's median
   optimizer-step interval after warm-up. With ``--rounds R`` the whole draw runs R times in turn (as ``plan
   --trial-rounds`` runs its layouts) and each row keeps the median of its rounds, with their range
   (``measured_min_s`` / ``measured_max_s``): one run slowed by something else on the machine then moves one round,
   not the row. Rows are written as they finish, so a run cut short by ``--budget-s`` keeps what it measured.
3. **Predict.** With ``--cluster`` (a ``lightning-p2r calibrate`` file of this machine) each row gets the
   planner's estimate; ``--measured CSV`` re-predicts stored measurements without running anything, so a change to
   the cost model is judged on the same draw. The summary prints the median and largest |error| and Spearman's rank
   correlation of predicted and measured step, for all rows and per process count, and with ``--rounds`` how far
   a row's own rounds lie apart (median and largest): the timing noise the errors are measured against. Each row also
   gets ``predicted_low_s`` / ``predicted_high_s``, its step with the fitted terms at the ends of their
   leave-one-out ranges (what ``plan`` prints as ``step_low_s`` / ``step_high_s``), and the summary counts the rows
   whose measured step lies inside it.

The user's path (issue 41 item 1) is ``lightning-p2r calibrate --processes N --out FILE`` (which fits the framework
waits on this machine) and then this draw with ``--cluster FILE``: no term is chosen or fitted on the draw.
"""

from __future__ import annotations

import csv
import json
import math
import random
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_p2r.benchmarks.planner_cv import spearman
from lightning_p2r.benchmarks.report import apply_threads, base_parser
from lightning_p2r.models.config import M6Config
from lightning_p2r.planning.cluster import Cluster, at_speed, cluster_for, load_cluster
from lightning_p2r.planning.hf_decoder import HFDecoder, hf_decoder_of
from lightning_p2r.planning.layout import Layout, Workload
from lightning_p2r.planning.model import PricedModel
from lightning_p2r.planning.step_time import estimate_step, fitted_step_range

COLUMNS = ("draw", "processes", "layout", "layers", "dim", "experts", "top_k", "seq_len", "global_batch", "precision",
           "measured_s", "measured_min_s", "measured_max_s", "rounds", "predicted_s", "predicted_low_s",
           "predicted_high_s", "error_pct", "reference_s", "speed_ratio", "predicted_file_s", "error_file_pct",
           "status", "model", "options")


@dataclass(frozen=True)
class Draw:
    config: PricedModel
    layout: Layout
    workload: Workload
    processes: int = 1


def _model(rng: random.Random, gpu: bool) -> tuple[M6Config, int, int]:
    """(config, global batch, seq_len) of one drawn model."""
    layers = rng.choice((2, 4, 6, 8))
    dim = rng.choice((256, 512, 768, 1024) if gpu else (32, 64, 96, 128))
    seq = rng.choice((256, 512, 1024, 2048) if gpu else (32, 64, 128))
    tokens = rng.choice((8192, 16384, 32768) if gpu else (256, 512, 1024))
    experts = rng.choice((0, 0, 4, 8, 16))
    moe = {} if experts == 0 else {"num_experts": experts, "moe_top_k": rng.choice((1, 2)),
                                   "capacity_factor": rng.choice((None, 1.25))}
    config = M6Config(vocab_size=rng.choice((8192, 32768)) if gpu else 256, max_seq_len=seq, num_layers=layers,
                      dim=dim, num_heads=dim // 64 if gpu else 4, moe_layers=[] if experts == 0 else None,
                      **moe)
    return config, max(1, tokens // seq), seq


HF_FAMILIES = ("llama", "qwen3", "mistral", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe")
"""The Hugging Face families ``--models hf`` draws from (the priced ones; Qwen2 is Llama with biases)."""


def _hf_model(rng: random.Random, gpu: bool) -> tuple[PricedModel, int, int]:
    """(decoder, global batch, seq_len) of one drawn Hugging Face model: family, depth, width, grouped-query heads,
    FFN width, experts and top-k, sequence length and tokens per step drawn (tiny on a CPU, as ``_model``)."""
    from lightning_p2r.planning.hf_decoder import hf_decoder_of

    family = rng.choice(HF_FAMILIES)
    layers = rng.choice((2, 4, 6))
    dim = rng.choice((256, 512, 1024) if gpu else (32, 64, 96, 128))
    seq = rng.choice((256, 512, 1024) if gpu else (32, 64, 128))
    tokens = rng.choice((8192, 16384) if gpu else (256, 512, 1024))
    heads = dim // 64 if gpu else 4
    ffn = dim * rng.choice((2, 3, 4))
    vocab = rng.choice((8192, 32768)) if gpu else 256
    if family == "gpt2":
        config = {"n_embd": dim, "n_layer": layers, "n_head": heads, "n_positions": seq, "n_inner": ffn}
    else:
        config = {"hidden_size": dim, "num_hidden_layers": layers, "num_attention_heads": heads,
                  "num_key_value_heads": rng.choice((heads, heads // 2)), "intermediate_size": ffn,
                  "max_position_embeddings": seq, "tie_word_embeddings": rng.random() < 0.5}
        if family == "mistral":
            config["sliding_window"] = rng.choice((seq // 4, seq // 2))
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        experts, top_k = rng.choice((4, 8, 16)), rng.choice((1, 2))
        config |= {"num_experts_per_tok": top_k}
        if family == "mixtral":
            config |= {"num_local_experts": experts, "intermediate_size": dim}
        else:
            config |= {"num_experts": experts, "moe_intermediate_size": dim // 2}
        if family == "qwen2_moe":
            config["shared_expert_intermediate_size"] = dim
    decoder = hf_decoder_of({"model_type": family, "vocab_size": vocab, **config})
    return decoder, max(1, tokens // seq), seq


def _layout(rng: random.Random) -> Layout:
    micro = rng.choice((1, 1, 2, 4))
    return Layout(offload_fraction=rng.choice((0.0, 0.0, 0.5, 1.0)), micro_batches=micro,
                  accumulation=rng.choice(("standard", "layered")) if micro > 1 else "standard",
                  recompute=rng.random() < 0.25)


def draw(seed: int, count: int, gpu: bool, processes: int = 1, memory_savers: float = 0.0,
         models: str = "m6") -> list[Draw]:
    """``count`` runnable (model, layout, workload) draws on ``processes`` devices, seeded. On several devices a share
    ``memory_savers`` of the layouts get recompute or offload (one of the variants ``plan`` tries when a layout does
    not fit: a search on a roomy device never picks them); 0 draws what earlier seeds drew. ``models`` "hf" draws
    Hugging Face decoders (``_hf_model``) instead of M6 models."""
    from lightning_p2r.planning.search import SearchSpace, candidate_layouts, is_valid
    from lightning_p2r.planning.search import memory_savers as saver_variants

    rng = random.Random(seed)
    # One device keeps the cluster its earlier draws were checked against (their seeds draw the same layouts).
    cluster = Cluster(devices=1, devices_per_node=1) if processes == 1 else Cluster(
        accelerator="cuda" if gpu else "cpu", devices=processes, devices_per_node=processes)
    out: list[Draw] = []
    while len(out) < count:
        config, batch, seq = (_hf_model if models == "hf" else _model)(rng, gpu)
        precision = "bf16-mixed" if gpu else "32-true"
        workload = Workload(global_batch=batch * processes, seq_len=seq, precision=precision)
        if processes == 1:
            layout = _layout(rng)
            if not is_valid(layout, config, cluster, workload):
                continue
        else:
            pool = sorted(candidate_layouts(config, cluster, workload), key=lambda option: option.describe())
            if not pool:
                continue
            layout = rng.choice(pool)
            if memory_savers and rng.random() < memory_savers:
                variants = [variant for variant in saver_variants(layout, SearchSpace())
                            if is_valid(variant, config, cluster, workload)]
                layout = rng.choice(variants) if variants else layout
        out.append(Draw(config, layout, workload, processes))
    return out


def measure(item: Draw, device: str, steps: int) -> float:
    """Seconds per optimizer step of one draw, trained as ``plan --trial`` trains a layout (one device: in this
    process; several: in the trial's worker processes)."""
    import tempfile

    from lightning_p2r.measure.run import fit_on_random_tokens
    from lightning_p2r.measure.trial import run_trial, trial_spec
    from lightning_p2r.strategy import P2RStrategy

    with tempfile.TemporaryDirectory() as folder:
        spec = trial_spec(item.config, item.layout, item.workload, devices=item.processes, steps=steps,
                          accelerator=device, out=str(Path(folder) / "draw"))
        if item.processes > 1:
            return run_trial(spec)
        return fit_on_random_tokens(spec, P2RStrategy(**spec["strategy"], log_telemetry=False), warmup=2)[2]


def measure_rows(items: list[Draw], timer: Callable[[Draw], float], *, rounds: int = 1, budget_s: float = math.inf,
                 after_each: Callable[[list[dict[str, Any]]], None] = lambda rows: None,
                 reference: Callable[[], float] | None = None) -> list[dict[str, Any]]:
    """One row per draw, ``timer`` run on every draw ``rounds`` times in turn (all draws once, then again): each row's
    ``measured_s`` is the median of its rounds. A draw that fails is a finding: the row records the error and is not
    run again. Past ``budget_s`` seconds nothing more is run; a row measured in fewer rounds keeps the median of
    those, and one never measured says it was skipped. ``after_each`` gets the rows after every run (to write them
    as they come). ``reference`` (the speed check's reference step) is timed right before each run, and a row keeps
    its median in ``reference_s``: the machine's speed when the row ran, as ``plan`` run just before it would see
    it."""
    began = time.perf_counter()
    rows = [row_of(index, item) for index, item in enumerate(items)]
    times: list[list[float]] = [[] for _ in items]
    references: list[list[float]] = [[] for _ in items]
    for round_ in range(1, rounds + 1):
        for item, row, measured, referenced in zip(items, rows, times, references):
            if row.get("status", "ok") != "ok":
                continue
            if time.perf_counter() - began > budget_s:
                row.setdefault("status", f"skipped: past --budget-s {budget_s}")
                continue
            try:
                if reference is not None:
                    referenced.append(reference())
                measured.append(timer(item))
            except Exception as error:
                traceback.print_exc()
                row["status"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
                continue
            row |= {"measured_s": statistics.median(measured), "measured_min_s": min(measured),
                    "measured_max_s": max(measured), "rounds": len(measured), "status": "ok"}
            if referenced:
                row["reference_s"] = statistics.median(referenced)
            of_rounds = f" (round {round_}/{rounds})" if rounds > 1 else ""
            print(f"[{time.perf_counter() - began:6.1f} s] {row['draw']} p{row['processes']} {row['layout']} "
                  f"L{row['layers']} d{row['dim']} E{row['experts']} s{row['seq_len']} b{row['global_batch']}: "
                  f"{measured[-1]:.4g} s{of_rounds}", flush=True)
            after_each(rows)
    return rows


def budget_note(rows: list[dict[str, Any]], rounds: int) -> str | None:
    """What ``--budget-s`` left out of the draw (draws never measured, rows measured in fewer than ``rounds``
    rounds), to say beside the summary; None when everything ran. The default budget stops a full draw early."""
    skipped = [row for row in rows if str(row.get("status", "")).startswith("skipped")]
    short = [row for row in rows if row.get("status") == "ok" and int(row.get("rounds") or rounds) < rounds]
    if not skipped and not short:
        return None
    return (f"the budget ended the draw early: {len(skipped)} of {len(rows)} draws not measured, {len(short)} measured "
            f"in fewer than {rounds} rounds; the summary covers only what was measured (raise --budget-s to measure "
            "the whole draw)")


def row_of(index: int, item: Draw) -> dict[str, Any]:
    config = item.config
    model = ({"hf_config": config.hf_config()} if isinstance(config, HFDecoder) else asdict(config))
    return {"draw": index, "processes": item.processes, "layout": item.layout.describe(),
            "layers": config.num_layers, "dim": config.dim,
            "experts": config.num_experts if config.moe_layers != [] else 0, "top_k": config.moe_top_k,
            "seq_len": item.workload.seq_len, "global_batch": item.workload.global_batch,
            "precision": item.workload.precision, "model": json.dumps(model),
            "options": json.dumps(asdict(item.layout))}


def draw_of_row(row: dict[str, Any]) -> Draw:
    options = json.loads(row["options"])
    if options.get("offload_blocks") is not None:
        options["offload_blocks"] = tuple(options["offload_blocks"])
    model = json.loads(row["model"])
    config = hf_decoder_of(model["hf_config"]) if "hf_config" in model else M6Config(**model)
    return Draw(config, Layout(**options),
                Workload(global_batch=int(row["global_batch"]), seq_len=int(row["seq_len"]),
                         precision=row["precision"]), int(row.get("processes") or 1))


def predict(rows: list[dict[str, Any]], clusters: list[Cluster]) -> None:
    """Each measured row's prediction and error, with the calibration of its process count (a ``calibrate
    --processes N`` file has ``devices: N``; the first file serves a count no file has). A row with ``reference_s``
    (``--speed-check``) whose file has a reference step is priced at the speed measured right before it ran
    (``planning.cluster.at_speed``), as ``plan`` prices it; ``predicted_file_s`` / ``error_file_pct`` keep the file's
    own prediction beside it."""
    for row in rows:
        if not row.get("measured_s"):
            continue
        item = draw_of_row(row)
        devices, _ = cluster_for(clusters, item.processes)
        measured = float(row["measured_s"])
        predicted = estimate_step(item.config, item.layout, devices, item.workload).total
        for key in ("speed_ratio", "predicted_file_s", "error_file_pct"):
            row.pop(key, None)
        if row.get("reference_s") not in (None, "") and devices.reference_step_seconds > 0:
            ratio = float(row["reference_s"]) / devices.reference_step_seconds
            row |= {"speed_ratio": ratio, "predicted_file_s": predicted,
                    "error_file_pct": 100 * (predicted - measured) / measured}
            devices = at_speed(devices, ratio)
            predicted = estimate_step(item.config, item.layout, devices, item.workload).total
        row["predicted_s"] = predicted
        row["predicted_low_s"], row["predicted_high_s"] = fitted_step_range(item.config, item.layout, devices,
                                                                            item.workload, predicted)
        row["error_pct"] = 100 * (predicted - measured) / measured


def _scores(scored: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(float(row["error_pct"])) for row in scored]
    result = {"count": len(scored), "median_abs_error_pct": statistics.median(errors),
              "max_abs_error_pct": max(errors),
              "spearman": spearman([float(r["predicted_s"]) for r in scored], [float(r["measured_s"]) for r in scored])}
    # With several rounds, how far one row's own timings lie apart: the noise its error is measured against.
    spreads = [100 * (float(r["measured_max_s"]) - float(r["measured_min_s"])) / float(r["measured_s"])
               for r in scored if int(r.get("rounds") or 1) > 1]
    if spreads:
        result |= {"median_rounds_spread_pct": statistics.median(spreads), "max_rounds_spread_pct": max(spreads)}
    # Rows whose prediction moves with the fitted terms' leave-one-out ranges: how often the measurement lies inside.
    ranged = [r for r in scored if r.get("predicted_low_s") not in (None, "")
              and float(r["predicted_low_s"]) < float(r["predicted_high_s"])]
    if ranged:
        inside = sum(float(r["predicted_low_s"]) <= float(r["measured_s"]) <= float(r["predicted_high_s"])
                     for r in ranged)
        result |= {"rows_with_fitted_range": len(ranged), "measured_within_fitted_range": inside}
    return result


def saves_memory(row: dict[str, Any]) -> bool:
    """Whether the row's layout recomputes or offloads (what ``plan`` adds when a layout does not fit)."""
    options = json.loads(row.get("options") or "{}")
    return (bool(options.get("recompute")) or float(options.get("offload_fraction") or 0) > 0
            or bool(options.get("offload_blocks")))


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median and largest |error| and Spearman's rank correlation of the predicted rows, for all of them and,
    when the draw holds several process counts, per process count (``by_processes``), and for the rows that
    recompute or offload among others (``memory_savers``). Rows measured in several
    rounds add how far their rounds lie apart (max - min, in % of the row's median): the median and largest. Rows
    priced at the speed measured when they ran (``--speed-check``) add the same figures priced at the file's own
    speed (``at_the_files_speed``)."""
    scored = [row for row in rows if row.get("error_pct") not in (None, "")]
    if not scored:
        return {}
    by_count: dict[int, list[dict[str, Any]]] = {}
    for row in scored:
        by_count.setdefault(int(row.get("processes") or 1), []).append(row)
    result = _scores(scored)
    if len(by_count) > 1:
        result["by_processes"] = {n: _scores(by_count[n]) for n in sorted(by_count)}
    savers = [row for row in scored if saves_memory(row)]
    if savers and len(savers) < len(scored):
        result["memory_savers"] = _scores(savers)
    at_speed_rows = [row for row in scored if row.get("predicted_file_s") not in (None, "")]
    if at_speed_rows:
        result["speed_ratio_range"] = [min(float(r["speed_ratio"]) for r in at_speed_rows),
                                       max(float(r["speed_ratio"]) for r in at_speed_rows)]
        result["at_the_files_speed"] = summary([
            {key: value for key, value in row.items() if key not in ("predicted_file_s", "error_file_pct",
                                                                      "predicted_low_s", "predicted_high_s")}
            | {"predicted_s": row["predicted_file_s"], "error_pct": row["error_file_pct"]}
            for row in at_speed_rows])
    return result


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--count", type=int, default=24)
    parser.add_argument("--processes", type=int, nargs="+", default=[1],
                        help="process counts to draw layouts for (each gets --count draws; several processes run as "
                             "plan --trial runs them)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per draw (2 of them warm-up)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole draw this many times in turn; each row keeps its rounds' median")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="stop drawing after this many seconds (a full draw of 20 rows per process count in 3 "
                             "rounds took about 21 minutes on 2 CPU cores: raise it to measure the whole draw)")
    parser.add_argument("--cluster", nargs="+",
                        help="calibrated cluster files of this machine (one per process count, `lightning-p2r "
                             "calibrate --processes N`): predict every row with its count's file")
    parser.add_argument("--measured", help="re-predict this CSV's measurements instead of running")
    parser.add_argument("--speed-check", action="store_true",
                        help="time the speed check's reference step right before every run and price each row at "
                             "the speed it ran at, as `plan` run just before training prices it (the summary adds "
                             "the figures at the cluster file's own speed)")
    parser.add_argument("--models", choices=("m6", "hf"), default="m6",
                        help="the models drawn: the package's M6 (default) or Hugging Face decoders of the families "
                             "plan prices (docs/planning.md, \"Hugging Face decoders\")")
    parser.add_argument("--memory-savers", type=float, default=0.0,
                        help="share (0-1) of the layouts drawn for several processes given recompute or offload (the "
                             "variants plan tries when a layout does not fit; default 0: what earlier seeds drew)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1 (how often each draw runs), got {args.rounds}")
    if not 0.0 <= args.memory_savers <= 1.0:
        parser.error(f"--memory-savers must be a share between 0 and 1, got {args.memory_savers}")
    apply_threads(args.threads)
    out = Path(args.out) / "planner_draw.csv"
    if args.measured:
        with open(args.measured, newline="") as file:
            rows = list(csv.DictReader(file))
    else:
        gpu = args.device == "cuda"
        # Each process count draws from its own seed (seed + processes - 1: one process keeps the seed's old draw).
        items = [item for processes in args.processes
                 for item in draw(args.seed + processes - 1, args.count, gpu=gpu, processes=processes,
                                  memory_savers=args.memory_savers, models=args.models)]
        reference = None
        if args.speed_check:
            from functools import partial

            from lightning_p2r.measure.speed import reference_step_seconds

            reference = partial(reference_step_seconds, args.device)
        rows = measure_rows(items, lambda item: measure(item, args.device, args.steps), rounds=args.rounds,
                            budget_s=args.budget_s, after_each=lambda rows: write_rows(rows, out),
                            reference=reference)
    if args.cluster:
        predict(rows, [load_cluster(path) for path in args.cluster])
    write_rows(rows, out)
    for row in rows:
        if row.get("error_pct") not in (None, ""):
            print(f"{row['draw']:>3} {row['layout']:24s} L{row['layers']} d{row['dim']} E{row['experts']} "
                  f"s{row['seq_len']}: measured {float(row['measured_s']):.4g} s, predicted "
                  f"{float(row['predicted_s']):.4g} s ({float(row['error_pct']):+.0f}%)")
    print(summary(rows))
    if not args.measured and (note := budget_note(rows, args.rounds)):
        print(f"warning: {note}")
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
