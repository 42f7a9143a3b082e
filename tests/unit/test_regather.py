"""The plain-copy helpers behind delinking a sharded model (the DTensor paths run in tests/distributed)."""

import pytest
import torch
from torch import nn

from lightning_p2r.models.module_init import meta_template
from lightning_p2r.strategy.regather import (
    gather_plain_module,
    gather_plain_optimizer,
    replace_submodule,
    shard_optimizer,
)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(3)
        self.register_buffer("scale", torch.tensor([2.0]))


def test_meta_template_holds_no_data_and_keeps_ties() -> None:
    model = Tied()
    template = meta_template(model)
    assert all(p.device.type == "meta" for p in template.parameters())
    assert template.head.weight is template.embed.weight
    assert model.embed.weight.device.type == "cpu"  # the original is untouched


def test_gather_plain_module_copies_values_and_ties() -> None:
    model = Tied()
    plain = gather_plain_module(model, meta_template(model))
    assert plain.head.weight is plain.embed.weight
    for (name, ours), theirs in zip(plain.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(ours, theirs, msg=name)
        assert ours.data_ptr() != theirs.data_ptr()  # a copy, not a view


def test_gather_plain_module_rejects_an_outdated_template() -> None:
    model = Tied()
    template = meta_template(model)
    template.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="template is out of date"):
        gather_plain_module(model, template)


def test_optimizer_round_trip_keeps_groups_hyperparameters_and_state() -> None:
    model = Tied()
    optimizer = torch.optim.AdamW([{"params": [model.embed.weight], "weight_decay": 0.1},
                                   {"params": list(model.norm.parameters()), "weight_decay": 0.0}], lr=3e-3)
    model.head(model.norm(model.embed(torch.tensor([1, 2])))).sum().backward()
    optimizer.step()
    plain = gather_plain_module(model, meta_template(model))
    plain_optimizer = gather_plain_optimizer(optimizer, model, plain)
    assert [g["weight_decay"] for g in plain_optimizer.param_groups] == [0.1, 0.0]
    torch.testing.assert_close(plain_optimizer.state[plain.embed.weight]["exp_avg"],
                               optimizer.state[model.embed.weight]["exp_avg"])
    names = {id(p): n for n, p in plain.named_parameters()}
    rebuilt = shard_optimizer(plain_optimizer, names, model)  # plain target: state moves as is
    assert rebuilt.param_groups[0]["params"][0] is model.embed.weight
    torch.testing.assert_close(rebuilt.state[model.norm.weight]["exp_avg_sq"],
                               optimizer.state[model.norm.weight]["exp_avg_sq"])


def test_gather_plain_optimizer_refuses_parameters_outside_the_module() -> None:
    model, stray = Tied(), nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    with pytest.raises(ValueError, match="outside the sharded module"):
        gather_plain_optimizer(optimizer, model, gather_plain_module(model, meta_template(model)))


def test_replace_submodule_replaces_every_reference() -> None:
    outer = nn.Module()
    inner, new = Tied(), Tied()
    outer.model = inner
    outer.alias = inner
    replace_submodule(outer, inner, new)
    assert outer.model is new and outer.alias is new
    with pytest.raises(ValueError, match="not a submodule"):
        replace_submodule(outer, inner, new)


def test_gather_plain_module_shares_live_attributes_and_trainability() -> None:
    """The copy holds the live module's own config object (delinking updates it for everyone) and its current
    requires_grad flags, not the template's from setup time."""
    model = Tied()
    model.config = {"num_unique_blocks": 1}
    template = meta_template(model)
    model.norm.weight.requires_grad_(False)
    plain = gather_plain_module(model, template)
    assert plain.config is model.config
    assert not plain.norm.weight.requires_grad and plain.norm.bias.requires_grad
