"""Declaring a model's blocks without renaming them (issue 38, item 2): a dotted path or detection, the model's own
parameter names kept, and a declaration the model's forward does not follow refused in the first step."""

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_p2r import P2RStrategy
from lightning_p2r.models.module_init import initialize_by_module
from lightning_p2r.sharing import find_block_sequence
from lightning_p2r.strategy.blocks import declare_blocks, detect_block_list, named_block_list

V, D = 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class LitStyle(nn.Module):
    """litgpt's shape: the blocks in ``transformer.h``, a ``ModuleDict`` whose own forward never runs; the model's
    forward runs them. Four routed experts per block in a shorter list (not the blocks)."""

    def __init__(self, layers: int = 3, reverse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(V, D), "h": nn.ModuleList(Block() for _ in range(layers)),
                                          "ln_f": nn.LayerNorm(D)})
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.lm_head = nn.Linear(D, V, bias=False)
        self.reverse = reverse

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(ids)
        for block in (reversed(self.transformer.h) if self.reverse else self.transformer.h):
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class Wrapper(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_the_longest_list_of_one_class_is_detected_and_declared_on_the_module_that_runs_it() -> None:
    module = Wrapper(LitStyle())
    names = list(module.state_dict())
    assert detect_block_list(module)[0] == "net.transformer.h"
    declared = declare_blocks(module, None)
    assert declared.path == "net.transformer.h" and declared.detected
    assert declared.holder_path == "net"  # the ModuleDict's forward never runs: its parent holds the contract
    holder = find_block_sequence(module)
    assert holder is module.net and holder.blocks is module.net.transformer.h and holder.layer_to_block == [0, 1, 2]
    assert list(module.state_dict()) == names  # registered once, under the model's own names
    assert declare_blocks(module, None) == declared  # idempotent


def test_a_users_attribute_called_base_model_does_not_move_the_holder() -> None:
    """Only a Hugging Face task model hands the declaration up from its base model (strategy/blocks.py): a user's
    LightningModule holding its transformer as ``self.base_model`` keeps the transformer as the holder (its own
    forward never runs the blocks)."""

    class Named(Wrapper):
        @property
        def base_model(self) -> nn.Module:
            return self.net

    declared = declare_blocks(Named(LitStyle()), None)
    assert declared.holder_path == "net"


def test_a_dotted_path_chooses_the_list_and_bad_paths_are_refused_by_name() -> None:
    module = Wrapper(LitStyle())
    declared = declare_blocks(module, "net.experts")
    assert declared.path == "net.experts" and not declared.detected and declared.size == 2
    with pytest.raises(ValueError, match=r"has no submodule 'net\.layers'.*'net\.transformer\.h'"):
        declare_blocks(Wrapper(LitStyle()), "net.layers")
    with pytest.raises(ValueError, match="names a Linear"):
        declare_blocks(Wrapper(LitStyle()), "net.lm_head")
    with pytest.raises(ValueError, match="dotted module path"):
        P2RStrategy(blocks="net/layers")


def test_two_equally_long_lists_are_ambiguous() -> None:
    twins = nn.Module()
    twins.encoder = nn.ModuleList(Block() for _ in range(2))
    twins.decoder = nn.ModuleList(Block() for _ in range(2))
    with pytest.raises(ValueError, match=r"\['encoder', 'decoder'\] are equally long; name one with "
                                         r"P2RStrategy\(blocks='<dotted path>'\) or the LightningModule's "
                                         r"block_list\(\) \(protocols.NamesBlockList; .*or hold all the blocks in one"):
        detect_block_list(twins)


class Mixed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_no_block_list_names_each_container_looked_at_and_why_it_was_not_taken() -> None:
    """A model the strategy finds no block list in: the error names every container with why it was not taken and
    how to declare one, instead of "has no block sequence" and a hint about configure_model."""
    from lightning_p2r.strategy.engines.base import holder_of

    module = Wrapper(nn.Module())
    module.net.trunk = nn.Sequential(Block(), Block())
    module.net.single = nn.ModuleList([Block()])
    module.net.mixed = nn.ModuleList([Block(), Mixed(), Block()])
    module.net.named = nn.ModuleDict({"a": Block(), "b": Block()})
    assert detect_block_list(module) is None
    with pytest.raises(ValueError) as refused:
        holder_of(module)
    message = str(refused.value)
    for looked in ("net.trunk (Sequential of 2 x Block): not an nn.ModuleList",
                   "net.single (ModuleList of 1 x Block): fewer than two modules",
                   "net.mixed (ModuleList of 2 x Block, 1 x Mixed): modules of different classes",
                   "net.named (ModuleDict of 2 x Block): not an nn.ModuleList",
                   "P2RStrategy(blocks='<dotted path>')", "block_list()", "protocols.NamesBlockList"):
        assert looked in message, (looked, message)
    assert "configure_model" not in message and "\n" not in message
    with pytest.raises(ValueError, match="found no block list in Wrapper: it has no nn.ModuleList, nn.Sequential"):
        holder_of(Wrapper(nn.Linear(2, 2)))


def test_a_model_that_declares_its_own_blocks_is_left_alone() -> None:
    from lightning_p2r import M6Config
    from lightning_p2r.models import M6Transformer

    model = M6Transformer(M6Config(vocab_size=32, max_seq_len=8, num_layers=2, dim=16, num_heads=2))
    assert declare_blocks(model, None) is None


def _data() -> torch.utils.data.DataLoader:
    data = (torch.randint(0, V, (8, 1), generator=torch.Generator().manual_seed(1)) + torch.arange(9)) % V
    return torch.utils.data.DataLoader(data, batch_size=4)


def _fit(tmp_path: Path, module: Wrapper, strategy: object) -> Wrapper:
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
              default_root_dir=tmp_path).fit(module, _data())
    return module


