"""The planner's cost model (lightning_p2r/planning): each formula against hand-computed cases, the parameter
inventory against the real model, and the refusals of impossible inputs. Its byte counts are checked against the
package's own counters in tests/distributed (test_planner_counts.py, test_sharding.py)."""

import dataclasses
import math

import pytest
import torch

from lightning_p2r import M6Config
from lightning_p2r.models import M6Transformer
from lightning_p2r.planning import (
    Cluster,
    Layout,
    Workload,
    bytes_by_kind,
    check_layout,
    cluster_from_dict,
    estimate_memory,
    estimate_step,
    evaluate,
    load_cluster,
    search,
    step_transfers,
    write_cluster,
)
from lightning_p2r.planning.cluster import parse_quantity
from lightning_p2r.planning.memory import micro_batches_in_flight
from lightning_p2r.planning.model import (
    all_params,
    attended_keys,
    layer_forward_flops,
    parameter_count,
    pseudo_of,
)
from lightning_p2r.planning.network import Link, collective_seconds, group_link
from lightning_p2r.planning.search import SearchSpace
from lightning_p2r.planning.share import rank_share, sharded_numel
from lightning_p2r.planning.step_time import bubble_fraction

MOE = M6Config(vocab_size=64, max_seq_len=16, num_layers=4, dim=32, num_heads=4, num_experts=4, num_prototypes=2,
               moe_layers=[1, 3], attention="alternating", sparse_window=4)
DENSE = M6Config(vocab_size=64, max_seq_len=16, num_layers=4, dim=32, num_heads=4, moe_layers=[])
WORK = Workload(global_batch=8, seq_len=16)


def cluster(devices: int = 2, **changes) -> Cluster:
    return Cluster(devices=devices, devices_per_node=min(devices, 8), **changes)


# ------------------------------------------------------------------------------------------------ cluster file
@pytest.mark.parametrize(("text", "unit", "value"), [
    ("32GB", "", 32e9), ("24GiB", "", 24 * 2**30), ("12.5GB/s", "", 12.5e9), ("125T", "", 125e12),
    ("125TFLOP/s", "", 125e12), ("1e12", "", 1e12), (7, "", 7.0), ("5us", "s", 5e-6), ("2ms", "s", 2e-3),
])
def test_quantities_read_with_their_units(text, unit, value) -> None:
    assert parse_quantity(text, "x", unit=unit) == pytest.approx(value)


@pytest.mark.parametrize(("text", "value"), [
    ("200Gbit/s", 25e9), ("400 Gbit/s", 50e9), ("100Gbps", 12.5e9), ("100gbps", 12.5e9), ("8Mbits/s", 1e6),
    ("64kbit", 8e3), ("1Gibit/s", 2**30 / 8), ("25GB/s", 25e9), ("25 GB/s", 25e9), ("2bytes/s", 2.0),
])
def test_bit_rates_convert_exactly_to_bytes(text, value) -> None:
    # a network's datasheet speed is in bits; read as bytes it priced every inter-node collective 8x too fast
    assert parse_quantity(text, "inter_node_bandwidth") == value


@pytest.mark.parametrize(("text", "hint"), [
    ("200Gb/s", "write 200Gbit/s for bits (read as 25GB/s) or 200GB/s for bytes"),
    ("200gb/s", "write 200Gbit/s for bits (read as 25GB/s) or 200GB/s for bytes"),
    ("200Gb/S", "write 200Gbit/s for bits (read as 25GB/s) or 200GB/s for bytes"),
    ("80Gb", "write 80Gbit for bits (read as 10GB) or 80GB for bytes"),
    ("12.5GBps", "write 12.5Gbit/s for bits (read as 1.5625GB/s) or 12.5GB/s for bytes"),
    ("10GBPS", "write 10Gbit/s for bits (read as 1.25GB/s) or 10GB/s for bytes"),
])
def test_ambiguous_bit_or_byte_units_are_refused_with_both_readings(text, hint) -> None:
    with pytest.raises(ValueError, match="ambiguous") as error:
        cluster_from_dict({"inter_node_bandwidth": text}, source="my.yaml")
    assert str(error.value).startswith(f"my.yaml: inter_node_bandwidth: {text!r} is ambiguous")
    assert hint in str(error.value)


def test_an_unknown_unit_names_the_field_value_and_the_accepted_units() -> None:
    with pytest.raises(ValueError) as error:
        cluster_from_dict({"inter_node_bandwidth": "25GB/min"}, source="my.yaml")
    assert str(error.value).startswith("my.yaml: inter_node_bandwidth: unknown unit in '25GB/min' (use B or B/s for "
                                       "bytes, bit/s or bps for bits (divided by 8)")


