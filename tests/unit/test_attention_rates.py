"""The attention kernel priced by shape (issue 41): ``calibrate`` measures its marginal FLOP/s on a grid of sequence
lengths and head sizes (a small head attends several times slower per FLOP than the 64-wide head of
``attention_flops``), the cluster file keeps the grid, and the planner reads the model's shape from it; a file
without the grid is priced as before."""

import dataclasses
import math

import pytest
import torch

from lightning_p2r.measure.device_probes import ATTENTION_GRID_QUICK, attention_rates, rate_rows
from lightning_p2r.models.config import M6Config
from lightning_p2r.planning.cluster import Cluster, cluster_from_dict, load_cluster, write_cluster
from lightning_p2r.planning.layout import Layout, Workload
from lightning_p2r.planning.step_time import estimate_step

CPU = Cluster(accelerator="cpu", devices=1, devices_per_node=1, overlap_collectives=False, overlap_copies=False,
              attention_flops=30e9)
GRID = [[32, 8, 5e9], [32, 64, 20e9], [128, 8, 10e9], [128, 64, 40e9]]
MODEL = M6Config(vocab_size=256, max_seq_len=64, num_layers=2, dim=32, num_heads=4, moe_layers=[])  # heads of 8


def test_the_grid_points_are_read_back_and_between_them_the_rate_is_log_log_interpolated() -> None:
    cluster = dataclasses.replace(CPU, attention_rates=GRID)
    for seq, head, rate in GRID:
        assert cluster.attention_flops_at(seq, head) == pytest.approx(rate)
    # Halfway in log between 32 and 128 and between 8 and 64: the geometric mean of the four corners.
    assert cluster.attention_flops_at(64, math.sqrt(8 * 64)) == pytest.approx(
        math.prod(row[2] for row in GRID) ** 0.25, rel=1e-2)
    assert 5e9 < cluster.attention_flops_at(64, 8) < 10e9


def test_outside_the_grid_the_edges_rate_holds_and_without_a_grid_attention_flops() -> None:
    cluster = dataclasses.replace(CPU, attention_rates=GRID)
    assert cluster.attention_flops_at(16, 4) == pytest.approx(5e9)
    assert cluster.attention_flops_at(4096, 128) == pytest.approx(40e9)
    assert cluster.attention_flops_at(2048, 8) == pytest.approx(10e9)
    assert CPU.attention_flops_at(32, 8) == CPU.attention_flops


@pytest.mark.parametrize(("rows", "message"), [
    ([[32, 8]], "list of \\[seq_len, head_dim, FLOP/s\\] rows"),
    ([[32, 8, -1.0]], "rows of positive numbers"),
    ([[32, 8, True]], "rows of positive numbers"),
    ([[32, 8, 1e9], [128, 64, 1e9]], "a full grid"),
    ([[32, 8, 1e9], [32, 8, 2e9]], "a full grid"),
    ("fast", "list of"),
])
def test_a_bad_grid_is_refused_by_name(rows, message) -> None:
    with pytest.raises(ValueError, match="attention_rates") as error:
        cluster_from_dict({"attention_rates": rows})
    assert error.match(message)


def test_the_grid_round_trips_through_the_cluster_file(tmp_path) -> None:
    cluster = dataclasses.replace(CPU, attention_rates=GRID)
    write_cluster(cluster, tmp_path / "c.yaml")
    assert load_cluster(tmp_path / "c.yaml") == cluster


def test_the_planner_prices_attention_at_the_models_shape() -> None:
    """The same cluster with a grid whose rate at the model's shape (64 tokens, heads of 8) is a third of
    ``attention_flops``: the step grows by exactly twice the attention's time at ``attention_flops``."""
    work = Workload(global_batch=4, seq_len=64)
    flat = estimate_step(MODEL, Layout(), CPU, work)
    fast = dataclasses.replace(CPU, attention_rates=[[s, h, CPU.attention_flops] for s in (32, 128) for h in (8, 64)])
    assert estimate_step(MODEL, Layout(), fast, work).compute == pytest.approx(flat.compute)
    slow = dataclasses.replace(CPU, attention_rates=[[s, h, CPU.attention_flops / 3] for s in (32, 128)
                                                     for h in (8, 64)])
    no_attention = dataclasses.replace(CPU, attention_flops=1e30)
    attention_seconds = flat.compute - estimate_step(MODEL, Layout(), no_attention, work).compute
    assert attention_seconds > 0
    assert estimate_step(MODEL, Layout(), slow, work).compute - flat.compute == pytest.approx(2 * attention_seconds)


def test_calibrate_measures_a_rate_per_grid_point_as_cluster_rows() -> None:
    torch.manual_seed(0)
    measured = attention_rates(torch.device("cpu"), quick=True, repeats=2)
    seqs, heads = ATTENTION_GRID_QUICK["cpu"]
    assert len(measured) == len(seqs) * len(heads)
    extra = {"device_flops": 1.0}
    rows = rate_rows(measured | extra)
    assert [row[:2] for row in rows] == [[s, h] for s in seqs for h in heads]
    assert all(math.isfinite(row[2]) and row[2] > 0 for row in rows)
    assert Cluster(attention_rates=rows).attention_flops_at(seqs[0], heads[0]) == pytest.approx(rows[0][2])


def test_the_loss_log_softmax_is_priced_as_traffic_of_the_logits() -> None:
    """Per token, the log-softmax reads the logits and writes the log-probabilities (2 x vocabulary elements, three
    times that forward and backward) at the bandwidth of a tensor the size of the logits; a tensor-parallel rank
    holds its share of the vocabulary (loss parallel)."""
    from lightning_p2r.planning.cluster import ELEMENTWISE_LARGE_BYTES

    work = Workload(global_batch=64, seq_len=64)  # logits of 4,096 tokens x 2,048 words: 32 MiB, uncached
    flat = dataclasses.replace(CPU, elementwise_bandwidth=1e9, device_flops=1e30, attention_flops=1e30)
    small, large = MODEL, dataclasses.replace(MODEL, vocab_size=2048 + 256)
    assert 4096 * 2048 * 4 >= ELEMENTWISE_LARGE_BYTES
    grown = estimate_step(large, Layout(), flat, work).compute - estimate_step(small, Layout(), flat, work).compute
    assert grown == pytest.approx(3 * 4096 * 2 * 2048 * 4 / 1e9, rel=1e-3)
    tp2 = Workload(global_batch=64, seq_len=64)
    split = dataclasses.replace(flat, devices=2, devices_per_node=2)
    grown_tp = (estimate_step(large, Layout(tensor_parallel=2), split, tp2).compute
                - estimate_step(small, Layout(tensor_parallel=2), split, tp2).compute)
    assert grown_tp == pytest.approx(grown / 2, rel=1e-3)
