"""P2RStrategy's flat keywords land in three typed, frozen, validated sections."""

import dataclasses

import pytest

from lightning_p2r import P2RStrategy
from lightning_p2r.strategy.options import AccumulationConfig, OffloadConfig, ShardingConfig


def test_flat_keywords_are_sorted_into_sections_and_read_back() -> None:
    strategy = P2RStrategy(sharding="zero3", offload_fraction=0.25, accumulation="layered", micro_batches=4,
                           offload_states=["optimizer", "grads"])
    assert strategy.sharding_config == ShardingConfig(sharding="zero3")
    assert strategy.accumulation_config == AccumulationConfig(accumulation="layered", micro_batches=4)
    assert strategy.offload_config.offload_fraction == 0.25
    assert strategy.offload_states == ["grads", "optimizer"]
    assert (strategy.sharding, strategy.micro_batches, strategy.offload_fraction) == ("zero3", 4, 0.25)
    assert P2RStrategy().offload_states == ["grads", "optimizer", "params"]


def test_sections_are_frozen_and_the_flat_names_read_only() -> None:
    strategy = P2RStrategy(sharding="zero2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.sharding_config.sharding = "zero3"
    with pytest.raises(AttributeError):
        strategy.sharding = "zero3"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"recompute": "yes", "accumulation": "layered"}, "P2RStrategy.recompute must be True or False"),
    ({"reduce_every_micro_batch": 1}, "P2RStrategy.reduce_every_micro_batch must be True or False"),
    ({"count_collectives": None}, "P2RStrategy.count_collectives must be True or False"),
    ({"offload_fraction": 0.5, "offload_blocks": [1]}, "takes one of offload_fraction"),
    ({"prefetch": -1}, "P2RStrategy.prefetch must be >= 0"),
    ({"offload_states": ["params"]}, "offload_states must include 'grads' and 'optimizer'"),
])
def test_each_bad_option_is_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        P2RStrategy(**kwargs)


def test_the_docstring_documents_every_keyword_from_the_sections() -> None:
    import inspect

    from lightning_p2r.cli.docs import init_arg_docstrings

    documented = init_arg_docstrings(P2RStrategy)
    for cls in (ShardingConfig, AccumulationConfig, OffloadConfig):
        for field in dataclasses.fields(cls):
            assert documented.get(field.name), field.name
            assert field.name in inspect.signature(P2RStrategy).parameters


def test_the_constructor_takes_each_sections_option_once_in_the_sections_order() -> None:
    import inspect

    from lightning_p2r.strategy.options import OPTION_NAMES, SECTIONS

    parameters = list(inspect.signature(P2RStrategy).parameters)
    assert parameters[:len(OPTION_NAMES)] == list(OPTION_NAMES)
    assert len(set(OPTION_NAMES)) == len(OPTION_NAMES)  # no option in two sections
    for cls in SECTIONS.values():
        for field in dataclasses.fields(cls):
            assert inspect.signature(P2RStrategy).parameters[field.name].default == field.default, field.name


def test_a_stale_generated_signature_is_caught(tmp_path) -> None:
    from lightning_p2r.cli import docs as docs_gen
    from lightning_p2r.strategy.options import GENERATED_BEGIN

    source = docs_gen.STRATEGY_PATH.read_text()
    assert docs_gen.render_strategy(source) == source
    stale = source.replace("        prefetch: int = 1,\n", "")
    assert GENERATED_BEGIN in stale and stale != source
    assert docs_gen.render_strategy(stale) == source


def test_the_rulebooks_layout_reads_only_declared_options() -> None:
    """``Layout`` is the rulebook's resolved reading of the sections (``layout_of``): every field is a declared
    option, and a strategy's layout carries the value it was given."""
    from lightning_p2r.layout import Layout
    from lightning_p2r.strategy.options import OPTION_NAMES

    assert {f.name for f in dataclasses.fields(Layout)} <= set(OPTION_NAMES)
    given = {"sharding": "zero2", "micro_batches": 2, "accumulation": "layered", "recompute": True,
             "offload_fraction": 0.5, "compile": "aot_eager", "reduce_every_micro_batch": True}
    layout = P2RStrategy(**given).layout
    assert {name: getattr(layout, name) for name in given} == given
