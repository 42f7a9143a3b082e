"""Hugging Face models as users bring them (issue 38): tiny configs of Llama (tied and untied), GPT-2, Mixtral and
Qwen3-MoE, built in place under ``P2RStrategy`` (meta device, each tensor materialized once with the model's own
initialization) and trained in the one-process layouts, against a plain Trainer on the eager build; the model's
own parameter names, its rotary tables recomputed, its tie kept, and nothing about blocks, stages or plans written."""

from pathlib import Path

import lightning as L
import pytest
import torch
from hf_models import CONFIGS, LITGPT, VOCAB, Losses, windows
from torch import nn

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lightning_p2r import P2RStrategy  # noqa: E402
from lightning_p2r.causal_lm import CausalLMModule  # noqa: E402
from lightning_p2r.models.decoders import DecoderParts, decoder_parts  # noqa: E402

LAYOUTS = {
    "none": {},
    "zero3_offload": {"sharding": "zero3", "offload_fraction": 0.5},
    "offload_layered": {"offload_fraction": 0.5, "accumulation": "layered", "micro_batches": 2},
    "zero3_offload_layered": {"sharding": "zero3", "offload_fraction": 0.5, "accumulation": "layered",
                              "micro_batches": 2},
}
CASES = [("llama_tied", "none"), ("llama_tied", "zero3_offload"), ("llama_tied", "zero3_offload_layered"),
         ("llama", "offload_layered"), ("gpt2", "zero3_offload_layered"), ("mixtral", "zero3_offload"),
         ("qwen3_moe", "zero3_offload_layered"), ("qwen3_moe", "offload_layered"),
         # Families without a ready declaration (tests/unit/test_hf_parts.py): Gemma 3's embedding scale is a buffer
         # its _init_weights recomputes, Granite scales its logits after the head, Bloom normalizes its embeddings.
         ("gemma3", "zero3_offload_layered"), ("granite", "offload_layered"), ("bloom", "zero3_offload"),
         ("qwen3_next", "zero3_offload_layered")]


def _fit(tmp_path: Path, family: str, strategy: object, steps: int = 4) -> tuple[list[float], CausalLMModule]:
    module = CausalLMModule(hf_config=CONFIGS[family], optimizer={"lr": 1e-2, "warmup_steps": 0}, init_seed=3)
    losses = Losses()
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
              enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
              use_distributed_sampler=False, default_root_dir=tmp_path, callbacks=[losses],
              ).fit(module, torch.utils.data.DataLoader(windows(), batch_size=4))
    return losses.losses, module


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    out = tmp_path_factory.mktemp("hf_reference")
    return {family: _fit(out, family, "auto")[0] for family in {family for family, _ in CASES}}


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[f"{f}-{layout}" for f, layout in CASES])
def test_an_hf_model_built_in_place_trains_like_the_eager_build_on_a_plain_trainer(
        tmp_path: Path, references: dict[str, list[float]], family: str, layout: str) -> None:
    losses, module = _fit(tmp_path, family, P2RStrategy(**LAYOUTS[layout]))
    expected = references[family]
    assert losses == pytest.approx(expected, rel=1e-5)
    assert expected[-1] < expected[0]  # it learns: the comparison means something
    names = set(module.state_dict())
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIGS[family]))
    assert names == {f"model.{name}" for name in eager.state_dict()}  # the model's own names, nothing added
    if family == "llama_tied":
        assert module.model.lm_head.weight is module.model.model.embed_tokens.weight


def test_a_tensor_a_parent_modules_rule_writes_is_initialized_like_transformers_does_it() -> None:
    """Transformers applies ``_init_weights`` to every module, children first, and Qwen3-Next's sparse MoE block
    draws its router's weight in its own branch (the router's writes nothing). Initialized module by module, the
    router kept the uninitialized memory it was allocated with: two builds from one seed differed, and a run could
    start from NaN. Each module's rule now runs on its ancestors too (``module_init.rule_ancestors``)."""
    builds = []
    for _ in range(2):
        module = CausalLMModule(hf_config=CONFIGS["qwen3_next"], init_seed=3)
        module.configure_model()
        builds.append(module.state_dict())
    assert builds[0].keys() == builds[1].keys()
    assert all(torch.equal(builds[0][key], builds[1][key]) for key in builds[0])
    routers = [value for key, value in builds[0].items() if key.endswith("mlp.gate.weight")]
    assert len(routers) == CONFIGS["qwen3_next"]["num_hidden_layers"]
    std = AutoConfig.for_model(**CONFIGS["qwen3_next"]).initializer_range
    for weight in routers:  # drawn from the block's branch: N(0, initializer_range)
        assert torch.isfinite(weight).all() and 0.5 * std < weight.std().item() < 2 * std


@pytest.mark.parametrize("sharing", ["sequence", "cycle"])
def test_a_pseudo_decoder_with_shared_layers_runs_each_layers_block_in_layered_stages(tmp_path: Path,
                                                                                       sharing: str) -> None:
    """Four layers sharing two blocks: layered accumulation (2 micro-batches, recompute, half offloaded) gives a plain
    Trainer's losses. The stages once ran the model's list at the unique block's number (layer 2 ran block 1's
    position, which holds block 0 when consecutive layers share): 4.166 against 4.175 at the first step."""
    def fit(strategy: object) -> list[float]:
        L.seed_everything(0)
        module = CausalLMModule(hf_config=CONFIGS["llama"], optimizer={"lr": 1e-2, "warmup_steps": 0}, init_seed=3,
                                num_unique_blocks=2, sharing=sharing)
        losses = Losses()
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False,
                  enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=[losses],
                  ).fit(module, torch.utils.data.DataLoader(windows(rows=8), batch_size=4))
        return losses.losses

    plain = fit("auto")
    layered = fit(P2RStrategy(accumulation="layered", micro_batches=2, offload_fraction=0.5, recompute=True))
    assert layered == pytest.approx(plain, rel=1e-5)