@pytest.mark.parametrize(("field", "text", "found", "expected"), [
    ("device_memory", "80GB/s", "bytes/s", "bytes (for example 80GB)"),
    ("host_memory_per_node", "1TFLOP/s", "FLOP/s", "bytes"),
    ("inter_node_bandwidth", "400TFLOP/s", "FLOP/s", "bytes/s (for example 25GB/s or 200Gbit/s)"),
    ("memory_bandwidth", "2TB", "bytes", "bytes/s"),
    ("device_flops", "80GB", "bytes", "FLOP/s (for example 400TFLOP/s or 400T)"),
    ("attention_flops", "200Gbit/s", "bytes/s", "FLOP/s"),
    ("device_memory", "80G/s", "bytes/s or FLOP/s", "bytes"),
])
def test_a_unit_of_another_kind_than_the_fields_is_refused(field, text, found, expected) -> None:
    """A size where a rate belongs (or a compute rate where a byte rate does) was read by its number alone."""
    with pytest.raises(ValueError) as error:
        cluster_from_dict({field: text}, source="my.yaml")
    assert str(error.value).startswith(f"my.yaml: {field}: {text!r} is in {found}, where this field holds {expected}")


@pytest.mark.parametrize(("field", "text", "value"), [
    ("device_memory", "80G", 80e9), ("device_memory", "64Gbit", 8e9), ("device_flops", "400T", 400e12),
    ("device_flops", "400TFLOPS", 400e12), ("device_flops", "1e12/s", 1e12), ("memory_bandwidth", "2T/s", 2e12),
    ("cpu_oversubscription", 1.5, 1.5),
])
def test_a_prefix_alone_or_a_unit_of_the_fields_kind_is_read(field, text, value) -> None:
    assert getattr(cluster_from_dict({field: text}), field) == value


@pytest.mark.parametrize(("values", "message"), [
    ({"device_memory": "-1GB"}, "cannot read"),
    ({"device_memory": -5}, "device_memory must be > 0"),
    ({"device_flops": 0}, "device_flops must be > 0"),
    ({"devices": 12, "devices_per_node": 8}, "multiple of devices_per_node"),
    ({"devices": 0}, "devices must be a positive integer"),
    ({"device_memry": "1GB"}, "unknown field(s) ['device_memry']"),
    ({"inter_node_bandwidth": "fast"}, "cannot read 'fast'"),
    ({"collective_factors": {"gather": 1.0}}, "collective_factors must map"),
    ({"overlap_copies": "yes"}, "overlap_copies must be true or false"),
])
def test_bad_cluster_values_are_refused_by_name(values, message) -> None:
    with pytest.raises(ValueError, match="the cluster") as error:
        cluster_from_dict(values)
    assert message in str(error.value)


def test_cluster_file_round_trips_and_a_missing_one_is_named(tmp_path) -> None:
    original = cluster_from_dict({"name": "a100", "devices": 16, "devices_per_node": 8, "device_memory": "80GB",
                                  "intra_node_latency": "5us", "collective_factors": {"all_gather": 0.5}})
    path = tmp_path / "cluster.yaml"
    write_cluster(original, path, "a comment")
    assert path.read_text().startswith("# a comment\n")
    assert load_cluster(path) == original
    assert original.nodes == 2
    with pytest.raises(ValueError, match="does not exist"):
        load_cluster(tmp_path / "absent.yaml")
    (tmp_path / "bad.yaml").write_text("devices: [1,\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_cluster(tmp_path / "bad.yaml")


# ------------------------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("config", [
    MOE, DENSE, MOE.replace(tie_embeddings=False, position_embedding="learned"),
    MOE.replace(num_unique_blocks=2, sharing="cycle"), DENSE.replace(num_unique_blocks=1),
])
def test_the_parameter_inventory_is_the_real_models(config) -> None:
    with torch.device("meta"):
        model = M6Transformer(config)
    real = {name: tuple(p.shape) for name, p in model.named_parameters()}
    planned = {p.name: p.shape for p in all_params(config)}
    assert planned == real
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_attended_keys_and_flops_by_hand() -> None:
    assert attended_keys(MOE, 0, 16) == 8.5  # dense causal: (16 + 1) / 2
    # Banded (window 4): queries 0..2 see 1, 2, 3 keys, the other 13 see 4.
    assert attended_keys(MOE, 1, 16) == pytest.approx((1 + 2 + 3 + 13 * 4) / 16)
    d, h = 32, 128
    assert layer_forward_flops(DENSE, 0, 16) == 8 * d * d + 4 * 8.5 * d + 4 * d * h
    # MoE layer: router 2 d E, and 2 assignments (2 prototypes x top-1) of an expert's two matmuls.
    assert layer_forward_flops(MOE, 1, 16) == 8 * d * d + 4 * attended_keys(MOE, 1, 16) * d + 2 * d * 4 + \
        2 * 4 * d * h


def test_the_pseudo_model_shares_as_few_blocks_as_its_layers_allow() -> None:
    assert pseudo_of(DENSE).num_blocks == 1
    alternating = pseudo_of(MOE)  # MoE and dense layers alternate: one block of each, in a cycle
    assert (alternating.num_blocks, alternating.sharing) == (2, "cycle")



