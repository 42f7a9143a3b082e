"""The planner prices a layer's fixed cost and its elementwise traffic from what ``calibrate`` measures on the
package's own model (issue 41 item 1: small layers cost several times their operator count on a CPU; activations a
CPU's caches hold move several times faster than large ones); a file without those measurements is priced as
before."""

import dataclasses
import math

import pytest
import torch

from lightning_p2r.measure.layer_probes import (
    LAYER_PROBE,
    LAYER_SECONDS,
    TOKEN_PROBE_SEQUENCES,
    TOKEN_PROBE_WIDTHS,
    expert_weight_overhead,
    layer_overheads,
    layer_seconds_name,
    token_overheads,
)
from lightning_p2r.models.config import M6Config
from lightning_p2r.models.transformer import M6Transformer
from lightning_p2r.planning.cluster import (
    ELEMENTWISE_LARGE_BYTES,
    ELEMENTWISE_SMALL_BYTES,
    MEMORY_LARGE_BYTES,
    MEMORY_SMALL_BYTES,
    Cluster,
)
from lightning_p2r.planning.layout import Layout, Workload
from lightning_p2r.planning.share import rank_share
from lightning_p2r.planning.step_time import compute_seconds, estimate_step, fixed_layer_seconds

CPU = Cluster(accelerator="cpu", devices=1, devices_per_node=1, overlap_collectives=False, overlap_copies=False,
              operator_overhead=4e-6)
MOE = M6Config(vocab_size=256, max_seq_len=64, num_layers=4, dim=32, num_heads=4, num_experts=8,
               moe_layers=[1, 3], capacity_factor=None)
WORKLOAD = Workload(global_batch=4, seq_len=64)


def _fixed(cluster: Cluster) -> float:
    share = rank_share(MOE, Layout(), cluster, WORKLOAD, 0)
    return fixed_layer_seconds(MOE, share, cluster, MOE.num_experts, grouped=False)


def test_a_file_without_layer_costs_prices_operators_as_before() -> None:
    from lightning_p2r.planning.model import layer_operator_launches

    launches = sum(layer_operator_launches(MOE, layer) for layer in range(MOE.num_layers)) + 10
    assert _fixed(CPU) == pytest.approx(launches * CPU.operator_overhead)


def test_measured_layer_costs_price_each_layer_by_its_kind_and_experts() -> None:
    measured = dataclasses.replace(CPU, dense_layer_overhead=3e-4, moe_layer_overhead=6e-4, moe_expert_overhead=5e-5)
    per_pass = (2 * 3e-4 + 2 * (6e-4 + 8 * 5e-5)) / 3 + 10 * CPU.operator_overhead
    assert _fixed(measured) == pytest.approx(per_pass)
    # An expert-parallel rank computes its own experts only.
    two = dataclasses.replace(measured, devices=2, devices_per_node=2)
    share = rank_share(MOE, Layout(expert_parallel=2), two, WORKLOAD, 0)
    assert fixed_layer_seconds(MOE, share, two, 4, grouped=False) == pytest.approx(
        (2 * 3e-4 + 2 * (6e-4 + 4 * 5e-5)) / 3 + 10 * CPU.operator_overhead)
    # The step: forward, backward at twice its launches, per micro-batch; recompute adds a forward.
    step = estimate_step(MOE, Layout(micro_batches=2), measured, WORKLOAD).compute
    again = estimate_step(MOE, Layout(micro_batches=2), dataclasses.replace(measured, moe_expert_overhead=6e-5),
                          WORKLOAD).compute
    assert again - step == pytest.approx(3 * 2 * (2 * 8 * 1e-5) / 3)