def test_layers_the_model_calls_with_other_masks_get_them_in_layered_stages(tmp_path: Path) -> None:
    """Qwen3 with sliding windows on its last two layers passes them another attention mask than its first two:
    layered accumulation gives a plain Trainer's losses. The stages once called every layer with the first layer's
    arguments (4.176 against 4.182 at the first step)."""
    plain, _ = _fit(tmp_path, "qwen3_sliding", "auto", steps=2)
    layered, module = _fit(tmp_path, "qwen3_sliding", P2RStrategy(accumulation="layered", micro_batches=2), steps=2)
    assert module.model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    assert layered == pytest.approx(plain, rel=1e-5)


def test_rotary_tables_built_on_the_meta_device_are_recomputed(tmp_path: Path) -> None:
    _, module = _fit(tmp_path, "llama", P2RStrategy(sharding="zero3"), steps=1)
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIGS["llama"]))
    torch.testing.assert_close(module.model.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)


class OwnModule(L.LightningModule):
    """A user's own LightningModule around an HF model built in configure_model, with its own loss: standard layouts
    need nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIGS["qwen3_moe"]))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_users_own_module_builds_an_hf_moe_in_place_and_the_detected_blocks_are_reported(tmp_path: Path) -> None:
    module = OwnModule()
    strategy = P2RStrategy(sharding="zero3", offload_fraction=0.5)
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False,
              enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
              ).fit(module, torch.utils.data.DataLoader(windows(), batch_size=4))
    assert strategy.block_declaration.describe().startswith(
        "P2RStrategy blocks: model.model.layers (4 x Qwen3MoeDecoderLayer), detected")
    assert not any(p.device.type == "meta" for p in module.parameters())
    assert all(torch.isfinite(p).all() for p in module.state_dict().values())


def test_declarations_are_checked_by_name() -> None:
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIGS["gpt2"]))
    assert decoder_parts(model).blocks == "transformer.h"
    with pytest.raises(ValueError, match="names 'model.norm', which GPT2LMHeadModel does not have"):
        decoder_parts(model, DecoderParts(blocks="transformer.h", embed=(), norm="model.norm", head="lm_head"))
    with pytest.raises(ValueError, match="no ready declaration for Linear"):
        decoder_parts(nn.Linear(2, 2))


def test_hf_config_needs_a_model_type() -> None:
    with pytest.raises(ValueError, match="needs a 'model_type'"):
        CausalLMModule(hf_config={"vocab_size": VOCAB})
    with pytest.raises(ValueError, match="exactly one of hf_config"):
        CausalLMModule()


def test_a_misspelled_model_type_or_field_is_refused_when_the_module_is_made() -> None:
    """A misspelled field trained silently with the field's default (``num_experts_per_tokk``: every token to all 4
    experts), and an unknown model_type stopped the run only after processes, data and loggers had started, in a
    12 kB line listing every type (a new user's audit, 2026-12-01)."""
    with pytest.raises(ValueError, match=r"^CausalLMModule.hf_config: 'num_experts_per_tokk' is not a field of "
                                         r"Qwen3MoeConfig; did you mean 'num_experts_per_tok'\?"):
        CausalLMModule(hf_config={k: v for k, v in CONFIGS["qwen3_moe"].items() if k != "num_experts_per_tok"}
                       | {"num_experts_per_tokk": 2})
    with pytest.raises(ValueError, match=r"model_type 'qwen3moe' is not a model type of transformers \(did you mean "
                                         r"'qwen3_moe'") as raised:
        CausalLMModule(hf_config=CONFIGS["qwen3_moe"] | {"model_type": "qwen3moe"})
    assert len(str(raised.value)) < 200
    # Keys a config converts or a family's code reads by name pass as before: a legacy rope_theta, torch_dtype,
    # Qwen3-MoE's head_dim, GPT-NeoX's rotary_pct
    CausalLMModule(hf_config=CONFIGS["llama"] | {"rope_theta": 5e5, "torch_dtype": "float32"})
    CausalLMModule(hf_config=CONFIGS["qwen3_moe"])
    CausalLMModule(hf_config=CONFIGS["gpt_neox"])


def _declared(family: str, **overrides) -> nn.Module:
    from lightning_p2r.strategy.blocks import declare_blocks

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**(CONFIGS[family] | overrides)))
    declare_blocks(model, decoder_parts(model).blocks, "")
    return model


def test_the_hf_tensor_parallel_plan_is_read_and_a_tied_head_splits_its_embedding_too() -> None:
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    plan = model_plan(_declared("llama_tied"), tensor_parallel=2)
    assert plan.blocks[0] == {"self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
                              "self_attn.o_proj": "row", "mlp.gate_proj": "column", "mlp.up_proj": "column",
                              "mlp.down_proj": "row",
                              # for sequence parallelism (HF's plan has nothing for it; inert without it)
                              "self_attn": "gather", "mlp": "gather", "input_layernorm": "sequence",
                              "post_attention_layernorm": "sequence"}
    assert plan.outside == {"lm_head": "output", "model.embed_tokens": "vocabulary", "model.norm": "sequence"}
    assert model_plan(_declared("llama"), tensor_parallel=2).outside == {"lm_head": "output", "model.norm": "sequence"}


@pytest.mark.parametrize(("family", "overrides", "message"), [
    ("llama", {"num_key_value_heads": 1}, r"must divide LlamaForCausalLM's num_key_value_heads=1"),
    ("gpt2", {}, r"nor a Hugging Face base_model_tp_plan \(GPT-2 has none: CausalLMModule declares the package's"),
])
def test_what_tensor_parallelism_cannot_split_is_refused_in_one_line(family: str, overrides: dict,
                                                                      message: str) -> None:
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    with pytest.raises(ValueError, match=message):
        model_plan(_declared(family, **overrides), tensor_parallel=2)