def test_a_shallow_pseudo_stage_is_priced_at_the_layers_it_runs() -> None:
    """Issue 30: a shallow pseudo model of U blocks runs U of the L layers, so its step computes about U / L of the
    real step's layers; a shared-depth pseudo model runs all L."""
    deep = DENSE.replace(num_layers=16, dim=256, num_heads=4)
    layout, machines = Layout(), cluster(1)
    real = estimate_step(deep, layout, machines, WORK)
    shared = estimate_step(pseudo_of(deep), layout, machines, WORK)
    shallow_config = deep.replace(num_unique_blocks=4, sharing="cycle", pseudo_depth="shallow")
    shallow = estimate_step(shallow_config, layout, machines, WORK)
    four_layers = estimate_step(deep.replace(num_layers=4), layout, machines, WORK)
    assert shallow.compute == pytest.approx(four_layers.compute)
    assert shared.compute > 0.95 * real.compute  # every layer still runs (the shared weights' cost aside)
    head = estimate_step(deep.replace(num_layers=1), layout, machines, WORK).compute * 4 / 3 - four_layers.compute / 3
    # layer compute (the step's compute less the embedding and head, which every depth pays) scales as U / L
    assert (shallow.compute - head) / (real.compute - head) == pytest.approx(4 / 16, rel=1e-6)
    assert estimate_memory(shallow_config, layout, machines, WORK).model_states < \
        estimate_memory(deep, layout, machines, WORK).model_states
    assert evaluate(shallow_config, layout, machines, WORK).step.compute == pytest.approx(four_layers.compute)
    assert pseudo_of(deep, depth="shallow").pseudo_depth == "shallow"
    assert pseudo_of(deep.replace(pseudo_depth="shallow", sharing="cycle")).pseudo_depth == "shallow"


# ------------------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize(("layout", "devices", "message"), [
    (Layout(tensor_parallel=3), 6, "tensor_parallel=3) splits attention by heads: the model's num_heads=4"),
    (Layout(tensor_parallel=4), 2, "tensor_parallel=4) must divide the number of processes (2)"),
    (Layout(expert_parallel=3), 3, "the model's num_experts=4 must be divisible"),
    (Layout(expert_parallel=4), 2, "so it must divide processes / tensor_parallel = 2 / 1 = 2"),
    (Layout(pipeline_parallel=2, stages_per_rank=3, pipeline_schedule="looped_bfs", micro_batches=2), 2,
     "4 layers cannot be cut into pipeline_parallel * stages_per_rank = 2 * 3 = 6 stages"),
    (Layout(pipeline_parallel=2, micro_batches=1), 2, "fewer than pipeline_parallel=2"),
    (Layout(pipeline_parallel=2, micro_batches=2, accumulation="layered"), 2,
     "layered accumulation is the breadth-first schedule itself"),
    (Layout(sequence_parallel=True), 2, "set tensor_parallel > 1"),
    (Layout(micro_batches=3), 2, "must divide the 4 sequences"),
    (Layout(offload_fraction=1.5), 2, "offload_fraction must be in [0, 1]"),
    (Layout(recompute=True), 1, "recompute applies to accumulation='layered' only"),
    (Layout(sharding="zero4"), 2, "sharding must be one of"),
    (Layout(stages_per_rank=2, pipeline_schedule="looped_bfs"), 2, "set pipeline_parallel > 1"),
])
def test_impossible_layouts_are_refused_with_the_numbers(layout, devices, message) -> None:
    with pytest.raises(ValueError) as error:
        check_layout(layout, MOE, cluster(devices), WORK)
    assert message in str(error.value)


def test_a_pseudo_model_cannot_share_a_block_between_two_stages_of_a_rank() -> None:
    looped = Layout(pipeline_parallel=2, stages_per_rank=2, pipeline_schedule="looped_bfs", micro_batches=2)
    check_layout(looped, DENSE, cluster(2), WORK)
    with pytest.raises(ValueError, match="shared by two stages of one pipeline rank"):
        check_layout(looped, DENSE.replace(num_unique_blocks=1), cluster(2), WORK)


def test_bad_workloads_are_refused() -> None:
    with pytest.raises(ValueError, match="global_batch must be a positive integer"):
        Workload(global_batch=0, seq_len=16)
    with pytest.raises(ValueError, match="precision"):
        Workload(global_batch=8, seq_len=16, precision="fp8")


def test_the_strategy_options_of_a_layout() -> None:
    layout = Layout(sharding="zero3", pipeline_parallel=2, pipeline_schedule="looped_bfs", stages_per_rank=2,
                    micro_batches=4, accumulation="layered", offload_fraction=0.25)
    assert layout.strategy_options() == {"sharding": "zero3", "pipeline_parallel": 2,
                                         "pipeline_schedule": "looped_bfs", "stages_per_rank": 2,
                                         "accumulation": "layered", "micro_batches": 4, "offload_fraction": 0.25}
    assert layout.describe() == "zero3 pp2 looped_bfs/v2 m4 layered offload0.25"


# ----------------------------------------------------------------------------------------------------- network
def test_ring_formulas_by_hand() -> None:
    link = Link(bandwidth=10.0, latency=1.0)
    assert collective_seconds("all_reduce", 40.0, 4, link) == 2 * 3 / 4 * 4.0 + 6
    assert collective_seconds("all_gather", 40.0, 4, link, calls=2) == 3 / 4 * 4.0 + 2 * 3
    assert collective_seconds("send", 40.0, 2, link) == 4.0 + 1
    assert collective_seconds("all_reduce", 40.0, 1, link) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_seconds("gossip", 1.0, 2, link)
    with pytest.raises(ValueError, match="must be >= 0"):
        collective_seconds("all_reduce", -1.0, 2, link)


