"""The planner prices a Hugging Face decoder from its own config and code: parameters, FLOPs, layer kinds and windows
as the built model has them, a recipe for ``CausalLMModule`` planned and trialled, and what it cannot price refused
in one line."""

import math
import re
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from lightning_p2r.causal_lm import build_hf_model  # noqa: E402
from lightning_p2r.cli import main  # noqa: E402
from lightning_p2r.planning.hf_decoder import hf_decoder_of, hf_operators  # noqa: E402
from lightning_p2r.planning.model import (  # noqa: E402
    head_forward_flops,
    layer_attention_flops,
    model_forward_flops,
    parameter_count,
)
from tests.unit.hf_models import CONFIGS  # noqa: E402

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
CLUSTER = RECIPES / "clusters" / "a100_80gb_x8.yaml"
PRICED = ("llama_tied", "llama", "gpt2", "mixtral", "qwen3_moe", "qwen2_moe", "mistral", "qwen3", "qwen3_sliding")


@pytest.mark.parametrize("name", PRICED)
def test_the_priced_parameters_are_the_built_models(name: str) -> None:
    """Every parameter of the built model, each layer's under its block, a tied head once; MoE layers where the
    model has experts; sliding windows where its attention has them."""
    decoder = hf_decoder_of(CONFIGS[name])
    model = build_hf_model(CONFIGS[name])
    assert parameter_count(decoder) == sum(p.numel() for p in model.parameters())
    layers = model.get_submodule("transformer.h" if name == "gpt2" else "model.layers")
    for index, layer in enumerate(layers):
        assert sum(p.numel for p in decoder.params if p.block == index) == sum(p.numel() for p in layer.parameters())
        has_experts = any(".experts." in f".{n}" for n, _ in layer.named_parameters())
        assert decoder.is_moe_layer(index) == has_experts
    types = getattr(model.config, "layer_types", None)
    window = getattr(model.config, "sliding_window", None)
    expected = [window if kind == "sliding_attention" else None for kind in types] if types else (
        [window] * len(layers) if name == "mistral" else [None] * len(layers))
    assert list(decoder.windows) == expected
    if name == "qwen3_sliding":
        assert decoder.windows == (None, None, 4, 4)
    if name == "qwen2_moe":
        assert decoder.moe_layers == [1, 3] and decoder.shared_expert_dim == 32


