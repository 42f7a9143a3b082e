"""One rulebook for the strategy and the planner: over the planner's whole search space, for a dense and an MoE
model, the planner accepts a layout exactly when the strategy does (built from the layout's keywords, checked
against the processes before any process group, and against the model before anything is placed)."""

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_p2r import M6Config, P2RStrategy
from lightning_p2r import layout as rules
from lightning_p2r.layout import Layout, ModelShape, check_layout
from lightning_p2r.planning import Cluster, Workload
from lightning_p2r.planning import check_layout as planner_check
from lightning_p2r.planning.search import SearchSpace, layout_space

DENSE = M6Config(vocab_size=64, max_seq_len=16, num_layers=4, dim=32, num_heads=4, moe_layers=[],
                 num_unique_blocks=1)
MOE = M6Config(vocab_size=64, max_seq_len=16, num_layers=4, dim=32, num_heads=4, num_experts=4, num_prototypes=2,
               moe_layers=[1, 3])
WORK = Workload(global_batch=8, seq_len=16)
CLUSTER = Cluster(devices=8, devices_per_node=8)


def _verdict(check) -> str:
    try:
        check()
    except ValueError as error:
        return f"refused: {error}"
    return "accepted"


def _strategy_verdict(layout: Layout, config: M6Config, devices: int) -> str:
    def check() -> None:
        strategy = P2RStrategy(**layout.strategy_options())
        environment = LightningEnvironment()
        environment.set_world_size(devices)
        strategy.cluster_environment = environment
        # The planner prices accelerators: the strategy is checked as if on them.
        strategy.parallel_devices = [torch.device("cuda", i) for i in range(devices)]
        strategy._check_path_options()
        strategy.check_model_sizes(type("Holder", (), {"config": config})())
    return _verdict(check)


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense-pseudo", "moe"])
def test_the_planner_accepts_a_layout_exactly_when_the_strategy_does(config: M6Config) -> None:
    space = SearchSpace(offload_fractions=(0.0, 0.5))
    layouts = list(dict.fromkeys(layout_space(config, CLUSTER, WORK, space)))
    disagreements, accepted = [], 0
    for layout in layouts:
        planner = _verdict(functools.partial(planner_check, layout, config, CLUSTER, WORK))
        strategy = _strategy_verdict(layout, config, CLUSTER.devices)
        accepted += planner == "accepted"
        if (planner == "accepted") != (strategy == "accepted"):
            disagreements.append(f"{layout.describe()}: planner {planner}; strategy {strategy}")
    assert not disagreements, "\n".join(disagreements[:10])
    # The space holds both kinds, so the comparison means something in both directions.
    assert 0 < accepted < len(layouts), (accepted, len(layouts))
    print(f"{config.num_experts if config.moe_layers else 0} experts: {accepted} of {len(layouts)} layouts accepted")


def test_each_rule_group_names_the_keyword_and_the_numbers() -> None:
    shape = ModelShape.of(MOE)
    with pytest.raises(ValueError, match=r"tensor_parallel=3\) must divide the number of processes \(8\)"):
        check_layout(Layout(tensor_parallel=3), devices=8)
    with pytest.raises(ValueError, match=r"num_heads=4 must be divisible"):
        check_layout(Layout(tensor_parallel=8), devices=8, model=shape)
    with pytest.raises(ValueError, match=r"shared by two stages of one pipeline rank"):
        check_layout(Layout(pipeline_parallel=2, stages_per_rank=2, pipeline_schedule="looped_bfs", micro_batches=2),
                     devices=2, model=ModelShape.of(DENSE))
    with pytest.raises(ValueError, match=r"micro_batches=4\) must divide the 6 sequences"):
        check_layout(Layout(accumulation="layered", micro_batches=4), sequences=6)
    check_layout(Layout(accumulation="layered", micro_batches=4), devices=8, model=shape, sequences=8)


def test_the_rulebook_imports_only_the_standard_library_and_itself() -> None:
    for path in Path(rules.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names}
        modules |= {node.module.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
        assert modules <= set(sys.stdlib_module_names), (path.name, modules - set(sys.stdlib_module_names))
        # Relative imports stay inside the package (one dot).
        assert all(node.level <= 1 for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)), path.name