def test_expert_parallelism_of_a_dense_hf_model_says_it_has_no_experts() -> None:
    """It said the model had no Hugging Face tensor-parallel plan, which a dense Llama has (a new-user audit)."""
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    with pytest.raises(ValueError, match=r"expert_parallel=2\) splits the experts a model's plan names: "
                                         r"LlamaForCausalLM has no Hugging Face expert-parallel plan "
                                         r"\(base_model_ep_plan\) naming any; use expert_parallel=1"):
        model_plan(_declared("llama"), expert_parallel=2)


def test_qwen3s_per_head_norms_run_whole_on_the_ranks_heads() -> None:
    """HF's "replicated_with_grad_allreduce" (Qwen3's q_norm and k_norm) is the "heads" kind: torch's sequence style
    over the heads dimension, the weights replicated."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from lightning_p2r.strategy.parallel.parallelize import model_plan
    from lightning_p2r.strategy.parallel.tensor import styles

    plan = model_plan(_declared("qwen3"), tensor_parallel=2)
    assert plan.blocks[0]["self_attn.q_norm"] == plan.blocks[0]["self_attn.k_norm"] == "heads"
    style = styles({"self_attn.q_norm": "heads"})["self_attn.q_norm"]
    assert isinstance(style, SequenceParallel) and style.use_local_output
    assert style.sequence_sharding[0].dim == 2  # (batch, sequence, heads, head_dim)


def test_sequence_parallelism_of_a_plan_marking_no_sequence_module_is_refused_in_one_line() -> None:
    """A plan that says nothing of its norms cannot run them on the rank's positions: refused before placement
    (Hugging Face plans, which have nothing for sequence parallelism, failed inside the first step's matmul before
    the strategy added their norms and gathers)."""
    from lightning_p2r import M6Config
    from lightning_p2r.models.transformer import M6Transformer
    from lightning_p2r.protocols import ParallelPlan
    from lightning_p2r.strategy.parallel.parallelize import check_sequence_parallel, model_plan

    m6 = M6Transformer(M6Config(vocab_size=64, max_seq_len=16, num_layers=2, dim=32, num_heads=2))
    columns_only = ParallelPlan(tuple({"ffn.fc_in": "column", "ffn.fc_out": "row"} for _ in m6.blocks), {})
    with pytest.raises(ValueError, match=r"sequence_parallel=True\) needs the parallel plan of M6Transformer"):
        check_sequence_parallel(m6, columns_only)
    check_sequence_parallel(m6, m6.parallel_plan())  # its norms are marked
    holder = _declared("llama")
    check_sequence_parallel(holder, model_plan(holder, tensor_parallel=2))
    holder.blocks[1] = holder.blocks[0]  # a shared (pseudo) first block: it runs at layers 0 and 1
    # accepted: the cut tells the first layer's whole input by the embedding's output length (get_input_embeddings)
    check_sequence_parallel(holder, model_plan(holder, tensor_parallel=2))
    holder.get_input_embeddings = None  # a model that names no embedding, in its plan or otherwise: refused
    with pytest.raises(ValueError, match=r"cuts the sequence at the first layer's block, which this LlamaForCausalLM"):
        check_sequence_parallel(holder, model_plan(holder, tensor_parallel=2))


def test_under_sequence_parallelism_a_gathering_plan_keeps_whole_inputs_inside_its_gathered_modules() -> None:
    """The kinds' styles: inside a "gather" module a column layer reads the gathered (whole) input, the embedding's
    output stays whole (the first block cuts it), the norms hand on plain tensors; without sequence parallelism
    "gather" and "sequence" do nothing."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from lightning_p2r.strategy.parallel.tensor import GatherSequence, styles

    entries = {"self_attn": "gather", "self_attn.q_proj": "column", "self_attn.o_proj": "row",
               "input_layernorm": "sequence", "other_proj": "column"}
    made = styles(entries, sequence_parallel=True, gathers=True)
    assert isinstance(made["self_attn"], GatherSequence)
    assert isinstance(made["self_attn.q_proj"], ColwiseParallel)
    assert made["self_attn.q_proj"].input_layouts == (Replicate(),)
    assert made["other_proj"].input_layouts == (Shard(1),)  # not inside a gathered module: gathers itself
    assert isinstance(made["self_attn.o_proj"], RowwiseParallel) and made["self_attn.o_proj"].output_layouts == (
        Shard(1),)
    assert isinstance(made["input_layernorm"], SequenceParallel) and made["input_layernorm"].use_local_output
    embedding = styles({"embed": "vocabulary"}, sequence_parallel=True, gathers=True)["embed"]
    assert embedding.output_layouts == (Replicate(),)
    assert styles({"embed": "vocabulary"}, sequence_parallel=True)["embed"].output_layouts == (Shard(1),)
    assert set(styles(entries)) == {"self_attn.q_proj", "self_attn.o_proj", "other_proj"}


def test_a_pipeline_rank_without_the_head_splits_its_tied_embedding_and_names_the_plan_from_its_root() -> None:
    """pp x tp of an HF model: on the first stage the head is another rank's (a stand-in), so the root lies below the
    holder, and the tie is known from the config only. Before: the tie check failed ("LlamaForCausalLM is not part
    of LlamaModel"), and a tied embedding stayed whole against the other stage's split head (a collective of two
    sizes)."""
    from lightning_p2r.strategy.parallel.parallelize import model_plan
    from lightning_p2r.strategy.placement import planned_modules
    from lightning_p2r.strategy.ties import smallest_parameter_root

    holder = _declared("llama_tied")
    holder.lm_head = nn.Identity()  # the last stage's
    plan = model_plan(holder, tensor_parallel=2)
    assert plan.outside["model.embed_tokens"] == "vocabulary" and "lm_head" not in plan.outside
    root = smallest_parameter_root(holder)
    assert root is holder.model
    named = planned_modules(root, holder, plan)
    assert named["embed_tokens"] == "vocabulary" and named["layers.0.self_attn.q_proj"] == "column"
    assert not any(name.startswith(("model.", "lm_head")) for name in named)