def _grouped_mm_flops(run) -> int:
    """FLOPs of the grouped matmuls ``run`` calls (torch's FLOP counter has no formula for ``_grouped_mm``): rows
    times the inner and outer sizes, twice."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Grouped(TorchDispatchMode):
        flops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_grouped_mm":
                rows, inner = args[0].shape
                Grouped.flops += 2 * rows * inner * args[1].shape[-1]
            return func(*args, **(kwargs or {}))

    with Grouped():
        run()
    return Grouped.flops


@pytest.mark.parametrize("name", ("llama", "gpt2", "mixtral", "qwen3_moe", "qwen2_moe", "qwen3"))
def test_the_priced_matmul_flops_are_what_the_model_computes(name: str) -> None:
    """The FLOPs the real model computes in one forward (torch's FLOP counter for its matmuls, the grouped experts'
    counted apart; the attention kernel left out, which the counter prices without the causal mask) against the
    planner's per-token count times the tokens."""
    from torch.utils.flop_counter import FlopCounterMode

    config = CONFIGS[name]
    decoder = hf_decoder_of(config)
    model = build_hf_model(config).eval()
    seq = 16
    ids = torch.randint(0, config["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(0))

    def run() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    with FlopCounterMode(display=False) as counter:
        run()
    counted = {str(op).split(".")[-1]: flops for op, flops in counter.get_flop_counts()["Global"].items()}
    matmuls = sum(flops for op, flops in counted.items() if "attention" not in op) + _grouped_mm_flops(run)
    attention = sum(layer_attention_flops(decoder, layer, seq) for layer in range(decoder.num_layers))
    priced = ids.numel() * (model_forward_flops(decoder, seq) - attention)
    assert matmuls == pytest.approx(priced, rel=1e-6), counted
    assert head_forward_flops(decoder) == 2 * decoder.dim * decoder.vocab_size


def test_operators_are_counted_on_the_familys_code() -> None:
    """A layer's fixed cost is priced by the operators its code launches: more in a gated Llama layer than in GPT-2's,
    more in an MoE layer than in the same family's dense one, and the same count each time."""
    llama, gpt2 = hf_decoder_of(CONFIGS["llama"]), hf_decoder_of(CONFIGS["gpt2"])
    moe = hf_decoder_of(CONFIGS["qwen2_moe"])
    assert hf_operators(llama)[0] > hf_operators(gpt2)[0] > 20
    assert hf_operators(moe)[1] > hf_operators(moe)[0] and hf_operators(llama)[1] == 0
    assert hf_operators(hf_decoder_of(CONFIGS["llama"])) == hf_operators(llama)


def _recipe(tmp_path: Path, **init_args) -> Path:
    recipe = yaml.safe_load((RECIPES / "hf_moe.yaml").read_text())
    recipe["model"]["init_args"] |= init_args
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_plan_prices_a_hugging_face_recipe_and_writes_a_fragment_the_strategy_accepts(capsys, tmp_path) -> None:
    from lightning_p2r import P2RStrategy

    main(["plan", "--cluster", str(CLUSTER), "--config", str(RECIPES / "hf_moe.yaml"), "--devices", "8", "--top", "3",
          "--csv", str(tmp_path / "plans.csv")])
    out = capsys.readouterr().out
    assert "(Hugging Face qwen3_moe), 4 layers, dim 128, 8 experts in 4 MoE layers" in out
    assert "pseudo_step_s" not in out
    fragment = yaml.safe_load(out[out.index("trainer:"):])
    P2RStrategy(**fragment["trainer"]["strategy"]["init_args"])
    rows = (tmp_path / "plans.csv").read_text().splitlines()
    assert any(" ep2" in row or " ep4" in row for row in rows[1:]), "expert-parallel layouts of the MoE are priced"
    assert any(" tp2" in row for row in rows[1:])


@pytest.mark.parametrize("change, message", [
    ({"num_unique_blocks": 2}, "model.init_args.num_unique_blocks is not priced"),
    ({"hf_config": {"model_type": "phi3", "hidden_size": 32}}, "prices the Hugging Face families llama, mistral"),
    ({"hf_config": {"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4}}, "model.init_args.hf_config"),
])
def test_plan_refuses_what_it_cannot_price_in_one_line(capsys, tmp_path, change, message) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--cluster", str(CLUSTER), "--config", str(_recipe(tmp_path, **change))])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and "rank" not in captured.out


def test_plan_refuses_sequences_longer_than_gpt2s_learned_positions(capsys, tmp_path) -> None:
    path = _recipe(tmp_path, hf_config=CONFIGS["gpt2"])
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(CLUSTER), "--config", str(path), "--seq-len", "128"])
    assert re.search(r"128 tokens exceed the 64 learned positions of this gpt2", capsys.readouterr().err)


def test_a_trial_trains_the_hugging_face_model_the_recipe_names() -> None:
    """``plan --trial`` times the recipe's own model: the worker builds CausalLMModule from the priced config."""
    from lightning_p2r import P2RStrategy
    from lightning_p2r.causal_lm import CausalLMModule
    from lightning_p2r.measure.run import fit_on_random_tokens
    from lightning_p2r.measure.trial import trial_spec
    from lightning_p2r.planning import Workload
    from lightning_p2r.planning.layout import Layout

    decoder = hf_decoder_of(CONFIGS["qwen3_moe"])
    spec = trial_spec(decoder, Layout(sharding="zero3", offload_fraction=0.5), Workload(global_batch=4, seq_len=16),
                      devices=1, steps=3, accelerator="cpu", out="unused")
    assert spec["hf_config"] == CONFIGS["qwen3_moe"] and "model" not in spec
    trainer, module, step_s = fit_on_random_tokens(spec, P2RStrategy(**spec["strategy"]), warmup=1)
    assert isinstance(module, CausalLMModule) and trainer.global_step == 3 and step_s > 0


def test_a_layer_costs_what_calibrate_timed_for_its_family_and_falls_back_to_m6s_by_operators() -> None:
    """With ``hf_layer_overheads`` a Llama layer's fixed cost is its timed value (the probe's operators are the
    model's); without it, M6's measured layer scaled by the operator ratio. A bad value is refused, and the machine's
    present speed scales the timings."""
    from lightning_p2r.planning.cluster import Cluster, at_speed
    from lightning_p2r.planning.hf_decoder import _m6_operators
    from lightning_p2r.planning.step_time import operator_scales

    llama = hf_decoder_of(CONFIGS["llama"])
    measured = Cluster(accelerator="cpu", devices=1, dense_layer_overhead=5e-4, moe_layer_overhead=1e-3,
                       hf_layer_overheads={"llama": 7e-4})
    dense, _ = operator_scales(llama, measured)
    assert dense * measured.dense_layer_overhead == pytest.approx(7e-4)
    unmeasured = Cluster(accelerator="cpu", devices=1, dense_layer_overhead=5e-4, moe_layer_overhead=1e-3)
    assert operator_scales(llama, unmeasured)[0] == pytest.approx(hf_operators(llama)[0] / _m6_operators("loop")[0])
    assert at_speed(measured, 2.0).hf_layer_overheads == {"llama": pytest.approx(1.4e-3)}
    with pytest.raises(ValueError, match="hf_layer_overheads must map model types"):
        Cluster(hf_layer_overheads={"llama": -1.0})


def test_the_calibration_processes_average_the_family_timings_as_one_flat_tensor() -> None:
    from lightning_p2r.measure.collective_probes import flat_constants, nested_constants

    constants = {"step_overhead": 1e-3, "hf_layer_overheads": {"llama": 7e-4, "qwen3_moe:moe": 1.4e-3}}
    flat = flat_constants(constants)
    assert all(isinstance(value, float) for value in flat.values())
    assert nested_constants(flat) == constants


def test_a_hugging_face_layer_pays_the_per_token_costs_timed_on_hugging_face_code() -> None:
    """A calibration that timed the Hugging Face layers prices their tokens at their own per-token costs (a Qwen3-MoE
    layer's grouped experts pay routing's sort and gathers per token, not M6's expert loop); a file without them, at
    M6's. M6 models keep M6's either way."""
    from lightning_p2r.models import M6Config
    from lightning_p2r.planning.cluster import Cluster
    from lightning_p2r.planning.step_time import token_costs

    m6_costs = {"dense_token_overhead": 4e-7, "dense_token_width_overhead": 2e-8, "moe_token_overhead": 7e-7,
                "moe_token_width_overhead": 3e-8}
    hf_costs = {"hf_dense_token_overhead": 5e-7, "hf_dense_token_width_overhead": 0.0, "hf_moe_token_overhead": 1e-6,
                "hf_moe_token_width_overhead": 2e-8}
    timed = Cluster(hf_layer_overheads={"qwen3_moe:moe": 1e-3}, **m6_costs, **hf_costs)
    older = Cluster(**m6_costs, **hf_costs)
    moe = hf_decoder_of(CONFIGS["qwen3_moe"])  # width 32
    assert token_costs(moe, timed) == pytest.approx((5e-7, 1e-6 + 2e-8 * 32))
    assert token_costs(moe, older) == pytest.approx((4e-7 + 2e-8 * 32, 7e-7 + 3e-8 * 32))
    assert token_costs(M6Config(dim=32), timed) == token_costs(moe, older)


def test_the_per_token_costs_of_hugging_face_layers_come_from_their_timings_less_what_is_priced() -> None:
    """More time at 16 sequences than the priced growth is the per-token cost; a timing below the priced growth is
    noise and gives 0, never a negative cost; timings absent (no transformers) give nothing."""
    from lightning_p2r.measure.layer_probes import HF_LAYER_SECONDS, hf_token_overheads
    from lightning_p2r.planning.cluster import Cluster

    cluster = Cluster(accelerator="cpu", devices=1, hf_layer_overheads={"llama": 7e-4})
    assert hf_token_overheads(cluster, {}) == {}
    slow = {name: (0.05 if "_many_" in name else 0.001) for name in HF_LAYER_SECONDS}
    costs = hf_token_overheads(cluster, slow)
    assert set(costs) == {"hf_dense_token_overhead", "hf_dense_token_width_overhead", "hf_moe_token_overhead",
                          "hf_moe_token_width_overhead"}
    assert costs["hf_dense_token_overhead"] > 0 and costs["hf_moe_token_overhead"] > 0
    flat = {name: 0.001 for name in HF_LAYER_SECONDS}
    assert all(value == 0.0 for value in hf_token_overheads(cluster, flat).values())


def test_plan_warns_what_a_hugging_face_models_prices_lack(capsys, tmp_path) -> None:
    """A calibration without the Hugging Face layers' timings prices them from M6's (said, with what to do); one
    without dropout costs leaves out the masks of a model that drops (GPT-2 by default; said), not of one that does
    not."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("accelerator: cpu\ndevices: 2\ndevice_memory: 8e9\ndevice_flops: 5e10\n"
                       "dense_layer_overhead: 5e-4\nmoe_layer_overhead: 1e-3\n")
    main(["plan", "--cluster", str(cluster), "--config", str(RECIPES / "hf_moe.yaml"), "--no-speed-check",
          "--top", "200"])
    out = capsys.readouterr().out
    assert "has no hf_layer_overheads" in out and "calibrate again" in out
    assert "has no dropout costs" not in out  # Qwen3-MoE does not drop
    recipe = yaml.safe_load((RECIPES / "hf_moe.yaml").read_text())
    recipe["model"]["init_args"]["hf_config"] = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                 "n_positions": 256}
    gpt2 = tmp_path / "gpt2.yaml"
    gpt2.write_text(yaml.safe_dump(recipe))
    for costs, warned in (("", True), ("dropout_element_overhead: 6e-9\nattention_dropout_element_overhead: 1e-8\n",
                                       False)):
        (tmp_path / "drops.yaml").write_text(cluster.read_text() + costs)
        main(["plan", "--cluster", str(tmp_path / "drops.yaml"), "--config", str(gpt2), "--no-speed-check",
              "--top", "1"])
        assert ("has no dropout costs" in capsys.readouterr().out) == warned
    measured = tmp_path / "measured.yaml"
    measured.write_text(cluster.read_text() + "hf_layer_overheads: {qwen3_moe:moe: 1.2e-3, qwen3_moe: 8e-4}\n")
    main(["plan", "--cluster", str(measured), "--config", str(RECIPES / "hf_moe.yaml"), "--no-speed-check",
          "--top", "1", "--sharding", "zero3"])
    out = capsys.readouterr().out
    assert "has no hf_layer_overheads" not in out


def test_plan_reads_hugging_face_recipes_as_fit_runs_them(capsys, tmp_path) -> None:
    """Review findings: tensor parallelism must divide the key/value heads too (the strategy refuses it otherwise);
    nested config fields (rope_scaling) are priced; a recipe naming no vocabulary trains on the data module's default
    (4,096), not the family's (Llama's 32,000); a run's saved config.yaml, every option spelled out at its default,
    is priced like the recipe."""
    from lightning_p2r.planning.cli import recipe_inputs

    main(["plan", "--cluster", str(CLUSTER), "--config", str(RECIPES / "hf_moe.yaml"), "--devices", "4",
          "--csv", str(tmp_path / "plans.csv")])
    rows = (tmp_path / "plans.csv").read_text().splitlines()[1:]
    assert rows and not any(" tp4" in row for row in rows)  # 4 heads, 2 key/value heads
    capsys.readouterr()
    recipe = yaml.safe_load((RECIPES / "hf_moe.yaml").read_text())
    recipe["data"].pop("vocab_size")
    recipe["model"]["init_args"]["hf_config"] = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                 "num_attention_heads": 4, "intermediate_size": 128,
                                                 "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    recipe["model"]["init_args"] |= {"litgpt_config": None, "model": None, "parts": None, "num_unique_blocks": None,
                                     "sharing": "sequence", "pseudo_depth": "shared", "growth_init": "copy"}
    path = tmp_path / "saved.yaml"
    path.write_text(yaml.safe_dump(recipe))
    config, _ = recipe_inputs(path)
    assert config.vocab_size == 4096 and config.hf_config()["rope_scaling"]["factor"] == 2.0
    recipe["model"]["init_args"]["hf_config"]["vocab_size"] = 1000  # fit links the data's over it
    path.write_text(yaml.safe_dump(recipe))
    assert recipe_inputs(path)[0].vocab_size == 4096
    recipe["model"]["init_args"]["pseudo_depth"] = "shallow"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ValueError, match="model.init_args.pseudo_depth is not priced"):
        recipe_inputs(path)


@pytest.mark.parametrize(("name", "columns", "rows", "groups", "head_norms", "experts", "packed"), [
    ("llama", 5, 2, 2, 0, False, 0),  # q, k, v; gate, up | o, down
    ("qwen3", 5, 2, 2, 2, False, 0),  # and the per-head q_norm, k_norm
    ("qwen3_moe", 3, 1, 1, 2, True, 0),  # the MoE layer's experts split by expert, not by column and row
    ("gpt2", 2, 2, 2, 0, False, 2),  # the packed c_attn (weight and bias), c_fc | the two c_proj
])
def test_tensor_parallelism_splits_each_projection_of_a_hugging_face_layer_apart(
        name: str, columns: int, rows: int, groups: int, head_norms: int, experts: bool, packed: int) -> None:
    from lightning_p2r.planning.hf_tensor_parallel import split_model

    layer = split_model(hf_decoder_of(CONFIGS[name])).layers[-1]
    assert (layer.columns, layer.rows, layer.column_groups, len(layer.head_norms), layer.experts,
            layer.packed_params) == (columns, rows, groups, head_norms, experts, packed)


def test_a_llama_layer_waits_as_often_as_an_m6_layer_though_it_sums_seven_times() -> None:
    """Per micro-batch a Llama layer sums seven activations over the tensor-parallel ranks (the five column layers'
    input gradients, the two row layers' outputs); its ranks wait four times, as an M6 layer's (q, k and v's sums a
    matmul apart wait once, gate and up's once): the planner's waits count compute between collectives."""
    from lightning_p2r import M6Config
    from lightning_p2r.planning import Cluster, Workload, step_transfers
    from lightning_p2r.planning.framework import blocking_collective_calls
    from lightning_p2r.planning.layout import Layout

    cluster = Cluster(devices=2, devices_per_node=2, accelerator="cpu")
    layout = Layout(tensor_parallel=2, micro_batches=2)
    workload = Workload(global_batch=4, seq_len=16)

    def per_layer(model, deeper) -> tuple[int, int]:
        counts = []
        for config in (model, deeper):
            transfers = step_transfers(config, layout, cluster, workload)
            counts.append((sum(t.calls for t in transfers if t.kind == "all_reduce"),
                           blocking_collective_calls(transfers)))
        return tuple((b - a) // 2 // layout.micro_batches for a, b in zip(*counts))  # two layers more, per mb

    llama = CONFIGS["llama"]
    hf = per_layer(hf_decoder_of(llama), hf_decoder_of(llama | {"num_hidden_layers": 6}))
    m6 = M6Config(num_layers=4, dim=32, num_heads=4, vocab_size=64, max_seq_len=16)
    assert hf == (7, 4)
    assert per_layer(m6, m6.replace(num_layers=6)) == (4, 4)


def test_dropout_in_training_is_priced_where_the_model_drops() -> None:
    """GPT-2 drops its hidden states twice per layer, its attention's probabilities and its embeddings (0.1 each by
    default), which on a CPU made its layers about twice the priced cost (18 ms measured, 9.9 ms priced, per layer of
    2,048 tokens at width 32; Llama's 10.9 and 11.1): each mask is priced per element, and a dropping attention per
    probability of the causal square, at what ``calibrate`` measures. A model that does not drop pays nothing."""
    from dataclasses import replace

    from lightning_p2r import M6Config
    from lightning_p2r.measure.device_probes import dropout_overheads
    from lightning_p2r.planning import Cluster, Workload
    from lightning_p2r.planning.layout import Layout
    from lightning_p2r.planning.share import rank_share
    from lightning_p2r.planning.step_time import dropout_seconds

    measured = dropout_overheads(torch.device("cpu"), 2)  # (timings: their size is not asserted)
    assert set(measured) == {"dropout_element_overhead", "attention_dropout_element_overhead"}
    assert all(math.isfinite(value) and value >= 0 for value in measured.values())
    defaults = {k: v for k, v in CONFIGS["gpt2"].items() if not k.endswith("pdrop")}  # (the tests' GPT-2: none)
    gpt2 = hf_decoder_of(defaults)
    assert (gpt2.residual_dropouts, gpt2.attention_dropout, gpt2.embedding_dropout) == (2, 0.1, 0.1)
    undropped = hf_decoder_of(CONFIGS["gpt2"])
    llama = hf_decoder_of(CONFIGS["llama"])
    assert (llama.residual_dropouts, llama.attention_dropout, llama.embedding_dropout) == (0, 0.0, 0.0)
    cluster = replace(Cluster(devices=1, accelerator="cpu"), dropout_element_overhead=1e-9,
                      attention_dropout_element_overhead=1e-8)
    workload, layout = Workload(global_batch=4, seq_len=16), Layout()

    def seconds(config) -> float:
        return dropout_seconds(config, layout, cluster, workload, rank_share(config, layout, cluster, workload, 0))

    tokens, layers, width, heads = 4 * 16, gpt2.num_layers, gpt2.dim, gpt2.num_heads
    expected = tokens * ((2 * layers + 1) * width * 1e-9 + layers * heads * 16 * 1e-8)
    assert seconds(gpt2) == pytest.approx(expected)
    assert seconds(llama) == 0.0 and seconds(undropped) == 0.0
    # Sequence parallelism leaves a rank its positions of the layers' hidden states and its heads; the embeddings'
    # dropout runs on the whole sequence, once (not recomputed).
    cluster = replace(cluster, devices=2, devices_per_node=2)
    layout = Layout(tensor_parallel=2, sequence_parallel=True, recompute=True, accumulation="layered")
    split = tokens * (4 / 3 * layers * (2 * width / 2 * 1e-9 + heads * 16 / 2 * 1e-8) + width * 1e-9)
    assert seconds(gpt2) == pytest.approx(split)
    m6 = M6Config(num_layers=2, dim=32, num_heads=4, vocab_size=64, max_seq_len=16)
    assert seconds(m6) == 0.0 and seconds(m6.replace(dropout=0.1)) > 0