@pytest.mark.parametrize("options", [{"sharding": "zero3"}, {"offload_fraction": 0.5}], ids=["zero3", "offload"])
def test_a_detected_block_list_trains_like_a_plain_trainer(tmp_path: Path, options: dict) -> None:
    expected = _fit(tmp_path, Wrapper(LitStyle()), "auto").losses
    module = _fit(tmp_path, Wrapper(LitStyle()), P2RStrategy(**options))
    assert module.losses == pytest.approx(expected, rel=1e-6)
    assert "net.transformer.h.0.fc.weight" in module.state_dict()


def test_blocks_run_out_of_order_are_refused_before_the_first_optimizer_step(tmp_path: Path) -> None:
    module = Wrapper(LitStyle(reverse=True))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=r"called its blocks in the order \[2, 1, 0\], not \[0, 1, 2\]"):
        _fit(tmp_path, module, P2RStrategy(sharding="zero2"))
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k].full_tensor() if hasattr(after[k], "full_tensor") else after[k])
               for k in before)


class WithTable(nn.Module):
    """A model whose buffer is computed at construction and again by its ``reset_parameters`` (litgpt's rotary
    cache works this way): built on the meta device, the buffer is recomputed, not left as uninitialized memory."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, V)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D), persistent=False)

    def reset_parameters(self) -> None:
        self.scale = torch.linspace(0.5, 1.5, D, device=self.scale.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BuiltInPlace(Wrapper):
    """``configure_model`` builds the model (on the meta device under P2RStrategy); an eager build is initialized by
    the same per-module rule, so both start equal."""

    def __init__(self) -> None:
        super().__init__(None)

    def configure_model(self) -> None:
        if self.net is None:
            self.net = WithTable()
            if not any(p.is_meta for p in self.net.parameters()):
                initialize_by_module(self, seed=11)

    @property
    def init_seed(self) -> int:
        return 11


@pytest.mark.parametrize("options", [{"sharding": "zero3"}, {"offload_fraction": 0.5}], ids=["zero3", "offload"])
def test_a_model_built_in_place_gets_its_own_reset_parameters_values_and_its_buffers_recomputed(
        tmp_path: Path, options: dict) -> None:
    eager = _fit(tmp_path, BuiltInPlace(), "auto")
    placed = _fit(tmp_path, BuiltInPlace(), P2RStrategy(**options))
    assert placed.losses == pytest.approx(eager.losses, rel=1e-6)
    torch.testing.assert_close(placed.net.scale, torch.linspace(0.5, 1.5, D))


@pytest.mark.parametrize("options", [{}, {"sharding": "zero3"}], ids=["none", "zero3"])
def test_one_process_keeps_the_loaders_own_order(tmp_path: Path, options: dict) -> None:
    """Issue 38 item 7: Lightning gives a distributed strategy's loaders a shuffled ``DistributedSampler``; P2RStrategy
    on one process is not distributed, so a shuffled loader yields the batches a plain Trainer sees."""

    def fit(strategy: object) -> list[float]:
        data = (torch.randint(0, V, (8, 1), generator=torch.Generator().manual_seed(1)) + torch.arange(9)) % V
        loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True,
                                             generator=torch.Generator().manual_seed(3))
        module = Wrapper(LitStyle())
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            default_root_dir=tmp_path)  # Lightning's default use_distributed_sampler=True
        trainer.fit(module, loader)
        assert not isinstance(trainer.train_dataloader.sampler, torch.utils.data.DistributedSampler)
        return module.losses

    assert fit(P2RStrategy(**options)) == pytest.approx(fit("auto"), rel=1e-6)


def test_block_list_alone_names_the_blocks_and_block_holder_is_optional() -> None:
    """A LightningModule with ``block_list()`` and no ``block_holder()`` was not a NamesBlockList (the protocol
    required both): its declaration went unseen and detection took the longest list instead, here 4 experts over
    the 2 declared layers."""

    class Named(Wrapper):
        def block_list(self) -> str:
            return "net.transformer.h"

    class WithHolder(Named):
        def block_holder(self) -> str:
            return "net"

    net = LitStyle(layers=2)
    net.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
    assert detect_block_list(Wrapper(net))[0] == "net.experts"  # what detection alone would take
    module = Named(net)
    assert named_block_list(module, None) == ("net.transformer.h", None)
    declared = declare_blocks(module, *named_block_list(module, None))
    assert (declared.path, declared.holder_path, declared.detected) == ("net.transformer.h", "net", False)
    assert declared.describe().endswith(", as given (blocks=)")  # no named_by: the option gave it
    by_module = declare_blocks(Named(LitStyle()), *named_block_list(module, None), named_by="Named")
    assert by_module.describe() == ("P2RStrategy blocks: net.transformer.h (3 x Block), named by Named.block_list() "
                                    "(pass blocks='...' to choose another)")  # read "as given" with nothing given
    assert named_block_list(WithHolder(LitStyle()), None) == ("net.transformer.h", "net")
    assert named_block_list(WithHolder(LitStyle()), "net.experts") == ("net.experts", None)  # the option wins
    assert named_block_list(Wrapper(LitStyle()), None) == (None, None)


class WithExperts(nn.Module):
    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))


def test_a_list_inside_a_list_of_modules_is_never_taken_as_the_blocks() -> None:
    """A layer's experts are a block's own list: with 2 layers of 4 experts they outnumbered the layers, and with layers
    of two classes (dense and MoE, one MoE layer) the one experts list was the only candidate and was taken silently
    as the blocks (offloading experts instead of layers)."""
    few = nn.Module()
    few.layers = nn.ModuleList(WithExperts() for _ in range(2))
    assert detect_block_list(few)[0] == "layers"  # was: ['layers.0.experts', 'layers.1.experts'] equally long
    mixed = nn.Module()
    mixed.layers = nn.ModuleList([WithExperts(), Block(), Block()])
    assert detect_block_list(mixed) is None  # was: layers.0.experts
    from lightning_p2r.strategy.blocks import why_not_blocks

    assert why_not_blocks(mixed) == ["layers (ModuleList of 1 x WithExperts, 2 x Block): modules of different classes",
                                     "layers.0.experts (ModuleList of 4 x Linear): inside the list layers, so a "
                                     "block's own list"]
    assert declare_blocks(Wrapper(mixed), "net.layers").size == 3  # named, a list of mixed classes is taken