def test_a_hand_written_plan_naming_a_conv1d_is_refused_by_name() -> None:
    from lightning_p2r.protocols import ParallelPlan
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    model = _declared("gpt2")
    model.parallel_plan = lambda: ParallelPlan(tuple({"attn.c_attn": "column"} for _ in model.transformer.h), {})
    with pytest.raises(ValueError, match=r"block 0's attn\.c_attn as 'column': it is a Conv1D, not an nn\.Linear"):
        model_plan(model, tensor_parallel=2)


@pytest.mark.parametrize(("family", "strategy"), [("llama_tied", "zero3"), ("qwen3_moe", "single_file"),
                                                ("gemma3", "zero3")])
def test_convert_to_hf_round_trips_to_identical_logits(tmp_path: Path, family: str, strategy: str) -> None:
    from lightning_p2r.cli.convert import main as convert

    module = CausalLMModule(hf_config=CONFIGS[family], optimizer={"lr": 1e-2, "warmup_steps": 0})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                        strategy=P2RStrategy(sharding="zero3") if strategy == "zero3" else "auto")
    trainer.fit(module, torch.utils.data.DataLoader(windows(), batch_size=4))
    trainer.save_checkpoint(tmp_path / "trained.ckpt")
    ids = windows(rows=2)[:, :-1]
    with torch.no_grad():
        expected = module(ids)
    convert(["--to", "hf", str(tmp_path / "trained.ckpt"), str(tmp_path / "hf")])
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "generation_config.json",
                                                                   "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, expected)
    with pytest.raises(SystemExit):  # an existing destination is kept unless --overwrite
        convert(["--to", "hf", str(tmp_path / "trained.ckpt"), str(tmp_path / "hf")])


def _saved(module: L.LightningModule, path: Path) -> Path:
    """A checkpoint as Lightning writes it (its state, hyperparameters and the module's own records), no Trainer."""
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                  "pytorch-lightning_version": L.__version__, "global_step": 0, "epoch": 0}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize("pseudo", ["shared", "shallow", "qwen3_shallow"])
def test_convert_to_hf_writes_a_pseudo_model_as_the_model_it_runs(tmp_path: Path, pseudo: str) -> None:
    """A pseudo model's checkpoint (taken before PseudoToReal delinks it): its layers sharing a block failed in
    save_pretrained with a RuntimeError traceback about shared tensors, and a shallow one was refused as missing the
    layers it does not have yet. Now each layer gets its own copy of its block, and a shallow model is as deep as the
    layers it runs (Qwen3's per-layer attention types cut to them)."""
    from lightning_p2r.cli.convert import main as convert

    config = {**CONFIGS["qwen3_sliding"], "max_window_layers": 0} if pseudo == "qwen3_shallow" else \
        CONFIGS["llama_tied"]
    module = CausalLMModule(hf_config=config, num_unique_blocks=2,
                            pseudo_depth="shared" if pseudo == "shared" else "shallow")
    module.configure_model()
    ids = windows(rows=2)[:, :-1]
    with torch.no_grad():
        expected = module.eval()(ids)
    convert(["--to", "hf", str(_saved(module, tmp_path / "pseudo.ckpt")), str(tmp_path / "hf")])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.num_hidden_layers == (4 if pseudo == "shared" else 2)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, expected)


@pytest.mark.parametrize(("hyper", "blocks", "held", "layers"), [
    ({"num_unique_blocks": 2}, 2, {"num_unique_blocks": 2, "pseudo_depth": "shared"}, 4),
    ({"num_unique_blocks": 1}, 4, {"num_unique_blocks": None, "pseudo_depth": "shared"}, 4),
    ({"num_unique_blocks": 1}, 2, {"num_unique_blocks": 2, "pseudo_depth": "shared"}, 4),
    ({"num_unique_blocks": 1, "pseudo_depth": "shallow"}, 1, {"num_unique_blocks": 1, "pseudo_depth": "shallow"}, 1),
    ({"num_unique_blocks": 1, "pseudo_depth": "shallow", "growth_init": "zero_outputs"}, 2,
     {"num_unique_blocks": 2, "pseudo_depth": "shallow", "growth_init": "zero_outputs"}, 2),
    ({"num_unique_blocks": 2, "pseudo_depth": "shallow", "growth_init": "zero_outputs"}, 4,
     {"num_unique_blocks": None, "pseudo_depth": "shared", "growth_init": "copy"}, 4),
], ids=["pseudo", "delinked", "staged", "shallow", "partly grown", "grown"])
def test_a_causal_lm_checkpoint_is_described_as_the_model_it_holds(hyper, blocks, held, layers) -> None:
    from lightning_p2r.causal_lm import hf_config_as_held
    from lightning_p2r.module import structure_as_held

    result = structure_as_held(hyper, {"num_unique_blocks": blocks}, depth=4)
    assert result == {"growth_init": "copy", **held}
    config = {"model_type": "qwen3", "num_hidden_layers": 4, "layer_types": ["full_attention"] * 4}
    assert hf_config_as_held(config, result, 4, "num_hidden_layers") == {
        **config, "num_hidden_layers": layers, "layer_types": ["full_attention"] * layers}
    assert hf_config_as_held({"model_type": "gpt2", "n_layer": 4}, result, 4, "n_layer")["n_layer"] == layers