def test_the_planner_loads_neither_the_strategy_nor_the_benchmarks() -> None:
    code = ("import sys; import lightning_p2r.planning; "
            "bad = [m for m in sys.modules if m.startswith(('lightning_p2r.strategy', 'lightning_p2r.benchmarks'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_default_all_moe_config_counts_as_moe() -> None:
    every_layer_moe = M6Config(vocab_size=64, max_seq_len=16, num_layers=4, dim=32, num_heads=4, num_experts=4)
    assert every_layer_moe.moe_layers is None and ModelShape.of(every_layer_moe).moe
    check_layout(Layout(expert_parallel=2), devices=2, model=ModelShape.of(every_layer_moe))


def test_zero1_with_a_memory_budget_across_accelerator_processes_is_refused_before_setup() -> None:
    """A budget asks for offload as a fraction does (the blocks are chosen at setup): ZeRO-1 across accelerator
    processes cannot broadcast host-resident partitions, so the rulebook refuses it before any process group."""
    budget = Layout(sharding="zero1", device_memory_budget="1GB")
    assert budget.offloading and budget.path(2) == "fsdp"
    with pytest.raises(ValueError, match="sharding='zero1'.* offloaded blocks across processes"):
        check_layout(budget, devices=2)
    check_layout(budget, devices=2, accelerator=False)  # gloo broadcasts host tensors
    check_layout(budget, devices=1)  # one process: the block streamer, no broadcast
    strategy = P2RStrategy(sharding="zero1", device_memory_budget="1GB")
    assert strategy.layout == budget
    environment = LightningEnvironment()
    environment.set_world_size(2)
    strategy.cluster_environment = environment
    strategy.parallel_devices = [torch.device("cuda", i) for i in range(2)]
    assert strategy.path == "fsdp"
    with pytest.raises(ValueError, match="sharding='zero1'.* offloaded blocks across processes"):
        strategy._check_path_options()


@pytest.mark.parametrize(("layout", "after_each_forward", "after_last_micro_batch"), [
    (Layout(sharding="zero3"), True, False),
    (Layout(sharding="zero3", accumulation="layered", micro_batches=2), False, True),
    (Layout(sharding="zero3", pipeline_parallel=2, micro_batches=2), True, False),  # 1F1B: depth-first
    (Layout(sharding="zero3", pipeline_parallel=2, pipeline_schedule="gpipe", micro_batches=2), False, True),
    # Expert parallelism inside breadth-first stages: the experts' units follow their block's rule (gathered once
    # for the stage's micro-batches, resharded after the last), not a rule of their own (docs/parallelism.md).
    (Layout(sharding="zero3", expert_parallel=2, pipeline_parallel=2, pipeline_schedule="looped_bfs",
            stages_per_rank=2, micro_batches=2), False, True),
    (Layout(sharding="zero3", pipeline_schedule="gpipe"), True, False),  # a schedule needs stages to count
    (Layout(sharding="zero2", accumulation="layered", micro_batches=2), False, False),
    (Layout(sharding="zero1", pipeline_parallel=2, pipeline_schedule="gpipe", micro_batches=2), False, False),
])
def test_one_reshard_rule_for_every_fsdp2_path_and_the_planner(layout: Layout, after_each_forward: bool,
                                                               after_last_micro_batch: bool) -> None:
    from lightning_p2r.planning.transfers import _gathers_per_step

    assert layout.resharding == rules.Resharding(after_each_forward, after_last_micro_batch)
    if layout.pipelined and layout.sharding == "zero3":
        # The planner counts a stage block's gathers from the same rule: once per direction, or before each
        # forward and once for the backwards.
        assert _gathers_per_step(layout, is_block=True) == (layout.micro_batches + 1 if after_each_forward else 2)


def test_the_sampler_splits_the_data_over_the_data_ranks_only() -> None:
    """Moved from test_engines.py (the rule is the layout's, no engine needed): 4 ranks = data 2 x tensor 2, rank 3
    reads data shard 1 of 2; without tensor or pipeline parallelism every rank reads its own (the default)."""
    assert Layout(tensor_parallel=2).sampler_ranks(4, 3) == (2, 1)
    assert Layout(pipeline_parallel=2, micro_batches=2).sampler_ranks(4, 3) == (2, 1)
    assert Layout(sharding="zero3").sampler_ranks(4, 3) is None


def test_fsdp2_wraps_the_blocks_where_it_has_ranks_to_shard_over_a_split_or_an_offload() -> None:
    pp2 = Layout(pipeline_parallel=2, micro_batches=2)
    assert not pp2.wraps_blocks(2)  # each stage alone on its rank: a mesh of one rank would only add hooks
    assert not Layout(pipeline_parallel=2, micro_batches=2, sharding="zero3").wraps_blocks(2)
    assert pp2.wraps_blocks(4)  # two data ranks per stage
    assert Layout(pipeline_parallel=2, micro_batches=2, tensor_parallel=2).wraps_blocks(4)
    assert Layout(pipeline_parallel=2, micro_batches=2, offload_fraction=0.5).wraps_blocks(2)
    assert Layout(sharding="zero3").wraps_blocks(1) and Layout(sharding="zero2").wraps_blocks(2)
    assert not Layout().wraps_blocks(1) and not Layout().wraps_blocks(2)  # one process; DDP's reducer
    assert Layout(tensor_parallel=2).wraps_blocks(2)


def test_the_planner_gathers_no_parameters_on_a_stage_fsdp2_leaves_plain() -> None:
    from lightning_p2r.planning.memory import estimate_memory

    config = M6Config(vocab_size=256, max_seq_len=32, num_layers=4, dim=64, num_heads=4, num_experts=4)
    workload = Workload(global_batch=8, seq_len=32)
    zero3 = Layout(pipeline_parallel=2, micro_batches=2, sharding="zero3")
    alone = estimate_memory(config, zero3, Cluster(devices=2, devices_per_node=2), workload)
    shared = estimate_memory(config, zero3, Cluster(devices=4, devices_per_node=4), workload)
    assert alone.gathered == 0 and shared.gathered > 0
