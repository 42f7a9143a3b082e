"""A Hugging Face decoder without a ready declaration (Gemma, GPT-NeoX, OLMoE, Bloom, Granite, ...): its parts found
from the conventions every PreTrainedModel follows (models/hf_parts.py), the logits of its stages computed by its own
forward, and what stages cannot run refused in one line. The layouts themselves are checked against one process in
test_hf_models.py and tests/distributed/test_hf_layouts.py."""

import pytest
import torch
from hf_models import CONFIGS, VOCAB
from torch import nn

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lightning_p2r.models.decoders import (  # noqa: E402
    DecoderParts,
    check_stageable,
    decoder_parts,
    discovered_parts,
    logits_function,
)
from lightning_p2r.models.module_init import check_written, mark_unwritten, meta_template, values_on_twin  # noqa: E402


def _model(family: str, **overrides) -> nn.Module:
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**(CONFIGS[family] | overrides)))


EXPECTED = {
    "gemma3": DecoderParts(blocks="model.layers", embed=("model.embed_tokens",), norm="model.norm", head="lm_head",
                           base="model", logits_from="forward",
                           residual_outputs=("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias")),
    "gpt_neox": DecoderParts(blocks="gpt_neox.layers", embed=("gpt_neox.embed_in",),
                             norm="gpt_neox.final_layer_norm", head="lm_head", base="gpt_neox",
                             logits_from="forward", residual_outputs=("dense.weight", "dense.bias",
                                                                      "dense_4h_to_h.weight", "dense_4h_to_h.bias")),
    "bloom": DecoderParts(blocks="transformer.h", embed=("transformer.word_embeddings",
                                                         "transformer.word_embeddings_layernorm"),
                          norm="transformer.ln_f", head="lm_head", base="transformer", logits_from="forward"),
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_a_decoders_parts_are_found_from_hugging_faces_conventions(family: str) -> None:
    assert decoder_parts(_model(family)) == EXPECTED[family]


def test_stacked_experts_down_projections_are_residual_outputs() -> None:
    parts = decoder_parts(_model("olmoe"))
    assert parts.blocks == "model.layers" and parts.norm == "model.norm"
    assert "experts.down_proj" in parts.residual_outputs and "o_proj.weight" in parts.residual_outputs


def test_blocks_are_found_after_fsdp_swapped_their_class() -> None:
    model = _model("gemma3")
    for block in model.model.layers:  # what fully_shard does: a subclass named after the original
        block.__class__ = type(f"FSDP{type(block).__name__}", (type(block),), {})
    assert discovered_parts(model).blocks == "model.layers"


def test_blocks_are_found_on_a_pipeline_rank_holding_stand_ins_for_the_others() -> None:
    model = _model("gemma3")
    model.model.layers[2] = nn.Module()  # parameterless, as strategy/pipeline/stage.py's AbsentModule
    model.model.layers[3] = nn.Module()
    assert discovered_parts(model).blocks == "model.layers"


def test_a_model_whose_conventions_do_not_show_its_blocks_is_refused_by_name() -> None:
    model = _model("gemma3")
    model._no_split_modules = []
    with pytest.raises(ValueError, match="could not be found from Hugging Face's conventions.*DecoderParts"):
        decoder_parts(model)


@pytest.mark.parametrize("family", ["granite", "gemma3", "bloom"])
def test_the_stages_logits_are_the_models_own(family: str) -> None:
    """Granite divides its logits by logits_scaling after the head: head(norm(hidden)) misses it, the causal LM's
    own forward with its base standing in does not."""
    overrides = {"final_logit_softcapping": 2.0} if family == "gemma3" else {}
    model = _model(family, **overrides).eval()
    parts = decoder_parts(model)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    captured = {}
    norm = model.get_submodule(parts.norm)
    norm.register_forward_pre_hook(lambda module, args: captured.setdefault("hidden", args[0]))
    with torch.no_grad():
        expected = model(input_ids=tokens, use_cache=False).logits
        staged = logits_function(model, parts)(captured["hidden"])
        plain = logits_function(model, DecoderParts(**{**vars(parts), "logits_from": "head"}))(captured["hidden"])
    torch.testing.assert_close(staged, expected)
    if family != "bloom":  # the check above can fail: without the model's forward the logits differ
        assert (plain - expected).abs().max() > 1e-3
    assert model.get_submodule(parts.base) is not None and type(model.get_submodule(parts.base)).__name__.endswith(
        "Model")  # the base is back in place


def test_a_module_after_the_final_norm_makes_the_model_unstageable_in_one_line() -> None:
    """OPT with word_embed_proj_dim below its width projects the embeddings up (project_in) and the final norm's
    output down (project_out), which no stage runs: layered accumulation and pipelines refuse it; its parts are still
    found for the other layouts. (OPT registers its layers after everything else.)"""
    config = AutoConfig.for_model("opt", vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                  num_attention_heads=4, word_embed_proj_dim=16, max_position_embeddings=64,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config)
    parts = decoder_parts(model)
    assert parts.blocks == "model.decoder.layers" and parts.norm == "model.decoder.final_layer_norm"
    assert "project_out" in parts.unstageable and "project_in" in parts.unstageable
    with pytest.raises(ValueError, match="pipeline parallelism runs OPTForCausalLM as stages.*project_out.*"
                                         "accumulation='standard'"):
        check_stageable(model, parts, "pipeline parallelism")
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**(config.to_dict() | {"word_embed_proj_dim": 32})))
    assert decoder_parts(plain).embed == ("model.decoder.embed_tokens", "model.decoder.embed_positions")
    assert decoder_parts(plain).unstageable == ""