def test_convert_to_safetensors_describes_a_grown_and_upcycled_m6_model(tmp_path: Path) -> None:
    """The config.json of `--to safetensors` held the hyperparameters as the module was created: after growth and
    upcycling it described a 2-block model with one shared FFN per layer, which the 4 blocks of 4 experts each in
    model.safetensors do not fit. Now it describes the model the tensors hold, which loads them and gives the same
    logits."""
    import json

    from safetensors.torch import load_file

    from lightning_p2r import M6Config, M6LanguageModel
    from lightning_p2r.cli.convert import main as convert
    from lightning_p2r.sharing import delink

    module = M6LanguageModel(M6Config(vocab_size=VOCAB, max_seq_len=16, num_layers=4, dim=16, num_heads=2,
                                      num_experts=4, num_unique_experts=1, num_unique_blocks=2,
                                      pseudo_depth="shallow", sharing="cycle"))
    module.configure_model()
    delink(module.transformer)  # grows 2 layers into 4 and upcycles the shared FFN into 4 experts
    ids = windows(rows=2)[:, :-1]
    with torch.no_grad():
        expected = module.eval()(ids).logits
    convert(["--to", "safetensors", str(_saved(module, tmp_path / "grown.ckpt")), str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    held = written["hyper_parameters"]["config"]
    assert (held["num_unique_blocks"], held["num_unique_experts"], held["pseudo_depth"]) == (None, None, "shared")
    rebuilt = M6LanguageModel(**written["hyper_parameters"])
    rebuilt.configure_model()
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    rebuilt.load_state_dict({**tensors, **{alias: tensors[name] for alias, name in written["tied"].items()}})
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(ids).logits, expected)


def test_a_failed_conversion_leaves_no_hidden_partial_directory(tmp_path: Path) -> None:
    from lightning_p2r.cli.convert import _write_dir

    def fails(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError, match="the writer failed"):
        _write_dir(tmp_path / "out", fails)
    assert list(tmp_path.iterdir()) == []  # was: .out.partial with half a model in it


def test_convert_names_why_a_checkpoint_has_no_hugging_face_form(tmp_path: Path, capsys) -> None:
    from lightning_p2r import M6Config, M6LanguageModel
    from lightning_p2r.cli.convert import main as convert

    module = M6LanguageModel(M6Config(vocab_size=VOCAB, max_seq_len=16, num_layers=2, dim=16, num_heads=2))
    module.configure_model()
    with pytest.raises(SystemExit):
        convert(["--to", "hf", str(_saved(module, tmp_path / "m6.ckpt")), str(tmp_path / "hf")])
    assert "m6.ckpt is an M6LanguageModel checkpoint, which records no Hugging Face config: --to hf writes " \
           "Hugging Face models only; use --to safetensors" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_convert_to_safetensors_writes_an_m6_checkpoint_once_per_tensor(tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file

    from lightning_p2r import M6Config, M6LanguageModel
    from lightning_p2r.cli.convert import main as convert

    module = M6LanguageModel(M6Config(vocab_size=VOCAB, max_seq_len=16, num_layers=2, dim=16, num_heads=2,
                                      num_experts=2))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(windows(), batch_size=4))
    trainer.save_checkpoint(tmp_path / "m6.ckpt")
    convert(["--to", "safetensors", str(tmp_path / "m6.ckpt"), str(tmp_path / "out")])
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    state = module.state_dict()
    config = __import__("json").loads((tmp_path / "out" / "config.json").read_text())
    assert config["tied"] == {"transformer.lm_head.weight": "transformer.tok_embeddings.weight"}
    assert set(tensors) | set(config["tied"]) == set(state)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, state[name])
    assert config["hyper_parameters"]["config"]["num_layers"] == 2

    # --overwrite replaces only this command's own output (a new-user audit: SRC SRC --overwrite deleted the source,
    # and an unrelated folder as destination went too); a folder where a file goes is refused before writing.
    convert(["--to", "safetensors", str(tmp_path / "m6.ckpt"), str(tmp_path / "out"), "--overwrite"])
    assert (tmp_path / "out" / "model.safetensors").is_file()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    refusals = [(["--to", "safetensors", str(tmp_path / "m6.ckpt"), str(tmp_path / "m6.ckpt"), "--overwrite"],
                 "would replace or sit inside the checkpoint it converts"),
                (["--to", "safetensors", str(tmp_path / "m6.ckpt"), str(mine), "--overwrite"],
                 "is not a folder this command wrote"),
                (["--to", "checkpoint", str(tmp_path / "m6.ckpt"), str(mine), "--overwrite"],
                 "is a folder: this conversion writes one checkpoint file")]
    for argv, message in refusals:
        with pytest.raises(SystemExit):
            convert(argv)
        assert message in capsys.readouterr().err
    assert (tmp_path / "m6.ckpt").is_file() and (mine / "notes.txt").read_text() == "kept"
    assert [path.name for path in tmp_path.iterdir() if path.name.endswith(".partial")] == []


@pytest.mark.parametrize("layout", ["zero3_offload_layered", "offload_layered"])
def test_a_litgpt_gpt_built_in_place_trains_like_the_eager_build(tmp_path: Path, layout: str) -> None:
    pytest.importorskip("litgpt", reason="litgpt is not installed (pip install --no-deps litgpt)")

    def fit(strategy: object) -> tuple[list[float], CausalLMModule]:
        module = CausalLMModule(litgpt_config=LITGPT, optimizer={"lr": 1e-2, "warmup_steps": 0}, init_seed=3)
        losses = Losses()
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                  enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                  use_distributed_sampler=False, default_root_dir=tmp_path, callbacks=[losses],
                  ).fit(module, torch.utils.data.DataLoader(windows(), batch_size=4))
        return losses.losses, module

    expected, eager = fit("auto")
    losses, module = fit(P2RStrategy(**LAYOUTS[layout]))
    assert losses == pytest.approx(expected, rel=1e-5)
    assert expected[-1] < expected[0]
    # litgpt's rotary tables (cos, sin buffers), computed at construction, recomputed by GPT.reset_parameters
    torch.testing.assert_close(module.model.cos, eager.model.cos)
    assert list(module.state_dict()) == list(eager.state_dict())