def test_each_collective_kind_gets_its_latency_and_bandwidth_from_several_sizes() -> None:
    from lightning_p2r.measure.collective_probes import collective_fit, collective_sizes

    payloads = [256.0, 65536.0, 4194304.0]
    # All-to-all over 4 ranks at 1 GB/s bus bandwidth and 50 us per ring step: (3/4) p / 1e9 + 3 * 50e-6.
    seconds = [0.75 * p / 1e9 + 3 * 50e-6 for p in payloads]
    bandwidth, latency = collective_fit("all_to_all", 4, payloads, seconds)
    assert (bandwidth, latency) == (pytest.approx(1e9), pytest.approx(50e-6))
    bandwidth, latency = collective_fit("all_reduce", 2, payloads, [p / 2e9 + 2 * 10e-6 for p in payloads])
    assert (bandwidth, latency) == (pytest.approx(2e9), pytest.approx(10e-6))
    assert collective_fit("broadcast", 2, [1.0, 2.0], [0.5, 0.4]) == (pytest.approx(5.0), pytest.approx(0.4))
    with pytest.raises(ValueError, match="two or more different payloads"):
        collective_fit("all_reduce", 2, [4.0, 4.0], [1.0, 1.0])
    assert all(size % 3 == 0 for size in collective_sizes(False, 3)) and collective_sizes(True, 2)[0] == 2


def test_the_latency_is_the_mean_small_call_over_its_ring_steps() -> None:
    from lightning_p2r.measure.collective_probes import latency_per_step

    # A 4-rank all-reduce has 2 (4 - 1) = 6 latency steps, a 2-rank one 2; a broadcast over 4 has 3.
    assert latency_per_step(6e-3, "all_reduce", 4) == pytest.approx(1e-3)
    assert latency_per_step(1e-3, "all_reduce", 2) == pytest.approx(5e-4)
    assert latency_per_step(3e-3, "broadcast", 4) == pytest.approx(1e-3)
    assert latency_per_step(1e-3, "all_reduce", 1) == 1e-3  # no steps: the call itself
    with pytest.raises(ValueError, match="seconds_per_call"):
        latency_per_step(-1.0, "all_reduce", 2)


def test_ddp_all_reduces_its_gradients_in_buckets() -> None:
    from lightning_p2r.planning.transfers import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, ddp_bucket_calls

    assert ddp_bucket_calls(0) == 0 and ddp_bucket_calls(1) == 1 and ddp_bucket_calls(DDP_FIRST_BUCKET_BYTES) == 1
    assert ddp_bucket_calls(DDP_FIRST_BUCKET_BYTES + 1) == 2
    assert ddp_bucket_calls(DDP_FIRST_BUCKET_BYTES + DDP_BUCKET_BYTES + 1) == 3

    def reduces(layout: Layout) -> tuple[int, float]:
        found = [t for t in step_transfers(DENSE, layout, cluster(2), WORK) if t.kind == "all_reduce"]
        return sum(t.calls for t in found), sum(t.payload for t in found)

    # DDP (standard accumulation, sharding "none"): the same bytes as FSDP2's replicate layout (layered
    # accumulation), one call per bucket instead of one per unit (4 blocks and the root).
    ddp, replicate = reduces(Layout()), reduces(Layout(accumulation="layered", micro_batches=2))
    assert ddp[1] == replicate[1] and replicate[0] == 4 + 1
    assert ddp[0] == ddp_bucket_calls(ddp[1]) < replicate[0]


def test_a_group_crosses_the_network_when_its_span_exceeds_a_node() -> None:
    many = Cluster(devices=16, devices_per_node=8, intra_node_bandwidth=100.0, inter_node_bandwidth=10.0)
    assert group_link(many, 8, 1).bandwidth == 100.0  # tensor parallel inside a node
    assert group_link(many, 2, 8).bandwidth == 10.0  # data parallel 8 devices apart: two nodes


# ------------------------------------------------------------------------------------------ memory and traffic
def test_model_states_follow_the_zero_accounting() -> None:
    elements = parameter_count(DENSE)
    whole = estimate_memory(DENSE, Layout(), cluster(2), WORK)
    assert (whole.params, whole.grads, whole.optimizer) == (4 * elements, 4 * elements, 8 * elements)
    zero1 = estimate_memory(DENSE, Layout(sharding="zero1"), cluster(2), WORK)
    assert (zero1.params, zero1.optimizer) == (4 * elements, 4 * elements)
    zero3 = estimate_memory(DENSE, Layout(sharding="zero3"), cluster(2), WORK)
    assert zero3.params == 2 * elements and zero3.optimizer == 4 * elements  # every dim 0 here is even
    assert zero3.gathered > 0 and whole.gathered == 0


def test_fsdp_pads_dim_zero_to_the_ranks() -> None:
    assert sharded_numel((10, 3), 4) == 3 * 3
    assert sharded_numel((8, 3), 4) == 2 * 3