def test_buffers_a_rule_leaves_unwritten_are_refused_by_name() -> None:
    module = nn.Linear(2, 2)
    module.register_buffer("scale", torch.empty(1), persistent=False)
    module.register_buffer("positions", torch.empty(3, dtype=torch.long), persistent=False)
    buffers = dict(module.named_buffers())
    mark_unwritten(buffers)
    with pytest.raises(ValueError, match=r"did not write \['scale', 'positions'\]"):
        check_written(module, "embed", buffers)
    module.scale.fill_(2.0)
    module.positions.copy_(torch.arange(3))
    check_written(module, "embed", buffers)


def test_a_rule_that_leaves_a_parameter_unwritten_is_told_apart_and_refused_when_built_in_place() -> None:
    """Built on the meta device, a parameter the model's rule does not write would hold whatever memory it was given;
    ``values_on_twin`` reports it, and materializing refuses it by name (an eager build keeps its constructor value)."""
    root = nn.Sequential(nn.Linear(2, 2))

    def weight_only(module: nn.Module) -> None:  # a rule with no branch for the bias
        if isinstance(module, nn.Linear):
            nn.init.ones_(module.weight)

    seen = {}
    values_on_twin(weight_only, meta_template(root), "0", 0, "0", ["weight", "bias"],
                   lambda values, unwritten: seen.update(values={k: v.clone() for k, v in values.items()},
                                                         unwritten=unwritten))
    assert seen["unwritten"] == ["bias"] and torch.equal(seen["values"]["weight"], torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"did not write \['bias'\]"):
        check_written(root[0], "0", {"bias": seen["values"]["bias"]})


def test_olmo2s_plan_gathers_q_k_v_whole_and_splits_the_output_projections_input() -> None:
    """OLMo 2 normalizes q and k over all heads at once, so Hugging Face's plan gathers them whole
    ("colwise_gather_output" inside a block) and splits o_proj by its input ("rowwise_split_input")."""
    from lightning_p2r.strategy.blocks import declare_blocks
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    model = _model("olmo2")
    declare_blocks(model, decoder_parts(model).blocks, "")
    entries = model_plan(model, tensor_parallel=2).blocks[0]
    assert {name: entries[name] for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj",
                                              "mlp.down_proj")} == {
        "self_attn.q_proj": "gathered_column", "self_attn.o_proj": "row_of_whole", "mlp.up_proj": "column",
        "mlp.down_proj": "row"}
    # under sequence parallelism the attention gathers the sequence, as the MLP does
    assert entries["self_attn"] == "gather" and entries["mlp"] == "gather"