def test_a_decoder_without_a_config_reads_its_width_from_its_embedding() -> None:
    """A user's own decoder has no ``config.hidden_size``: the pipeline's stand-in embeddings take the width of the
    first declared nn.Embedding (it was refused: "cannot tell the hidden size")."""
    from hf_models import NanoGPT, nano_parts

    from lightning_p2r.models.decoders import DecoderParts, hidden_size

    assert hidden_size(NanoGPT(dim=48), nano_parts()) == 48
    with pytest.raises(ValueError, match=r"none of its declared embeddings \['ln_f'\] is an nn.Embedding"):
        hidden_size(NanoGPT().transformer, DecoderParts(blocks="h", embed=("ln_f",), norm="ln_f", head="ln_f"))


def test_buffers_above_the_parameters_root_are_recomputed_when_materialized() -> None:
    """A pipeline rank without the head holds its parameters under ``transformer``, below litgpt's ``GPT`` that owns
    the rotary tables: they are recomputed by the GPT's rule all the same (they were left uninitialized: NaN)."""
    pytest.importorskip("litgpt", reason="litgpt is not installed (pip install --no-deps litgpt)")
    from litgpt import GPT, Config

    from lightning_p2r.strategy.materialize import Initializer, allocate
    from lightning_p2r.strategy.ties import smallest_parameter_root

    eager = GPT(Config(**LITGPT))
    with torch.device("meta"):
        gpt = GPT(Config(**LITGPT))
    gpt.lm_head = None  # the last stage's part, on another rank
    outer = nn.Module()
    outer.model = gpt
    assert smallest_parameter_root(outer) is gpt.transformer
    initializer = Initializer(outer, None, seed=3)
    initializer.fill(allocate(outer, "cpu"))
    initializer.finish()
    torch.testing.assert_close(gpt.cos, eager.cos)
    torch.testing.assert_close(gpt.sin, eager.sin)


def test_the_embedding_runs_the_models_own_forward_when_the_pipeline_replaced_it() -> None:
    """The pipeline replaces the forward of the module holding the blocks on the instance (evaluation through the
    stages); for litgpt's GPT that module is also the one whose forward embeds: the stage's embedding still runs
    GPT.forward, and the replacement stays."""
    pytest.importorskip("litgpt", reason="litgpt is not installed (pip install --no-deps litgpt)")
    from litgpt import GPT, Config

    from lightning_p2r.models.decoders import KNOWN_DECODERS, embed_and_block_call

    gpt = GPT(Config(**LITGPT))

    def through_the_stages(*args, **kwargs):
        raise AssertionError("a pipeline evaluation started from inside a stage")

    gpt.forward = through_the_stages
    tokens = torch.randint(0, VOCAB, (2, 8))
    hidden, call = embed_and_block_call(gpt, KNOWN_DECODERS["litgpt"], tokens, gpt.transformer.h)
    torch.testing.assert_close(hidden, gpt.transformer.wte(tokens))
    assert len(call.args) >= 2  # cos and sin, which GPT.forward passes to its blocks
    assert gpt.forward is through_the_stages

@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_hf_expert_plan_is_read_and_splits_the_experts_alone(family: str) -> None:
    from lightning_p2r.protocols import StackedExperts
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    model = _declared(family)
    plan = model_plan(model, tensor_parallel=1, expert_parallel=2)
    # gate and up packed in one tensor: no hidden-unit split; down_proj (experts x dim x hidden) by its inputs.
    assert plan.experts == {"mlp.experts": StackedExperts({"gate_up_proj": None, "down_proj": 2}, call="top_k")}
    assert all(entries == {} for entries in plan.blocks) and plan.outside == {}
    assert [module for module, _ in plan.stacked_experts(model)] == [layer.mlp.experts for layer in model.model.layers]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_under_tensor_parallelism_an_hf_moe_splits_its_packed_experts_by_expert(family: str) -> None:
    from lightning_p2r.protocols import StackedExperts
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    model = _declared(family)
    plan = model_plan(model, tensor_parallel=2)
    declared = StackedExperts({"gate_up_proj": None, "down_proj": 2}, call="top_k")
    assert plan.experts == {"mlp.experts": declared} and declared.splits_by_expert_over_tensor_parallel
    # The sparse MoE block is the plan's expert layer (whole sequence under sequence parallelism); the experts' own
    # tensor-parallel styles (moe_tp_experts, packed_colwise, rowwise) are not applied to them.
    assert plan.blocks[0]["mlp"] == "expert"
    assert not any(name.startswith("mlp.") for entries in plan.blocks for name in entries)
    assert [layer for layer in plan.expert_layers(model)] == [layer.mlp for layer in model.model.layers]
    assert not StackedExperts({"w1": 1, "w2": 2}, call="top_k").splits_by_expert_over_tensor_parallel


class _UserExperts(nn.Module):
    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1, self.w2 = nn.Parameter(torch.randn(experts, 8, 4)), nn.Parameter(torch.randn(experts, 4, 8))


def _user_moe(experts, count: int = 4) -> nn.Module:
    """A user's own block stack whose MoE layer declares its stacked experts (``ParallelPlan.experts``)."""
    from lightning_p2r.protocols import ParallelPlan

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.ModuleDict({"moe": _UserExperts(count)})])
            self.layer_to_block = [0]

        def parallel_plan(self) -> ParallelPlan:
            return ParallelPlan(({},), {}, experts={"moe": experts})

    return Model()


