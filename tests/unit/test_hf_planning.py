"""The planner prices a Hugging Face decoder from its own config and code: parameters, FLOPs, layer kinds and windows
as the built model has them, a recipe for ``CausalLMModule`` planned and trialled, and what it cannot price refused
in one line."""

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