def test_elementwise_bandwidth_moves_between_the_two_measured_sizes() -> None:
    cluster = dataclasses.replace(CPU, elementwise_bandwidth=4e9, elementwise_small_bandwidth=16e9)
    assert cluster.elementwise_bandwidth_at(ELEMENTWISE_SMALL_BYTES / 8) == pytest.approx(16e9)
    assert cluster.elementwise_bandwidth_at(ELEMENTWISE_SMALL_BYTES) == pytest.approx(16e9)
    assert cluster.elementwise_bandwidth_at(ELEMENTWISE_LARGE_BYTES * 4) == pytest.approx(4e9)
    middle = math.sqrt(ELEMENTWISE_SMALL_BYTES * ELEMENTWISE_LARGE_BYTES)
    assert cluster.elementwise_bandwidth_at(middle) == pytest.approx(8e9)
    assert CPU.elementwise_bandwidth_at(123.0) == CPU.elementwise_bandwidth  # unmeasured: one figure for all


def test_small_activations_are_priced_faster_than_large_ones_only_when_measured() -> None:
    measured = dataclasses.replace(CPU, elementwise_bandwidth=4e9, elementwise_small_bandwidth=16e9)
    small, large = Workload(global_batch=2, seq_len=64), Workload(global_batch=2048, seq_len=64)
    ratio = [estimate_step(MOE, Layout(), measured, w).compute / estimate_step(MOE, Layout(), CPU, w).compute
             for w in (small, large)]
    assert ratio[0] < ratio[1]


def test_memory_bandwidth_moves_between_the_caches_and_memory_by_the_working_set() -> None:
    cluster = dataclasses.replace(CPU, memory_bandwidth=20e9, memory_small_bandwidth=80e9)
    assert cluster.memory_bandwidth_at(MEMORY_SMALL_BYTES / 4) == pytest.approx(80e9)
    assert cluster.memory_bandwidth_at(MEMORY_LARGE_BYTES * 2) == pytest.approx(20e9)
    assert cluster.memory_bandwidth_at(math.sqrt(MEMORY_SMALL_BYTES * MEMORY_LARGE_BYTES)) == pytest.approx(40e9)
    assert CPU.memory_bandwidth_at(1.0) == CPU.memory_bandwidth  # unmeasured: one figure for all


def test_a_small_models_weight_traffic_is_priced_at_the_caches_rate_per_micro_batch() -> None:
    slow = dataclasses.replace(CPU, memory_bandwidth=10e9)
    cached = dataclasses.replace(slow, memory_small_bandwidth=40e9)
    layout = Layout(micro_batches=4)
    share = rank_share(MOE, layout, slow, WORKLOAD)
    weight_bytes = sum(p.numel() for p in M6Transformer(MOE).parameters()) * WORKLOAD.param_bytes
    assert 2 * weight_bytes < MEMORY_SMALL_BYTES  # the caches hold this model's weights and gradients
    saved = compute_seconds(MOE, layout, slow, WORKLOAD, share) - compute_seconds(MOE, layout, cached, WORKLOAD, share)
    # Five passes over the weights per micro-batch, at a quarter of the time.
    assert saved == pytest.approx(4 * 5 * weight_bytes * (1 / 10e9 - 1 / 40e9), rel=0.02)


def test_each_token_of_each_layer_pays_its_kinds_per_token_cost_in_every_pass() -> None:
    costs = {"dense_token_overhead": 2e-6, "moe_token_overhead": 5e-6, "dense_token_width_overhead": 1e-8,
             "moe_token_width_overhead": 3e-8}
    measured = dataclasses.replace(CPU, **costs)
    tokens = WORKLOAD.global_batch * WORKLOAD.seq_len
    dense, moe = 2e-6 + 1e-8 * MOE.dim, 5e-6 + 3e-8 * MOE.dim
    per_pass = tokens * (2 * dense + 2 * moe)  # MOE: layers 0 and 2 dense, 1 and 3 MoE
    for layout, passes in ((Layout(), 3), (Layout(micro_batches=2), 3), (Layout(recompute=True), 4)):
        added = (estimate_step(MOE, layout, measured, WORKLOAD).compute
                 - estimate_step(MOE, layout, CPU, WORKLOAD).compute)
        assert added == pytest.approx(per_pass * passes / 3)