@pytest.mark.parametrize(("declared", "count", "degrees", "message"), [
    ({"w1": 1, "w3": 2}, 4, (1, 2), r"names .*_UserExperts\.w3, which is not a stacked weight"),
    ({"w1": 1, "w2": 2}, 6, (1, 4), r"expert_parallel=4\) gives each rank an equal share of .*6 experts: use "
                                     r"expert_parallel in \[1, 2, 3, 6\]"),
    # no hidden-unit dimension: split by expert over both degrees, whose product must divide the experts
    ({"w1": None, "w2": 2}, 4, (4, 2), r"tensor_parallel=4, expert_parallel=2\) splits .*_UserExperts's 4 experts "
                                       r"by expert over both"),
    ({"w1": 1, "w2": 1}, 4, (3, 1), r"tensor_parallel=3 must divide the hidden units of .*_UserExperts\.w1 \(8\)"),
])
def test_a_declared_expert_plan_the_layout_cannot_split_is_refused_by_name(declared: dict, count: int,
                                                                            degrees: tuple, message: str) -> None:
    from lightning_p2r.protocols import StackedExperts
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    with pytest.raises(ValueError, match=message):
        model_plan(_user_moe(StackedExperts(declared, call="top_k"), count), *degrees)
    assert model_plan(_user_moe(StackedExperts({"w1": 1, "w2": 2}, call="top_k")), 2, 2).experts


def test_experts_without_a_hidden_unit_dimension_split_by_expert_only_when_called_top_k() -> None:
    from lightning_p2r.protocols import StackedExperts
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    packed = {"w1": None, "w2": 2}
    assert model_plan(_user_moe(StackedExperts(packed, call="top_k")), 2, 2).experts
    with pytest.raises(ValueError, match=r"tensor_parallel=2 cannot split .*_UserExperts\.w1 by hidden unit .* "
                                         r"splits by expert only a module called as 'top_k'"):
        model_plan(_user_moe(StackedExperts(packed, call="sorted")), 2, 1)
    assert model_plan(_user_moe(StackedExperts(packed, call="sorted")), 1, 2).experts  # expert parallelism alone