def test_offloaded_blocks_move_their_states_to_the_host_and_stream_back() -> None:
    offloaded = Layout(offload_fraction=0.5)
    share = rank_share(DENSE, offloaded, cluster(1), WORK)
    assert share.offloaded == (1, 3)  # the offload plan's spread: the last block among them
    memory = estimate_memory(DENSE, offloaded, cluster(1), WORK)
    block = sum(p.numel for p in all_params(DENSE) if p.block == 1)
    assert memory.host == 2 * block * (4 + 4 + 8)
    copies = bytes_by_kind(step_transfers(DENSE, offloaded.__class__(offload_fraction=0.5, micro_batches=2),
                                          cluster(1), WORK))
    # Standard accumulation: each offloaded block comes in for forward and backward of each of 2 micro-batches.
    assert copies == {"h2d": 2 * 2 * 2 * block * 4, "d2h": 2 * 2 * block * 4}


def test_zero3_gathers_per_micro_batch_unless_layered() -> None:
    def gathers(layout: Layout, devices: int = 2) -> int:
        return sum(t.calls for t in step_transfers(DENSE, layout, cluster(devices), WORK) if t.kind == "all_gather")

    assert gathers(Layout(sharding="zero3")) == 2 * 4 + 1
    assert gathers(Layout(sharding="zero3", micro_batches=2)) == 2 * (2 * 4 + 1)
    assert gathers(Layout(sharding="zero3", micro_batches=2, accumulation="layered")) == 2 * 4 + 1
    assert gathers(Layout(sharding="zero2", micro_batches=2)) == 2 * (4 + 1)
    # Pipelines: breadth-first gathers a block once per direction, depth-first before each forward and once back.
    bfs = Layout(sharding="zero3", pipeline_parallel=2, pipeline_schedule="looped_bfs", stages_per_rank=2,
                 micro_batches=4, accumulation="layered")
    one = Layout(sharding="zero3", pipeline_parallel=2, micro_batches=4)
    assert gathers(bfs, 4) == 2 * 2 + 1  # rank 0: two one-block stages, each block out and back; the embedding
    assert gathers(one, 4) == 2 * (4 + 1) + 1  # two blocks, before each of 4 forwards and once for the backwards


def test_pipeline_sends_by_stage_position() -> None:
    layout = Layout(pipeline_parallel=2, micro_batches=2)
    per_send = 4 * 16 * 32 * 4  # a micro-batch of 4 sequences x 16 tokens x dim 32, fp32
    first = bytes_by_kind(step_transfers(DENSE, layout, cluster(2), WORK, pipeline_rank=0))
    last = bytes_by_kind(step_transfers(DENSE, layout, cluster(2), WORK, pipeline_rank=1))
    assert first["send"] == last["send"] == 2 * per_send  # forward out of stage 0, backward out of stage 1


def test_activations_in_flight_per_schedule() -> None:
    assert micro_batches_in_flight(Layout(micro_batches=4)) == 1
    assert micro_batches_in_flight(Layout(micro_batches=4, accumulation="layered")) == 4
    assert micro_batches_in_flight(Layout(pipeline_parallel=2, micro_batches=8)) == 2
    assert micro_batches_in_flight(Layout(pipeline_parallel=2, micro_batches=8, pipeline_schedule="gpipe")) == 8
    plain = estimate_memory(DENSE, Layout(micro_batches=2, accumulation="layered"), cluster(1), WORK)
    recomputed = estimate_memory(DENSE, Layout(micro_batches=2, accumulation="layered", recompute=True),
                                 cluster(1), WORK)
    assert recomputed.activations < plain.activations


# ------------------------------------------------------------------------------------------------- step time
def test_the_bubble_by_schedule() -> None:
    assert bubble_fraction(Layout(pipeline_parallel=4, micro_batches=8)) == pytest.approx(3 / 11)
    assert bubble_fraction(Layout(pipeline_parallel=4, micro_batches=8, stages_per_rank=2,
                                  pipeline_schedule="interleaved_1f1b")) == pytest.approx(3 / 19)
    pipelined = estimate_step(DENSE, Layout(pipeline_parallel=2, micro_batches=2), cluster(2), WORK)
    assert pipelined.bubble == pytest.approx(pipelined.compute * 1 / 2)


def test_overlap_hides_data_parallel_traffic_behind_compute() -> None:
    slow_network = {"intra_node_bandwidth": 1e9}
    hidden = estimate_step(DENSE, Layout(sharding="zero3"), cluster(2, **slow_network), WORK)
    exposed = estimate_step(DENSE, Layout(sharding="zero3"), cluster(2, overlap_collectives=False, **slow_network),
                            WORK)
    assert hidden.data_parallel < exposed.data_parallel
    assert hidden.compute == exposed.compute


def test_tensor_parallelism_splits_the_compute() -> None:
    one = estimate_step(MOE, Layout(), cluster(1, operator_overhead=0.0), WORK)
    split = estimate_step(MOE, Layout(tensor_parallel=2), cluster(2, operator_overhead=0.0), WORK)
    assert split.compute < one.compute and split.tensor_parallel > 0