def _probe_layer_seconds(cluster: Cluster, experts: int, sequences: int, width: int) -> float:
    """One probe layer's forward and backward as the cost model prices it (with the cluster's token costs)."""
    moe = {"num_experts": experts, "moe_layers": None} if experts else {"moe_layers": []}
    workload = Workload(global_batch=sequences, seq_len=LAYER_PROBE["max_seq_len"])

    def compute(layers: int) -> float:
        config = M6Config(**LAYER_PROBE | {"dim": width, "num_heads": width // 8}, num_layers=layers, **moe)
        return compute_seconds(config, Layout(), cluster, workload, rank_share(config, Layout(), cluster, workload))

    return (compute(5) - compute(1)) / 4


def _timings(truth: Cluster) -> dict[str, float]:
    return {layer_seconds_name(kind, size, width): _probe_layer_seconds(truth, experts, sequences, width)
            for kind, experts in (("dense", 0), ("moe", 2))
            for size, sequences in (("one", 1), ("many", TOKEN_PROBE_SEQUENCES)) for width in TOKEN_PROBE_WIDTHS}


def test_the_per_token_costs_are_what_the_probe_layers_grew_by_beyond_the_priced_terms() -> None:
    cluster = dataclasses.replace(CPU, elementwise_bandwidth=4e9, elementwise_small_bandwidth=16e9,
                                  dense_layer_overhead=3e-4, moe_layer_overhead=6e-4)
    costs = {"dense_token_overhead": 7e-7, "moe_token_overhead": 1.5e-6, "dense_token_width_overhead": 2e-8,
             "moe_token_width_overhead": 4e-8}
    truth = dataclasses.replace(cluster, **costs)
    # Timings that the cost model with the true per-token costs prices exactly: the fit reads those costs back,
    # whatever the cluster it is given already holds for them.
    layer_seconds = _timings(truth)
    assert set(layer_seconds) | {"expert_seconds_narrow", "expert_seconds_wide"} == set(LAYER_SECONDS)
    for start in (cluster, truth):
        fitted = token_overheads(start, layer_seconds)
        assert fitted == pytest.approx(costs)
    # A layer that grew by less than priced (timing noise) costs nothing per token, not a negative amount; a width
    # that costs less per token than the narrower one gives no negative slope.
    narrow, wide = TOKEN_PROBE_WIDTHS
    shrunk = layer_seconds | {layer_seconds_name("dense", "many", narrow): layer_seconds[
        layer_seconds_name("dense", "one", narrow)], layer_seconds_name("dense", "many", wide): layer_seconds[
        layer_seconds_name("dense", "one", wide)]}
    assert token_overheads(cluster, shrunk)["dense_token_overhead"] == 0.0
    cheaper_wide = _timings(dataclasses.replace(cluster, moe_token_overhead=2e-6))
    cheaper_wide[layer_seconds_name("moe", "many", wide)] -= 1e-7 * (TOKEN_PROBE_SEQUENCES - 1) * LAYER_PROBE[
        "max_seq_len"]  # 0.1 us per token less at the wider width
    flat = token_overheads(cluster, cheaper_wide)
    assert flat["moe_token_width_overhead"] == 0.0
    assert flat["moe_token_overhead"] == pytest.approx(2e-6)


def test_each_looped_expert_pays_its_weight_stacking_per_micro_batch_and_the_grouped_kernel_none() -> None:
    stacking = dataclasses.replace(CPU, moe_expert_weight_overhead=1e-9)
    per_micro_batch = 2 * MOE.num_experts * 2 * MOE.dim * MOE.hidden_dim * 1e-9  # two MoE layers of 8 experts
    for micro_batches in (1, 3):
        layout = Layout(micro_batches=micro_batches)
        added = (estimate_step(MOE, layout, stacking, WORKLOAD).compute
                 - estimate_step(MOE, layout, CPU, WORKLOAD).compute)
        assert added == pytest.approx(micro_batches * per_micro_batch)
    # An expert-parallel rank stacks its own experts; tensor parallelism splits each expert's hidden units.
    two = dataclasses.replace(stacking, devices=2, devices_per_node=2)
    for layout in (Layout(expert_parallel=2), Layout(tensor_parallel=2)):
        added = (estimate_step(MOE, layout, two, WORKLOAD).compute
                 - estimate_step(MOE, layout, dataclasses.replace(two, moe_expert_weight_overhead=0.0),
                                 WORKLOAD).compute)
        assert added == pytest.approx(per_micro_batch / 2)
    grouped = MOE.replace(expert_kernel="grouped")
    assert (estimate_step(grouped, Layout(), stacking, WORKLOAD).compute
            == pytest.approx(estimate_step(grouped, Layout(), CPU, WORKLOAD).compute))


def _probe_expert_seconds(cluster: Cluster, width: int) -> float:
    """One expert of the probe's MoE layers as the cost model prices it (16 experts less 2, over 5 layers x 14)."""
    workload = Workload(global_batch=1, seq_len=LAYER_PROBE["max_seq_len"])

    def compute(experts: int) -> float:
        config = M6Config(**LAYER_PROBE | {"dim": width, "num_heads": width // 8}, num_layers=5, num_experts=experts,
                          moe_layers=None)
        return compute_seconds(config, Layout(), cluster, workload, rank_share(config, Layout(), cluster, workload))

    return (compute(16) - compute(2)) / (5 * 14)


def test_the_expert_weight_cost_is_what_an_expert_grew_by_at_the_wider_width_beyond_the_priced_terms() -> None:
    cluster = dataclasses.replace(CPU, memory_bandwidth=40e9, moe_layer_overhead=6e-4, moe_expert_overhead=4e-5)
    truth = dataclasses.replace(cluster, moe_expert_weight_overhead=8e-10)
    timings = {"expert_seconds_narrow": _probe_expert_seconds(truth, LAYER_PROBE["dim"]),
               "expert_seconds_wide": _probe_expert_seconds(truth, TOKEN_PROBE_WIDTHS[-1])}
    for start in (cluster, truth):
        assert expert_weight_overhead(start, timings)["moe_expert_weight_overhead"] == pytest.approx(8e-10)
    cheaper = timings | {"expert_seconds_wide": timings["expert_seconds_narrow"]}
    assert expert_weight_overhead(cluster, cheaper)["moe_expert_weight_overhead"] == 0.0


@pytest.mark.parametrize("bad", [{"elementwise_small_bandwidth": -1.0}, {"memory_small_bandwidth": -1.0},
                                 {"dense_layer_overhead": -1e-3},
                                 {"moe_expert_overhead": float("nan")}, {"moe_token_overhead": -1e-6},
                                 {"moe_expert_weight_overhead": -1e-9}])
def test_bad_measured_costs_are_refused_naming_the_field(bad) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        Cluster(**bad)


@pytest.mark.slow
def test_calibrate_measures_the_layer_costs_on_the_models_own_code() -> None:
    torch.manual_seed(0)
    costs = layer_overheads(torch.device("cpu"), repeats=2)
    assert set(costs) == {"dense_layer_overhead", "moe_layer_overhead", "moe_expert_overhead",
                          "dense_checkpoint_overhead", "moe_checkpoint_overhead", "moe_expert_checkpoint_overhead",
                          *LAYER_SECONDS}
    assert costs["dense_layer_overhead"] > 0 and costs["moe_layer_overhead"] > 0 and costs["moe_expert_overhead"] >= 0
    assert costs["dense_checkpoint_overhead"] > 0 and costs["moe_checkpoint_overhead"] > 0
    # Each is a difference of two timings, so its sign is noise's on a busy machine: how the terms follow from the
    # timings is checked on a deterministic clock below; here, that the real probes run and give numbers.
    assert all(math.isfinite(value) for value in costs.values())
    fields = {key: value for key, value in costs.items() if key not in LAYER_SECONDS}
    assert Cluster(**fields).dense_layer_overhead == costs["dense_layer_overhead"]


def test_each_layer_term_is_read_off_the_difference_of_its_two_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``layer_overheads`` on a clock whose probe times follow a known law (a fixed cost per layer and kind, a cost
    per token and width unit, a cost per expert): every term it returns is that law's, the experts' cost taken out
    of the MoE layer's fixed cost."""
    from lightning_p2r.measure import layer_probes

    fixed = {"dense": 3e-4, "moe": 7e-4}
    per_token_width = {"dense": 2e-8, "moe": 5e-8}
    per_expert = {TOKEN_PROBE_WIDTHS[0]: 4e-5, TOKEN_PROBE_WIDTHS[-1]: 9e-5}  # by width
    tokens = LAYER_PROBE["max_seq_len"]

    def layer_time(kind: str, experts: int, sequences: int, width: int) -> float:
        return (fixed[kind] + per_token_width[kind] * sequences * tokens * width
                + experts * per_expert[width])

    checkpointing = {"dense": 5e-4, "moe": 9e-4, "expert": 3e-5}  # what checkpointing adds to each fixed cost

    def probe_time(name: str) -> float:
        if name.endswith("_checkpointed"):
            plain = name.removesuffix("_checkpointed")
            layers = int(plain[-1]) if plain[-1].isdigit() else 5
            experts = {"dense1": 0, "dense5": 0, "moe1": 2, "moe5": 2, "experts": 16}[plain]
            added = checkpointing["moe"] + experts * checkpointing["expert"] if experts else checkpointing["dense"]
            return probe_time(plain) + layers * added
        known = {"dense1": ("dense", 1, 0, 1, 16), "dense5": ("dense", 5, 0, 1, 16), "moe1": ("moe", 1, 2, 1, 16),
                 "moe5": ("moe", 5, 2, 1, 16), "experts": ("moe", 5, 16, 1, 16),
                 "moe5_wide": ("moe", 5, 2, 1, TOKEN_PROBE_WIDTHS[-1]),
                 "experts_wide": ("moe", 5, 16, 1, TOKEN_PROBE_WIDTHS[-1])}
        if name in known:
            kind, layers, experts, sequences, width = known[name]
        else:  # f"{kind}{layers}_{size}_{width}"
            head, size, width = name.split("_")
            kind, layers, width = head[:-1], int(head[-1]), int(width)
            experts, sequences = (2 if kind == "moe" else 0), (1 if size == "one" else TOKEN_PROBE_SEQUENCES)
        return 2e-3 + layers * layer_time(kind, experts, sequences, width)  # plus a step's fixed cost

    def fake_fastest_medians(steps, device, repeats, rounds):
        return {name: probe_time(name) for name in steps}

    monkeypatch.setattr(layer_probes, "fastest_medians", fake_fastest_medians)
    costs = layer_overheads(torch.device("cpu"), repeats=1)
    narrow = TOKEN_PROBE_WIDTHS[0]
    assert narrow == LAYER_PROBE["dim"] == 16  # the law above prices the fixed probes at this width
    assert costs["expert_seconds_narrow"] == pytest.approx(per_expert[narrow])
    assert costs["moe_expert_overhead"] == pytest.approx(per_expert[narrow])
    assert costs["expert_seconds_wide"] == pytest.approx(per_expert[TOKEN_PROBE_WIDTHS[-1]])
    assert costs["dense_layer_overhead"] == pytest.approx(layer_time("dense", 0, 1, 16))
    assert costs["moe_layer_overhead"] == pytest.approx(fixed["moe"] + per_token_width["moe"] * tokens * 16)
    for kind, experts in (("dense", 0), ("moe", 2)):
        for size, sequences in (("one", 1), ("many", TOKEN_PROBE_SEQUENCES)):
            for width in TOKEN_PROBE_WIDTHS:
                assert costs[layer_seconds_name(kind, size, width)] == pytest.approx(
                    layer_time(kind, experts, sequences, width))
    assert costs["dense_checkpoint_overhead"] == pytest.approx(checkpointing["dense"])
    assert costs["moe_checkpoint_overhead"] == pytest.approx(checkpointing["moe"])
    assert costs["moe_expert_checkpoint_overhead"] == pytest.approx(checkpointing["expert"])


def test_the_checkpointed_probe_runs_the_models_forward_and_backward_as_the_model_does() -> None:
    """``checkpointed_forward`` (each layer under the pipeline stage's checkpoint call) gives the model's own logits,
    losses and gradients: the probe times the same work, checkpointed."""
    from lightning_p2r.measure.layer_probes import checkpointed_forward

    torch.manual_seed(0)
    model = M6Transformer(MOE)
    tokens = torch.randint(0, MOE.vocab_size, (2, MOE.max_seq_len))
    grads = []
    for run in (model, lambda t: checkpointed_forward(model, t)):
        model.zero_grad()
        out = run(tokens)
        (out.logits.mean() + out.aux_loss + out.z_loss).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert out.aux_loss.item() > 0
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain)


def test_a_pipelines_recompute_is_priced_at_the_measured_checkpoint_costs_and_layered_recompute_as_a_forward() -> None:
    """A pipeline stage checkpoints each layer: with the costs ``calibrate`` measured on that call its recompute's
    fixed cost is theirs, per layer and micro-batch, in place of one more forward's; layered accumulation's recompute
    (no hooks) stays one more forward; a file without them prices both as one more forward."""
    two = dataclasses.replace(CPU, devices=2, devices_per_node=2, dense_layer_overhead=3e-4, moe_layer_overhead=6e-4,
                              moe_expert_overhead=5e-5)
    measured = dataclasses.replace(two, dense_checkpoint_overhead=8e-4, moe_checkpoint_overhead=1.5e-3,
                                   moe_expert_checkpoint_overhead=7e-5)
    workload = Workload(global_batch=8, seq_len=64)
    pipeline = Layout(pipeline_parallel=2, micro_batches=4, recompute=True)
    for rank in (0, 1):
        share = rank_share(MOE, pipeline, two, workload, rank)
        forward = fixed_layer_seconds(MOE, share, two, MOE.num_experts, grouped=False)
        checkpointed = sum(1.5e-3 + 8 * 7e-5 if MOE.is_moe_layer(layer) else 8e-4 for layer in share.layers)
        old = compute_seconds(MOE, pipeline, two, workload, share)
        new = compute_seconds(MOE, pipeline, measured, workload, share)
        assert new - old == pytest.approx(4 * (checkpointed - forward))
        assert checkpointed > forward
    layered = Layout(micro_batches=4, accumulation="layered", recompute=True)
    one, one_measured = (dataclasses.replace(c, devices=1, devices_per_node=1) for c in (two, measured))
    assert estimate_step(MOE, layered, one_measured, workload).total == pytest.approx(
        estimate_step(MOE, layered, one, workload).total)


def test_recompute_moves_the_layers_activations_once_more() -> None:
    """Recompute runs the layers' forward again: their elementwise traffic (norms, activations, residuals) is four
    forwards' worth, not three; the head's stays three (it is not recomputed)."""
    cluster = dataclasses.replace(CPU, operator_overhead=0.0, device_flops=1e30, attention_flops=1e30,
                                  memory_bandwidth=1e30, elementwise_bandwidth=1e9)
    layered, recomputed = (Layout(micro_batches=2, accumulation="layered", recompute=r) for r in (False, True))
    plain, again = (estimate_step(MOE, layout, cluster, WORKLOAD).compute for layout in (layered, recomputed))
    from lightning_p2r.planning.model import layer_elementwise_elements

    layers = sum(layer_elementwise_elements(MOE, layer) for layer in range(MOE.num_layers))
    tokens = WORKLOAD.global_batch * WORKLOAD.seq_len
    assert again - plain == pytest.approx(tokens * layers * 4 / 1e9)
