"""Routing balance: the Switch auxiliary loss against auxiliary-loss-free balancing (DeepSeek-V3's routing bias) at
equal steps, over several seeds (issue 40 item 6).

    python -m lightning_p2r.benchmarks.balance [--seeds 0 1 2] [--steps 200] [--out DIR] [--quick]

The same MoE M6 (4 layers, dim 128, 8 experts, top-2, capacity 1.25) trains on the KJV corpus (byte tokens) with
each rule from the same initial weights and batches: "aux_loss" (``router_aux_loss_coef=0.01``) and "bias"
(``router_balance="bias"``, ``router_aux_loss_coef=0``, ``router_bias_rate`` as given). Reported per run: the
validation loss at the end, the training cross-entropy averaged over the last 10 steps, and the load balance
(busiest expert's assignments over the mean, averaged over MoE layers) averaged over the last 10 steps and at its
worst after the first 10% of the run, with the dropped fraction. The table ends with each rule's mean and spread
over the seeds.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import lightning as L

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, TextDataModule
from lightning_p2r.benchmarks.report import (
    base_parser,
    environment_info,
    print_environment,
    print_table,
    save_bar_chart,
    with_environment,
    write_csv,
)

COLUMNS = ["rule", "seed", "val_loss", "train_ce_last10", "load_max_over_mean_last10", "load_max_over_mean_worst",
           "dropped_fraction_last10"]


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        metrics = trainer.callback_metrics
        self.rows.append({name: float(metrics[key]) for name, key in
                          (("ce", "train/loss"), ("load", "moe/load_max_over_mean"),
                           ("dropped", "moe/dropped_fraction")) if key in metrics})


def run(rule: str, seed: int, steps: int, rate: float, quick: bool) -> dict[str, Any]:
    dim, layers, batch, seq = (32, 2, 4, 32) if quick else (128, 4, 16, 64)
    changes = {"router_balance": "bias", "router_aux_loss_coef": 0.0, "router_bias_rate": rate} \
        if rule == "bias" else {"router_balance": "aux_loss", "router_aux_loss_coef": 0.01}
    data = TextDataModule(corpus="kjv", tokenizer="bytes", seq_len=seq, batch_size=batch)
    config = M6Config(vocab_size=data.vocab_size, max_seq_len=seq, num_layers=layers, dim=dim, num_heads=4,
                      num_experts=8, moe_top_k=2, capacity_factor=1.25, init_seed=seed, **changes)
    L.seed_everything(seed, verbose=False)
    module = M6LanguageModel(config, OptimizerConfig(lr=3e-3, warmup_steps=max(1, steps // 20)))
    recorder = Recorder()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                            callbacks=[recorder], limit_val_batches=4 if quick else 20, val_check_interval=steps,
                            num_sanity_val_steps=0,
                            # The recorder reads every step's moe/ metrics, which the module logs only on the steps
                            # Lightning writes to its loggers.
                            log_every_n_steps=1)
        trainer.fit(module, datamodule=data)
        val = float(trainer.callback_metrics.get("val/loss", float("nan")))
    last = recorder.rows[-10:]
    after_start = recorder.rows[max(1, len(recorder.rows) // 10):]
    return {"rule": rule, "seed": seed, "val_loss": val,
            "train_ce_last10": statistics.mean(r["ce"] for r in last),
            "load_max_over_mean_last10": statistics.mean(r["load"] for r in last),
            "load_max_over_mean_worst": max(r["load"] for r in after_start),
            "dropped_fraction_last10": statistics.mean(r["dropped"] for r in last)}


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for rule in ("aux_loss", "bias"):
        mine = [r for r in rows if r["rule"] == rule]
        row: dict[str, Any] = {"rule": f"{rule} (mean ± sd)", "seed": len(mine)}
        for column in COLUMNS[2:]:
            values = [r[column] for r in mine]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            row[column] = f"{statistics.mean(values):.4f} ± {spread:.4f}"
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--bias-rate", type=float, default=0.001)
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = [0], 12
    env = environment_info("cpu")
    print_environment(env)
    rows = [run(rule, seed, args.steps, args.bias_rate, args.quick) for seed in args.seeds
            for rule in ("aux_loss", "bias")]
    table = rows + summary(rows)
    print_table(table, COLUMNS)
    out = Path(args.out)
    write_csv(with_environment(rows, env), out / "balance.csv")
    means = {rule: [statistics.mean(r[c] for r in rows if r["rule"] == rule)
                    for c in ("val_loss", "load_max_over_mean_last10")] for rule in ("aux_loss", "bias")}
    save_bar_chart(out / "balance.png", ["val loss", "load max/mean (last 10)"], means, ylabel="value",
                   title=f"aux loss vs loss-free balancing, {len(args.seeds)} seeds, {args.steps} steps")
    print(f"wrote {out / 'balance.csv'}, {out / 'balance.png'}")
    return rows


if __name__ == "__main__":
    main()