def test_each_matmul_call_pays_the_matmul_overhead_per_micro_batch_and_pass() -> None:
    """Dense: 4 layers of 4 matmuls and the head; MoE: layers 1 and 3 add the router and two per expert. Forward and
    the two gradients, per micro-batch, and one more forward of the blocks' under recompute (the head's too: the
    count is per layer of the rank, the head on the last stage, as the launches are)."""
    from lightning_p2r.planning.model import layer_matmuls

    assert [layer_matmuls(MOE, layer) for layer in range(4)] == [4, 11, 4, 11]
    assert layer_matmuls(MOE, 1, local_experts=2) == 7
    base = cluster(1, matmul_overhead=0.0)
    for config, matmuls in ((DENSE, 4 * 4 + 1), (MOE, 4 + 11 + 4 + 11 + 1)):
        for layout, passes in ((Layout(micro_batches=2), 3 * 2), (Layout(micro_batches=2, recompute=True), 4 * 2)):
            without = estimate_step(config, layout, base, WORK)
            with_cost = estimate_step(config, layout, cluster(1, matmul_overhead=1e-3), WORK)
            assert with_cost.compute - without.compute == pytest.approx(passes * matmuls * 1e-3)


def test_a_linear_layers_fixed_cost_is_the_intercept_of_its_time_in_the_rows() -> None:
    from lightning_p2r.measure.device_probes import line_fit

    rows = [16, 32, 64, 128]
    # 90 us at no rows, 4 us per row.
    assert line_fit(rows, [(90 + 4 * r) * 1e-6 for r in rows]) == (pytest.approx(90e-6), pytest.approx(4e-6))
    with pytest.raises(ValueError, match="two or more"):
        line_fit([16, 16], [1.0, 2.0])


def test_the_matmul_costs_split_a_calls_fixed_cost_from_its_weights_traffic_in_the_caches() -> None:
    from lightning_p2r.measure.device_probes import WEIGHT_PASSES, matmul_costs

    operator = 2e-6
    sizes = [16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024]
    # Each call: 3 launches, 3 matmul calls of 6 us, and five passes over the weight at 80 GB/s.
    intercepts = [3 * operator + 3 * 6e-6 + WEIGHT_PASSES * size / 80e9 for size in sizes]
    costs = matmul_costs(sizes, intercepts, operator, bandwidth=20e9)
    assert costs["matmul_overhead"] == pytest.approx(6e-6)
    assert costs["memory_small_bandwidth"] == pytest.approx(80e9)
    # The caches are never read as slower than memory beyond them.
    assert matmul_costs(sizes, intercepts, operator, bandwidth=100e9)["memory_small_bandwidth"] == 100e9
    # Launches priced above the intercept: no negative call cost.
    assert matmul_costs(sizes, intercepts, 20e-6, bandwidth=20e9)["matmul_overhead"] == 0.0
    # No growth with the weight (noise): the cache's rate stays unmeasured, the call's cost is read against memory's.
    flat = matmul_costs(sizes, [40e-6] * 4, operator, bandwidth=100e9)
    assert flat["memory_small_bandwidth"] == 0.0
    assert flat["matmul_overhead"] == pytest.approx((40e-6 - 3 * operator - WEIGHT_PASSES * sizes[2] / 100e9) / 3)
    assert flat["matmul_overhead"] > 0


def test_the_batch_overhead_is_the_added_batches_time_beyond_their_modelled_work() -> None:
    from lightning_p2r.measure.step_overhead import STEP_OVERHEAD_MODEL, batch_call_overhead, modelled_added_batches

    # 10 ms for one batch, 31 ms for four, of which the model prices 6 ms of work: 5 ms per added batch.
    assert batch_call_overhead(0.010, 0.031, 4, 0.006) == pytest.approx(0.005)
    assert batch_call_overhead(0.010, 0.012, 4, 0.006) == 0.0  # noise never makes it negative
    with pytest.raises(ValueError, match="at least 2 batches"):
        batch_call_overhead(0.01, 0.01, 1, 0.0)
    # The model's work for the added batches: three more forward and backward passes of the tiny model, and no
    # framework term that a fresh calibration has not yet measured.
    plain = cluster(2)
    added = modelled_added_batches(plain, 4)
    one = estimate_step(M6Config(**STEP_OVERHEAD_MODEL), Layout(), plain,
                        Workload(global_batch=4, seq_len=STEP_OVERHEAD_MODEL["max_seq_len"])).compute
    assert added == pytest.approx(3 * one, rel=0.2)
    assert modelled_added_batches(dataclasses.replace(plain, batch_overhead=0.1), 4) == pytest.approx(added + 0.3)


# ------------------------------------------------------------------------------------------------------ search
def test_the_search_ranks_fitting_layouts_fastest_first() -> None:
    plans, priced = search(MOE, cluster(4), WORK, SearchSpace(offload_fractions=(0.0, 0.5)))
    assert plans and priced >= len(plans)
    totals = [p.step.total for p in plans]
    assert totals == sorted(totals)
    assert all(p.fits for p in plans)


def test_a_device_too_small_for_the_model_leaves_only_offloaded_layouts_or_none() -> None:
    states = parameter_count(DENSE) * 16
    tight = cluster(1, device_memory=states * 0.6)
    plans, _ = search(DENSE, tight, WORK, SearchSpace(offload_fractions=(0.0, 0.5, 1.0)))
    assert plans and all(p.layout.offload_fraction > 0 for p in plans)
    none, _ = search(DENSE, cluster(1, device_memory=1e3), WORK)
    assert none == []
    too_big = evaluate(DENSE, Layout(), cluster(1, device_memory=1e3), WORK)
    assert not too_big.fits and "device memory" in too_big.reason