def test_a_list_of_the_layer_classes_hugging_face_never_splits_is_detected_though_they_differ() -> None:
    """Jamba alternates Mamba and attention layers: no list of one class is long enough to be its blocks, but both
    classes are in its _no_split_modules (a user's own LightningModule relies on this detection)."""
    from lightning_p2r.strategy.blocks import detect_block_list

    config = AutoConfig.for_model("jamba", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                                  pad_token_id=0)
    wrapper = nn.ModuleDict({"model": AutoModelForCausalLM.from_config(config)})
    assert len({type(layer) for layer in wrapper["model"].model.layers}) == 2
    assert detect_block_list(wrapper)[0] == "model.model.layers"


def test_a_detected_hugging_face_list_is_declared_on_the_causal_lm_which_holds_the_head_and_its_plan() -> None:
    """A user's own LightningModule around a Hugging Face causal LM: the layers run in the base model, but the head,
    its tensor-parallel plan entry (the class's _tp_plan) and its tie to the embedding are the causal LM's, so the
    contract goes there, as CausalLMModule declares it. On the base model, tensor parallelism left the tied head
    whole and refused the tie (a user's own module, found by a new-user audit)."""
    from lightning_p2r.strategy.blocks import declare_blocks
    from lightning_p2r.strategy.parallel.hf_plan import plan_from_hf

    config = AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    wrapper = nn.Module()
    wrapper.model = AutoModelForCausalLM.from_config(config)
    declared = declare_blocks(wrapper, None)
    assert declared.path == "model.model.layers" and declared.holder_path == "model"
    plan = plan_from_hf(wrapper.model, tensor_parallel=2)
    assert plan.outside["lm_head"] == "output" and plan.outside["model.embed_tokens"] == "vocabulary"
    bare = nn.Module()  # a base model alone (the user's own head around it) stays its own holder
    bare.decoder = AutoModelForCausalLM.from_config(config).model
    assert declare_blocks(bare, None).holder_path == "decoder"


def test_a_model_that_returns_router_logits_but_adds_no_balance_loss_is_not_given_one() -> None:
    """DeepSeek-V3 accepts output_router_logits=True but balances by a routing bias: its forward adds no loss, so
    neither do layered stages, and pipelines (which refuse a pooled balance loss) take it; Qwen3-MoE adds one."""
    from lightning_p2r.models.decoders import check_pipeline_supported
    from lightning_p2r.models.router_loss import adds_balance_loss, router_loss_of

    deepseek = _model("deepseek_v3", output_router_logits=True)
    assert not adds_balance_loss(deepseek) and router_loss_of(deepseek) is None
    check_pipeline_supported(deepseek)
    qwen = _model("qwen3_moe_balanced")
    assert adds_balance_loss(qwen) and router_loss_of(qwen) is not None
    with pytest.raises(ValueError, match="load-balancing loss pooled over all its layers"):
        check_pipeline_supported(qwen)


def test_the_module_says_which_parts_it_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # The message is recorded where the module says it, not read back from the log: whether Lightning's logger
    # reaches pytest's capture depends on when lightning.pytorch was first imported in the process (it stops
    # propagating if the root logger had no handler then), which made this test depend on the tests before it.
    from lightning_p2r import causal_lm

    said: list[str] = []
    monkeypatch.setattr(causal_lm, "rank_zero_info", said.append)
    module = causal_lm.CausalLMModule(hf_config=CONFIGS["gpt_neox"])
    module.configure_model()
    module.block_list()
    assert said == ["CausalLMModule: GPTNeoXForCausalLM's parts found from Hugging Face's conventions: blocks "
                    "gpt_neox.layers, embedding ['gpt_neox.embed_in'], final norm gpt_neox.final_layer_norm, head "
                    "lm_head"]