def test_the_streaming_engine_names_an_hf_models_host_masters_by_the_models_own_names(tmp_path: Path) -> None:
    class Masters(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
            self.names = set(trainer.strategy.streamer.host_tensors())
            self.state = set(pl_module.state_dict())

    masters = Masters()
    module = CausalLMModule(hf_config=CONFIGS["llama"], optimizer={"warmup_steps": 0})
    L.Trainer(accelerator="cpu", devices=1, strategy=P2RStrategy(offload_fraction=0.5), max_steps=1, logger=False,
              enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
              use_distributed_sampler=False, default_root_dir=tmp_path, callbacks=[masters],
              ).fit(module, torch.utils.data.DataLoader(windows(), batch_size=4))
    assert masters.names and masters.names <= masters.state
    assert all(name.startswith("model.model.layers.") for name in masters.names)


def _litgpt(**overrides) -> nn.Module:
    pytest.importorskip("litgpt", reason="litgpt is not installed (pip install --no-deps litgpt)")
    from hf_models import LITGPT_GQA
    from litgpt import GPT, Config

    from lightning_p2r.models.litgpt_plan import declare_litgpt_plan

    with torch.device("meta"):
        gpt = GPT(Config(**(LITGPT_GQA | overrides)))
    vars(gpt)["blocks"] = gpt.transformer.h  # the strategy's alias of the declared block list
    declare_litgpt_plan(gpt)  # as CausalLMModule does
    return gpt


def test_litgpts_packed_qkv_splits_by_its_parts_and_each_attention_gets_the_ranks_head_counts() -> None:
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    gpt = _litgpt()
    plan = model_plan(gpt, tensor_parallel=2)
    assert plan.blocks[0] == {"attn.qkv": "packed_column", "attn.proj": "row", "mlp.fc_1": "column",
                              "mlp.fc_2": "column", "mlp.proj": "row",
                              # for sequence parallelism (inert without it)
                              "attn": "gather", "mlp": "gather", "norm_1": "sequence", "norm_2": "sequence"}
    assert plan.outside == {"transformer.wte": "vocabulary", "lm_head": "output", "transformer.ln_f": "sequence"}
    assert plan.packed == {"attn.qkv": (32, 16, 16)}  # 4 query heads, 2 key/value groups, of 8 each
    assert sum(plan.packed["attn.qkv"]) == gpt.transformer.h[0].attn.qkv.out_features
    plan.on_tensor_parallel(2)
    attention = gpt.transformer.h[0].attn
    assert (attention.config.n_head, attention.config.n_query_groups, attention.config.head_size) == (2, 1, 8)
    assert gpt.config.n_head == 4  # the model's own config (rotary tables, generation) is unchanged


@pytest.mark.parametrize(("overrides", "degrees", "message"), [
    ({}, (4, 1), r"tensor_parallel=4 must divide GPT's n_query_groups=2$"),
    ({"norm_qk": True}, (2, 1), r"norm_qk=True"),
    # litgpt's MoE keeps its experts as separate modules: no stacked weights to deal out by expert
    ({"mlp_class_name": "LLaMAMoE", "n_expert": 4, "n_expert_per_token": 2, "moe_intermediate_size": 16}, (1, 2),
     r"expert_parallel=2 deals out stacked expert weights .* declares none in its expert layer block 0's 'mlp'"),
    ({"mlp_class_name": "LLaMAMoE", "n_expert": 4, "n_expert_per_token": 2, "moe_intermediate_size": 6}, (4, 1),
     r"tensor_parallel=4 must divide GPT's n_query_groups=2, moe_intermediate_size=6$"),
    # (pp2 x tp2 ran into a gloo size mismatch at the stages' shape inference: 672 bytes against 512)
    ({"mlp_class_name": "LLaMAMoE", "n_expert": 4, "n_expert_per_token": 2, "moe_intermediate_size": 16},
     (2, 1, 2), r"tensor_parallel=2 with pipeline_parallel=2 cannot split GPT's expert layer block 0's 'mlp'"),
])
def test_what_tensor_parallelism_cannot_split_in_litgpt_is_refused_in_one_line(overrides: dict, degrees: tuple,
                                                                                 message: str) -> None:
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    with pytest.raises(ValueError, match=message):
        model_plan(_litgpt(**overrides), *degrees)


def test_litgpts_moe_is_an_expert_layer_whose_experts_split_like_its_dense_mlps() -> None:
    """litgpt's ``LLaMAMoE`` (a router and a list of gated-MLP experts, a shared expert beside them): the router
    whole, every expert split by column and row; under sequence parallelism the MoE layer gathers the sequence as a
    whole and its experts' row layers all-reduce (their rows are routed tokens, not sequence positions), while the
    dense first layer gathers at its MLP as a dense model does."""
    from hf_models import LITGPT_MOE
    from torch.distributed.tensor import Replicate, Shard

    from lightning_p2r.strategy.parallel.parallelize import model_plan
    from lightning_p2r.strategy.parallel.tensor import styles

    gpt = _litgpt(**LITGPT_MOE)
    plan = model_plan(gpt, tensor_parallel=2)
    assert plan.blocks[0]["mlp"] == "gather" and plan.blocks[0]["mlp.fc_1"] == "column"  # first_k_dense_replace
    moe = plan.blocks[1]
    assert moe["mlp"] == "expert" and "mlp.gate" not in moe
    for expert in [f"mlp.experts.{i}" for i in range(4)] + ["mlp.shared_experts"]:
        assert (moe[f"{expert}.fc_1"], moe[f"{expert}.fc_2"], moe[f"{expert}.proj"]) == ("column", "column", "row")
        assert expert not in moe  # no gather inside the expert layer
    made = styles(moe, sequence_parallel=True, gathers=True, packed=plan.packed)
    assert made["mlp.experts.0.proj"].output_layouts == (Replicate(),)
    assert made["mlp.experts.0.fc_1"].input_layouts == (Replicate(),)
    assert made["attn.proj"].output_layouts == (Shard(1),)


def test_gpt2s_conv1d_layers_split_along_their_stored_dimensions_by_the_packages_plan() -> None:
    """GPT-2's plan, with what sequence parallelism adds (once refused: its forward views the final norm's output by
    the whole sequence length, and the losses differed)."""
    from torch.distributed.tensor import Replicate

    from lightning_p2r.models.gpt2_plan import declare_gpt2_plan
    from lightning_p2r.strategy.parallel.parallelize import check_sequence_parallel, model_plan

    gpt2 = _declared("gpt2")
    declare_gpt2_plan(gpt2)
    plan = model_plan(gpt2, tensor_parallel=2)
    split = {"attn.c_attn": "packed_column", "attn.c_proj": "row", "mlp.c_fc": "column", "mlp.c_proj": "row"}
    # for sequence parallelism (inert without it): the attention and the MLP gather, the norms run on the rank's
    # positions, the final norm gathers (GPT2Model.forward views its output by the whole length)
    assert plan.blocks[0] == split | {"attn": "gather", "mlp": "gather", "ln_1": "sequence", "ln_2": "sequence"}
    assert plan.transposed == set(split) and plan.packed == {"attn.c_attn": (32, 32, 32)}
    assert plan.outside == {"transformer.wte": "vocabulary", "transformer.ln_f": "gather", "lm_head": "output"}
    plan.on_tensor_parallel(2)
    assert gpt2.transformer.h[0].attn.split_size == 16
    with pytest.raises(ValueError, match=r"tensor_parallel=3 must divide GPT2LMHeadModel's n_head=4, n_inner=128, "
                                         r"vocab_size=64"):
        model_plan(gpt2, tensor_parallel=3)
    check_sequence_parallel(gpt2, plan)  # accepted
    from lightning_p2r.strategy.parallel.tensor import styles

    made = styles(plan.blocks[0], sequence_parallel=True, gathers=True, packed=plan.packed,
                  transposed=plan.transposed)
    assert made["mlp.c_proj"].scatter and not made["mlp.c_fc"].scatter
    assert styles(plan.outside, sequence_parallel=True, gathers=True)["lm_head"].input_layouts == (Replicate(),)
    with pytest.raises(ValueError, match=r"sequence parallelism splits mlp\.c_fc, a layer the plan declares "
                                         r"transposed .* only inside a module that gathers the sequence"):
        styles({"mlp.c_fc": "column"}, sequence_parallel=True, transposed=frozenset({"mlp.c_fc"}))


def test_a_data_vocabulary_larger_than_the_embedding_is_refused_at_setup_naming_the_field() -> None:
    """Byte tokens (256 ids) into a 64-row embedding failed mid-step with "IndexError: index out of range in self"
    (a device-side assert on CUDA); M6LanguageModel checked it, CausalLMModule did not. Refused now in setup, before
    the model is built, naming where its size is set (hf_config, litgpt_config, a given model's embedding)."""
    from types import SimpleNamespace

    def setup(module: CausalLMModule, data_vocab: int) -> None:
        module._trainer = SimpleNamespace(datamodule=SimpleNamespace(vocab_size=data_vocab))  # what setup reads
        module.setup("fit")

    with pytest.raises(ValueError, match=r"tokenizer has 256 ids but CausalLMModule.hf_config's vocab_size is 64: "
                                         r"ids >= 64 .* CausalLMModule\(vocab_size=256\)"):
        setup(CausalLMModule(hf_config=CONFIGS["llama"]), 256)
    setup(CausalLMModule(hf_config=CONFIGS["llama"]), VOCAB)  # fits
    setup(CausalLMModule(hf_config=CONFIGS["llama"], vocab_size=256), 256)  # the override the message names
    with pytest.raises(ValueError, match=r"but CausalLMModule.litgpt_config's padded_vocab_size is 64"):
        setup(CausalLMModule(litgpt_config=LITGPT), 256)
    given = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIGS["llama"]))
    with pytest.raises(ValueError, match=r"but the token embedding of LlamaForCausalLM \(its rows\) is 64"):
        setup(CausalLMModule(model=given), 256)
    setup(CausalLMModule(model=nn.Linear(2, 2)), 256)  # no embedding it can find: nothing refused here