def test_a_pseudo_layout_must_fit_the_delinked_model_too() -> None:
    pseudo = DENSE.replace(num_unique_blocks=1)
    real = evaluate(DENSE, Layout(), cluster(1), WORK)
    assert evaluate(pseudo, Layout(), cluster(1), WORK).memory.device_total == real.memory.device_total
    # The same FLOPs; fewer parameters to accumulate gradients into and to step.
    shared, whole = (estimate_step(c, Layout(), cluster(1), WORK) for c in (pseudo, DENSE))
    assert math.isclose(shared.compute, whole.compute, rel_tol=1e-3) and shared.optimizer < whole.optimizer


def test_every_searched_layout_is_one_the_strategy_accepts() -> None:
    """The search's layouts print as ``P2RStrategy`` keywords (plus the Trainer's accumulation for standard
    accumulation), and the strategy takes each of them."""
    from lightning_p2r import P2RStrategy

    plans, _ = search(MOE, cluster(4), WORK, SearchSpace(offload_fractions=(0.0, 0.5)))
    for plan in plans:
        options = plan.layout.strategy_options()
        P2RStrategy(**options)
        assert ("micro_batches" in options) != (plan.layout.trainer_accumulation > 1 or plan.layout.micro_batches
                                                 == 1 and plan.layout.pipeline_parallel == 1)


def test_the_fragment_counts_the_batch_over_every_node() -> None:
    from lightning_p2r.planning.cli import strategy_fragment

    plan = evaluate(DENSE, Layout(sharding="zero3", micro_batches=2), cluster(16), WORK.__class__(
        global_batch=64, seq_len=16))
    fragment = strategy_fragment(plan, WORK.__class__(global_batch=64, seq_len=16), cluster(16))
    assert "devices: 8" in fragment and "num_nodes: 2" in fragment
    assert "accumulate_grad_batches: 2" in fragment and "batch_size: 2  #" in fragment  # 64 / 16 ranks / 2


def test_every_cluster_field_is_documented() -> None:
    import dataclasses
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "planning.md").read_text()
    missing = [f.name for f in dataclasses.fields(Cluster) if f"`{f.name}`" not in text]
    assert missing == []


def test_zero1_broadcasts_one_buffer_per_rank_over_ddp_and_each_parameter_elsewhere() -> None:
    """ZeRO-1's broadcasts after the step: over DDP's plain replicas each rank's partition moves packed, one call per
    rank; on FSDP2's replicate layout (layered accumulation here) the DTensors move one by one. Both move every
    parameter once, and the ranks wait for them once."""
    from lightning_p2r.planning.framework import blocking_collective_calls
    from lightning_p2r.planning.transfers import ZERO1_BROADCASTS

    def broadcasts(layout):
        transfers = step_transfers(DENSE, layout, cluster(2, overlap_collectives=False), WORK)
        return [t for t in transfers if t.label == ZERO1_BROADCASTS], transfers

    ddp, ddp_all = broadcasts(Layout(sharding="zero1"))
    fsdp, fsdp_all = broadcasts(Layout(sharding="zero1", accumulation="layered", micro_batches=2))
    assert Layout(sharding="zero1").path(2) == "ddp" and [t.calls for t in ddp] == [2]
    assert sum(t.calls for t in fsdp) == len(all_params(DENSE))
    assert sum(t.payload for t in ddp) == sum(t.payload for t in fsdp) == 4 * parameter_count(DENSE)
    without = [t for t in ddp_all if t.label != ZERO1_BROADCASTS]
    assert blocking_collective_calls(ddp_all, False) == blocking_collective_calls(without, False) + 1
    without = [t for t in fsdp_all if t.label != ZERO1_BROADCASTS]
    assert blocking_collective_calls(fsdp_all, False) == blocking_collective_calls(without, False) + 1


def test_blocking_collectives_are_counted_on_the_critical_path_only() -> None:
    """Expert parallel 2 on 2 ranks, 2 micro-batches, MoE layers 1 and 3: 5 all-to-alls per MoE layer and
    micro-batch (counts, dispatch, combine; two more in backward), priced apart as expert waits, and 2 balance-loss
    reductions over the 2 data ranks (one in forward, one in backward). Recompute runs the forward's 3 and 1 again
    (counted on a run: the distributed ``test_planner_counts``). ZeRO-3's gathers overlap compute and are not
    counted; one process has none."""
    from lightning_p2r.planning.framework import blocking_collective_calls, expert_dispatch_calls, framework_counts

    ep2 = step_transfers(MOE, Layout(expert_parallel=2, micro_batches=2), cluster(2), WORK)
    assert expert_dispatch_calls(ep2) == 2 * 2 * 5
    assert blocking_collective_calls(ep2) == 2 * 2 * 2
    counts = framework_counts(MOE, Layout(expert_parallel=2, micro_batches=2), cluster(2), WORK)
    assert (counts["expert_wait_overhead"], counts["blocking_collective_overhead"]) == (20, 8)
    recomputed = Layout(expert_parallel=2, micro_batches=2, accumulation="layered", recompute=True)
    ep2_recompute = step_transfers(MOE, recomputed, cluster(2), WORK)
    assert expert_dispatch_calls(ep2_recompute) == 2 * 2 * 8
    assert blocking_collective_calls(ep2_recompute) == 2 * 2 * 3
    tp2 = step_transfers(DENSE, Layout(tensor_parallel=2), cluster(2), WORK)
    assert blocking_collective_calls(tp2) > 0 and expert_dispatch_calls(tp2) == 0
    # Sequence parallelism splits each sync point's all-reduce into a reduce-scatter and an all-gather (and keeps
    # all-reduces for the norms' gradients): more calls, priced by their latency, but the same waits.
    sp2 = step_transfers(DENSE, Layout(tensor_parallel=2, sequence_parallel=True), cluster(2), WORK)
    tp_calls = {t.kind: t.calls for t in sp2 if t.label == "tensor parallel"}
    assert {"all_gather", "reduce_scatter"} <= set(tp_calls) and sum(tp_calls.values()) > max(tp_calls.values())
    assert blocking_collective_calls(sp2) == blocking_collective_calls(tp2) == max(tp_calls.values())
    assert blocking_collective_calls(step_transfers(DENSE, Layout(sharding="zero3"), cluster(2), WORK)) == 0
    assert framework_counts(DENSE, Layout(), cluster(1), WORK)["blocking_collective_overhead"] == 0


def test_a_pipelines_stage_time_terms_repeat_in_its_idle_time() -> None:
    """Under a pipeline the per-micro-batch terms (hooked modules, stage actions, pipeline sends' waits) are part of a
    stage-time, which the fill and drain idle for: their counts are the plain counts times 1 / (1 - idle), with
    idle = (p - 1) / (v m + p - 1). The waits run once per step (the pipeline replicas' reduction) are not
    stretched, and nothing is on a CPU running more processes than cores, nor without a pipeline."""
    from lightning_p2r.planning.framework import (
        blocking_collective_calls,
        framework_counts,
        hooked_module_passes,
        pipeline_stage_actions,
        pipeline_stretch,
    )
    from lightning_p2r.planning.share import rank_share

    layout = Layout(sharding="zero2", pipeline_parallel=2, micro_batches=2)
    machine = cluster(2, overlap_collectives=False)
    stretch = 1 / (1 - 1 / 3)  # p = 2, m = 2: idle (2 - 1) / (2 + 2 - 1)
    assert pipeline_stretch(layout) == pytest.approx(stretch)
    counts = framework_counts(DENSE, layout, machine, WORK)
    share = rank_share(DENSE, layout, machine, WORK)
    assert counts["stage_overhead"] == pytest.approx(stretch * pipeline_stage_actions(layout))
    assert counts["module_hook_overhead"] == pytest.approx(stretch * hooked_module_passes(layout, share, 2))
    transfers = step_transfers(DENSE, layout, machine, WORK, pipeline_rank=0)
    sends = blocking_collective_calls([t for t in transfers if t.label == "pipeline"], False)
    once = blocking_collective_calls([t for t in transfers if t.label != "pipeline"], False)
    assert sends == 2 and once >= 1  # one send per micro-batch; the replicas' reduction once per step
    assert counts["blocking_collective_overhead"] == pytest.approx(stretch * sends + once)
    # An oversubscribed CPU (4 processes on 2 cores) counts each once, stretched by the oversubscription only.
    crowded = framework_counts(DENSE, layout, dataclasses.replace(machine, cpu_oversubscription=2.0), WORK)
    assert crowded["stage_overhead"] == pytest.approx(2.0 * pipeline_stage_actions(layout))
    assert crowded["module_hook_overhead"] == hooked_module_passes(layout, share, 2)
    # More micro-batches, less idle: the stretch shrinks toward 1.
    assert pipeline_stretch(dataclasses.replace(layout, micro_batches=16)) == pytest.approx(17 / 16)
    assert pipeline_stretch(Layout(micro_batches=4)) == 1.0


def test_with_one_data_parallel_rank_the_zero_stages_are_one_row() -> None:
    """One device (or all devices in one tensor-parallel group) leaves ZeRO nothing to shard: the plan lists that
    layout once, at its fastest stage, while with two data-parallel ranks the stages stay apart."""
    from lightning_p2r.planning.search import equivalence_key

    one, _ = search(DENSE, cluster(1), WORK, SearchSpace(offload_fractions=(0.0,)))
    keys = [equivalence_key(p.layout, 1) for p in one]
    assert one and len(keys) == len(set(keys))
    assert {p.layout.micro_batches for p in one} == {k.micro_batches for k in keys}
    two, _ = search(DENSE, cluster(2), WORK, SearchSpace(offload_fractions=(0.0,)))
    data_parallel = [p.layout for p in two if p.layout.data_parallel(2) == 2]
    assert len({layout.sharding for layout in data_parallel}) > 1
    assert equivalence_key(Layout(sharding="zero3", tensor_parallel=2), 2) == Layout(tensor_parallel=2)
    assert equivalence_key(Layout(sharding="zero3"), 2) == Layout(sharding="zero3")
