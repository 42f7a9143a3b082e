"""``lightning-p2r plan`` and ``lightning-p2r calibrate`` as a user runs them: a table, a recipe fragment that the
strategy accepts, and clear errors for wrong inputs."""

import re
from pathlib import Path

import pytest
import yaml

from lightning_p2r import P2RStrategy
from lightning_p2r.cli import main
from lightning_p2r.planning import load_cluster

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
CLUSTER = RECIPES / "clusters" / "a100_80gb_x8.yaml"


def plan(capsys, *args: str) -> str:
    main(["plan", "--cluster", str(CLUSTER), "--config", str(RECIPES / "tp_ep_moe.yaml"), *args])
    return capsys.readouterr().out


def test_plan_prints_the_fastest_layouts_and_a_fragment_the_strategy_accepts(capsys) -> None:
    out = plan(capsys, "--devices", "8", "--top", "3", "--micro-batches", "1,2")
    assert "valid layouts priced" in out and "tokens_per_s" in out and "pseudo_step_s" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("rank"))
    assert [line.split()[0] for line in lines[header + 1: header + 4]] == ["1", "2", "3"]
    fragment = yaml.safe_load(out[out.index("trainer:"):])
    P2RStrategy(**fragment["trainer"]["strategy"]["init_args"])  # every option is one the strategy takes
    assert fragment["data"]["seq_len"] == 64


def test_plan_writes_every_fitting_layout_to_csv(capsys, tmp_path) -> None:
    plan(capsys, "--devices", "4", "--sharding", "zero3", "--csv", str(tmp_path / "plans.csv"))
    rows = (tmp_path / "plans.csv").read_text().splitlines()
    assert rows[0].startswith("rank,layout,tokens_per_s") and len(rows) > 2
    assert all(",zero3" in row for row in rows[1:])


@pytest.mark.parametrize(("args", "message"), [
    (["--sharding", "zero4"], "--sharding: ['zero4'] not among"),
    (["--micro-batches", "two"], "--micro-batches: expected comma-separated numbers"),
    (["--top", "0"], "--top must be >= 1"),
    (["--devices", "12"], "must be a multiple of devices_per_node"),
])
def test_plan_refuses_bad_options_by_name(capsys, args, message) -> None:
    with pytest.raises(SystemExit) as exit_:
        plan(capsys, *args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_refuses_a_missing_or_wrong_cluster_file(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(tmp_path / "none.yaml"), "--config", str(RECIPES / "quickstart.yaml")])
    err = capsys.readouterr().err
    assert "cluster file" in err and "does not exist" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices: 8\ndevice_memory: -80GB\n")
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(bad), "--config", str(RECIPES / "quickstart.yaml")])
    assert "device_memory" in capsys.readouterr().err


def test_plan_refuses_a_cluster_file_without_the_machines_size_and_speed(capsys, tmp_path) -> None:
    """Every field has a default (an 8 x A100 node's): a file giving only ``accelerator: cpu`` was priced as one,
    183k tokens/s predicted where its machine ran 9k (a new-user audit)."""
    sparse = tmp_path / "sparse.yaml"
    sparse.write_text("accelerator: cpu\ndevices: 1\n")
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(sparse), "--config", str(RECIPES / "quickstart.yaml")])
    assert "sparse.yaml does not give ['device_memory', 'device_flops']: the planner would price the defaults' 8 x " \
           "A100" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--global-batch", "0"], "--global-batch must be >= 1, got 0"),
    (["--devices", "0"], "--devices must be >= 1, got 0"),
    (["--offload-fractions", "0,1.5"], "--offload-fractions: each value must be in [0.0, 1.0], got '0,1.5'"),
    (["--micro-batches", "0,2"], "--micro-batches: each value must be >= 1, got '0,2'"),
])
def test_plan_refuses_search_options_out_of_range(flags: list[str], message: str, capsys) -> None:
    """``--global-batch 0`` was taken as "the recipe's", and offload fractions outside [0, 1] were priced."""
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(RECIPES / "clusters" / "a100_80gb_x8.yaml"), "--config",
              str(RECIPES / "quickstart.yaml"), *flags])
    assert message in capsys.readouterr().err


def test_a_mistyped_cluster_field_and_a_recipe_given_as_cluster_are_named(capsys, tmp_path) -> None:
    typo = tmp_path / "typo.yaml"
    typo.write_text("devices: 1\ndevice_memroy: 24GB\ndevice_flops: 1e11\n")
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(typo), "--config", str(RECIPES / "quickstart.yaml")])
    assert "unknown field(s) ['device_memroy'] (did you mean: device_memroy -> device_memory?)" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(RECIPES / "quickstart.yaml"), "--config", str(RECIPES / "quickstart.yaml")])
    assert "this looks like a recipe (its ['data', 'model', 'trainer'] sections), not a cluster file" in \
        capsys.readouterr().err


def test_plan_says_when_its_options_leave_no_valid_layout(capsys) -> None:
    """Three micro-batches of a batch of 16 run nowhere: that was "no layout fits: add devices, memory..."."""
    with pytest.raises(SystemExit, match=r"no valid layout: each --micro-batches count must divide"):
        main(["plan", "--cluster", str(RECIPES / "clusters" / "a100_80gb_x8.yaml"), "--config",
              str(RECIPES / "quickstart.yaml"), "--devices", "1", "--micro-batches", "3", "--global-batch", "16"])


def test_plan_says_when_nothing_fits(capsys, tmp_path) -> None:
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text("devices: 1\ndevices_per_node: 1\ndevice_memory: 1MB\nhost_memory_per_node: 1MB\n"
                    "device_flops: 1T\n")
    with pytest.raises(SystemExit, match="no layout fits"):
        main(["plan", "--cluster", str(tiny), "--config", str(RECIPES / "quickstart.yaml")])


@pytest.mark.slow
def test_calibrate_writes_a_cluster_file_of_this_machine(capsys, tmp_path) -> None:
    out = tmp_path / "here.yaml"
    main(["calibrate", "--processes", "1", "--quick", "--out", str(out)])
    cluster = load_cluster(out)
    assert cluster.devices == 1 and cluster.device_flops > 1e8 and cluster.memory_bandwidth > 1e7
    assert cluster.accelerator == "cpu"  # the expert kernel "auto" picks here is the loop
    assert out.read_text().startswith("# Measured by `lightning-p2r calibrate`")
    # The offloaded copies' bandwidth inside training, from two timed probes (or the copy alone, when they say
    # nothing): never above what the copy alone ran at.
    assert "# host_device_bandwidth: " in out.read_text() and "the copy alone" in out.read_text()
    # The reference step plan times again, and the machine it was measured on (plan re-times it only there).
    from lightning_p2r.measure.speed import machine_name

    assert 1e-4 < cluster.reference_step_seconds < 1.0 and cluster.calibrated_on == machine_name("cpu")
    capsys.readouterr()
    main(["plan", "--cluster", str(out), "--config", str(RECIPES / "quickstart.yaml"), "--top", "1"])
    assert "speed check: the reference step took" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["calibrate", "--processes", "0", "--out", str(out)])
    assert "processes and threads must be >= 1" in capsys.readouterr().err


def test_plan_shows_how_far_each_step_moves_with_the_fitted_terms_spread(capsys, tmp_path) -> None:
    """With a calibrated file (fitted terms and their leave-one-out ranges), each row has step_low_s <= step_s <=
    step_high_s; a file without a spread has no such columns."""
    import csv

    docs = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
    calibrated = docs / "planner_user_xeon_seed151_cluster-2.yaml"
    out = tmp_path / "plan.csv"
    main(["plan", "--cluster", str(calibrated), "--config", str(RECIPES / "quickstart.yaml"), "--csv", str(out)])
    assert "step_low_s" in capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    assert rows and all(float(r["step_low_s"]) <= float(r["step_s"]) <= float(r["step_high_s"]) for r in rows)
    assert any(float(r["step_low_s"]) < float(r["step_high_s"]) for r in rows)
    main(["plan", "--cluster", str(CLUSTER), "--config", str(RECIPES / "quickstart.yaml"), "--csv", str(out)])
    assert "step_low_s" not in capsys.readouterr().out and "step_low_s" not in out.read_text()


def test_calibrate_refuses_zero_probe_rounds_before_measuring_anything(capsys, tmp_path) -> None:
    out = tmp_path / "here.yaml"
    with pytest.raises(SystemExit):
        main(["calibrate", "--processes", "2", "--probe-rounds", "0", "--out", str(out)])
    assert "--probe-rounds must be at least 1, got 0" in capsys.readouterr().err
    for processes in ("1", "2"):  # one process fits the offloaded copies' bandwidth from probes too
        with pytest.raises(SystemExit):
            main(["calibrate", "--processes", processes, "--no-fit", "--probe-rounds", "3", "--out", str(out)])
        assert "--probe-rounds shapes the fits from timed probe layouts, which --no-fit skips" in (
            capsys.readouterr().err)
    assert not out.exists()


def test_plan_names_a_wrong_model_field_of_the_recipe(capsys, tmp_path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  config:\n    num_layer: 4\n")
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(CLUSTER), "--config", str(recipe)])
    assert "model.config.num_layer is not an M6Config field; did you mean num_layers?" in capsys.readouterr().err
    recipe.write_text("model:\n  config:\n    num_heads: 5\n")
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(CLUSTER), "--config", str(recipe)])
    assert "model.config: M6Config.num_heads (5) must divide dim" in capsys.readouterr().err


def test_plan_reads_the_m6_model_either_way_a_recipe_writes_it_and_refuses_any_other_model(capsys, tmp_path) -> None:
    """``model.config`` and ``model.class_path: lightning_p2r.M6LanguageModel`` with ``init_args.config`` are the same
    model to plan; a recipe for another class (a litgpt model through CausalLMModule, a user's module) was priced as
    M6's defaults without a word, and is refused in one line before anything is priced; a misspelt option too (a
    Hugging Face decoder is priced: test_hf_planning)."""
    from lightning_p2r.planning.cli import recipe_inputs

    plain = yaml.safe_load((RECIPES / "quickstart.yaml").read_text())
    named = plain | {"model": {"class_path": "lightning_p2r.M6LanguageModel", "init_args": plain["model"]}}
    (tmp_path / "named.yaml").write_text(yaml.safe_dump(named))
    assert recipe_inputs(tmp_path / "named.yaml") == recipe_inputs(RECIPES / "quickstart.yaml")
    assert recipe_inputs(RECIPES / "quickstart.yaml")[0].num_layers == plain["model"]["config"]["num_layers"]

    litgpt = yaml.safe_load((RECIPES / "hf_moe.yaml").read_text())
    litgpt["model"]["init_args"] = {"litgpt_config": {"n_layer": 2, "n_embd": 32, "n_head": 4}}
    (tmp_path / "litgpt.yaml").write_text(yaml.safe_dump(litgpt))
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--cluster", str(CLUSTER), "--config", str(tmp_path / "litgpt.yaml")])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "prices CausalLMModule built from a Hugging Face hf_config" in captured.err
    assert "a model without hf_config is not priced" in captured.err and "rank" not in captured.out
    for model, message in (({"confg": {"num_layers": 2}}, "model.confg is not an option of M6LanguageModel"),
                           ({"class_path": "lightning_p2r.M6LanguageModel", "init_args": {"cfg": {}}},
                            "model.init_args.cfg is not an option"),
                           ({"class_path": "my_package.MyModule"}, "model.class_path is my_package.MyModule")):
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"model": model}))
        with pytest.raises(ValueError, match=re.escape(message)):
            recipe_inputs(tmp_path / "bad.yaml")


def test_plan_refuses_a_file_that_is_not_a_recipe_naming_what_it_looks_like(capsys, tmp_path) -> None:
    """A cluster file given as --config was read as a recipe without a model and priced as M6's defaults."""
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--cluster", str(CLUSTER), "--config", str(CLUSTER)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown recipe section(s) attention_flops, device_flops, device_memory, devices and" in err
    assert "it looks like a cluster file: pass it to --cluster" in err
    (tmp_path / "typo.yaml").write_text("trainer: {}\nmodels:\n  config: {}\n")
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(CLUSTER), "--config", str(tmp_path / "typo.yaml")])
    err = capsys.readouterr().err
    assert "unknown recipe section(s) models (a recipe has" in err and "cluster file" not in err


def test_the_planned_model_takes_the_recipes_sequence_length_and_vocabulary_as_fit_does(tmp_path) -> None:
    """A recipe with data.seq_len above M6Config's default max_seq_len (128) was planned, and trialled, with 128:
    the trial's first step then failed on the longer sequences."""
    from lightning_p2r.planning.cli import recipe_inputs

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  config:\n    num_layers: 2\n    dim: 64\n    num_heads: 2\n"
                      "data:\n  seq_len: 256\n  vocab_size: 1024\n")
    config, settings = recipe_inputs(recipe)
    assert (config.max_seq_len, config.vocab_size, settings["seq_len"]) == (256, 1024, 256)
    recipe.write_text("model:\n  config:\n    num_layers: 2\n    dim: 64\n    num_heads: 2\n"
                      "data:\n  tokenizer: bytes\n")
    config, _ = recipe_inputs(recipe)
    assert (config.max_seq_len, config.vocab_size) == (128, 256)


def test_plan_warns_when_the_cluster_file_lacks_a_term_its_layouts_count(capsys, tmp_path) -> None:
    """Issue 41 item 1: a file without a framework term (older, or never fitted here) prices the layouts that count
    it short; ``plan`` says which term, how many of the shown layouts count it, and where the value comes from."""
    out = plan(capsys, "--devices", "8", "--top", "5", "--micro-batches", "1,2")
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warnings and all("layouts shown count it" in line for line in warnings if "attention_rates" not in line)
    assert any("calibrate" in line or "cross-validate" in line for line in warnings)
    assert any("has no attention_rates" in line and "heads of" in line for line in warnings)
    complete = yaml.safe_load(CLUSTER.read_text()) | {
        term: 1e-5 for term in ("batch_overhead", "module_hook_overhead", "stage_overhead", "dtensor_overhead",
                                "blocking_collective_overhead", "expert_wait_overhead")} | {
        "attention_rates": [[s, h, 1e14] for s in (256, 1024) for h in (64, 128)]}
    path = tmp_path / "complete.yaml"
    path.write_text(yaml.safe_dump(complete))
    main(["plan", "--cluster", str(path), "--config", str(RECIPES / "tp_ep_moe.yaml"), "--devices", "8", "--top", "5",
          "--micro-batches", "1,2"])
    assert "warning:" not in capsys.readouterr().out


def test_plan_warns_when_a_cpu_file_predates_the_per_token_layer_costs(capsys, tmp_path) -> None:
    """Issue 41 item 1: a CPU file calibrated before the per-token and expert-stacking costs existed prices CPU steps
    20-30% short; ``plan`` names the missing fields and says to calibrate again. A file that has them does not warn."""
    old = {"name": "old-cpu", "accelerator": "cpu", "devices": 1, "devices_per_node": 1, "device_memory": "24GB",
           "device_flops": 1e11,
           "attention_flops": 3e10, "memory_bandwidth": 4e10, "elementwise_bandwidth": 7e9,
           "dense_layer_overhead": 3e-4, "moe_layer_overhead": 7e-4, "overlap_collectives": False,
           "overlap_copies": False}
    for name, extra, warned in (("old", {}, True), ("new", {"moe_expert_weight_overhead": 8e-10,
                                                              "dense_token_overhead": 5e-7}, False)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(old | extra))
        main(["plan", "--cluster", str(path), "--config", str(RECIPES / "quickstart.yaml"), "--devices", "1",
              "--top", "2"])
        lines = [line for line in capsys.readouterr().out.splitlines() if "per-token layer costs" in line]
        assert bool(lines) == warned, name
        if warned:
            assert "moe_expert_weight_overhead" in lines[0] and "calibrate again" in lines[0]


def test_plan_warns_when_a_file_cannot_price_a_pipelines_checkpointing(capsys, tmp_path) -> None:
    """A pipeline's recompute checkpoints each layer, which on a CPU costs about twice one more forward; a file with
    the layer costs but not the checkpoint costs prices it as the forward: ``plan`` says so when it shows such a
    layout, and not with a file that has them."""
    old = {"name": "old-cpu", "accelerator": "cpu", "devices": 2, "devices_per_node": 2, "device_flops": 1e11,
           "attention_flops": 3e10, "memory_bandwidth": 4e10, "elementwise_bandwidth": 7e9, "device_memory": 3e7,
           "dense_layer_overhead": 3e-4, "moe_layer_overhead": 7e-4, "moe_expert_weight_overhead": 8e-10,
           "overlap_collectives": False, "overlap_copies": False}
    for name, extra, warned in (("old", {}, True), ("new", {"dense_checkpoint_overhead": 6e-4,
                                                              "moe_checkpoint_overhead": 1e-3}, False)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(old | extra))
        main(["plan", "--cluster", str(path), "--config", str(RECIPES / "quickstart.yaml"), "--devices", "2",
              "--top", "20", "--offload-fractions", "0"])
        out = capsys.readouterr().out
        assert re.search(r"pp2 \S+ m\d+ recompute", out)  # a small device, no offload: pipelines recompute
        lines = [line for line in out.splitlines() if "no checkpoint costs" in line]
        assert bool(lines) == warned, name
        if warned:
            assert "dense_checkpoint_overhead" in lines[0] and "calibrate again" in lines[0]


def test_plan_prices_a_cpu_run_with_the_file_calibrated_for_its_process_count(capsys, tmp_path) -> None:
    """Issue 41 item 1: on a CPU the constants depend on how many processes loaded the machine while they were
    measured; a one-process run priced by a two-process file came out 36% slow (median). ``plan`` takes the file of
    the run's count among several, and warns when only another count's file is given."""
    from lightning_p2r.planning.cluster import Cluster, cluster_for, write_cluster

    files = {}
    for processes, overhead in ((1, 0.004), (2, 0.016)):
        files[processes] = tmp_path / f"cpu-{processes}.yaml"
        write_cluster(Cluster(name=f"cpu{processes}", accelerator="cpu", devices=processes, devices_per_node=processes,
                              step_overhead=overhead, overlap_collectives=False, overlap_copies=False),
                      files[processes])
    clusters = [load_cluster(files[2]), load_cluster(files[1])]
    chosen, warning = cluster_for(clusters, 1)
    assert (chosen.name, chosen.devices, warning) == ("cpu1", 1, None)
    chosen, warning = cluster_for(clusters[:1], 1)
    assert chosen.name == "cpu2" and chosen.devices == 1 and "--processes 1" in warning
    assert cluster_for(clusters, None) == (clusters[0], None)
    gpu = Cluster(devices=8, devices_per_node=8)
    assert cluster_for([gpu], 16)[1] is None  # GPU constants do not depend on the process count
    recipe = str(RECIPES / "quickstart.yaml")
    main(["plan", "--cluster", str(files[2]), "--config", recipe, "--devices", "1", "--top", "1"])
    assert "calibrated with 2 process(es) and the run has 1" in capsys.readouterr().out
    main(["plan", "--cluster", str(files[2]), str(files[1]), "--config", recipe, "--devices", "1", "--top", "1"])
    out = capsys.readouterr().out
    assert "calibrated with" not in out and "cluster cpu1: 1 devices" in out


@pytest.mark.parametrize(("trainer_precision", "priced", "param_bytes", "optimizer_bytes"), [
    ("bf16-true", "bf16-true", 2, 4), ("16-true", "bf16-true", 2, 4), ("bf16-mixed", "bf16-mixed", 4, 8),
    ("16-mixed", "bf16-mixed", 4, 8), ("bf16", "bf16-mixed", 4, 8), ("32", "32-true", 4, 8), (32, "32-true", 4, 8)])
def test_the_recipes_precision_is_priced_as_the_run_keeps_its_parameters(trainer_precision, priced, param_bytes,
                                                                          optimizer_bytes, capsys, tmp_path) -> None:
    """``bf16-true`` was priced as bf16-mixed until 2026-12-01: fp32 parameters, gradients and moments, twice the
    bytes such a run keeps and ZeRO moves (counted: tests/distributed/test_mixed_precision_counts.py)."""
    import argparse

    from lightning_p2r.planning.cli import recipe_inputs, workload_for

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"trainer": {"precision": trainer_precision},
                                      "model": {"config": {"num_layers": 2, "dim": 64, "num_heads": 2}}}))
    _, settings = recipe_inputs(recipe)
    workload = workload_for(settings, argparse.Namespace(precision=None, global_batch=None, seq_len=None), recipe)
    assert (workload.precision, workload.param_bytes, workload.optimizer_bytes_per_param) == (
        priced, param_bytes, optimizer_bytes)
    assert workload.activation_bytes == (4 if priced == "32-true" else 2)
    main(["plan", "--cluster", str(CLUSTER), "--config", str(recipe), "--top", "1", "--devices", "1"])
    assert f"tokens, {priced}" in capsys.readouterr().out


@pytest.mark.parametrize(("flag", "priced"), [("16-mixed", "bf16-mixed"), ("16", "bf16-mixed"),
                                               ("bf16", "bf16-mixed"), ("16-true", "bf16-true"), ("32", "32-true")])
def test_the_precision_flag_takes_the_recipes_spellings(flag: str, priced: str, capsys) -> None:
    """``--precision 16-mixed`` was refused by argparse while ``trainer.precision: 16-mixed`` was priced as
    bf16-mixed (a new-user audit)."""
    out = plan(capsys, "--precision", flag, "--top", "1", "--devices", "1")
    assert f"tokens, {priced}" in out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "16-mixed" in re.sub(r"\s+", " ", capsys.readouterr().out.split("--precision PRECISION")[-1])


def test_a_misspelled_strategy_option_in_the_recipe_is_refused_with_the_closest_name(capsys, tmp_path) -> None:
    """``offload_fracton: 0.5`` was ignored: the plan priced the run without it, where fit refuses the recipe (a
    new-user audit)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("trainer:\n  strategy:\n    class_path: lightning_p2r.P2RStrategy\n    init_args:\n"
                      "      offload_fracton: 0.5\nmodel:\n  config:\n    num_layers: 2\n")
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--cluster", str(CLUSTER), "--config", str(recipe)])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith("trainer.strategy.init_args.offload_fracton is not an option of P2RStrategy (did you "
                          "mean 'offload_fraction'?)"), error


def test_the_planners_list_of_strategy_options_is_the_strategys_signature() -> None:
    """The planner spells the names out to stay torch-free (tests/unit/test_imports.py)."""
    import inspect

    from lightning_p2r.planning.cli import P2R_STRATEGY_OPTIONS

    signature = [name for name in inspect.signature(P2RStrategy.__init__).parameters if name != "self"]
    assert list(P2R_STRATEGY_OPTIONS) == signature, "copy P2RStrategy's keywords into planning/cli.py"


def test_a_precision_the_planner_has_no_widths_for_is_refused_naming_the_flag(capsys, tmp_path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("trainer:\n  precision: 64-true\nmodel:\n  config:\n    num_layers: 2\n")
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(CLUSTER), "--config", str(recipe)])
    assert "trainer.precision='64-true' is not priced" in capsys.readouterr().err
    main(["plan", "--cluster", str(CLUSTER), "--config", str(recipe), "--precision", "32-true", "--top", "1",
          "--devices", "1"])
    assert "tokens, 32-true" in capsys.readouterr().out


@pytest.mark.parametrize(("strategy", "accumulate", "expected"), [
    (None, 1, {}),
    ("ddp", 4, {"micro_batches": 4}),
    ({"class_path": "lightning_p2r.P2RStrategy", "init_args": {"sharding": "zero3", "offload_fraction": 0.5}}, 1,
     {"sharding": "zero3", "offload_fraction": 0.5}),
    ({"class_path": "lightning_p2r.P2RStrategy", "init_args": {"tensor_parallel": 2}}, 2,
     {"tensor_parallel": 2, "micro_batches": 2}),
    ({"class_path": "lightning_p2r.P2RStrategy", "init_args": {"accumulation": "layered", "micro_batches": 4}}, 1,
     {"accumulation": "layered", "micro_batches": 4}),
])
def test_the_recipes_own_layout_is_read_from_its_strategy_and_accumulation(strategy, accumulate, expected) -> None:
    from lightning_p2r.planning import Layout
    from lightning_p2r.planning.cli import recipe_layout

    layout, _ = recipe_layout({"strategy": strategy, "accumulate": accumulate})
    assert layout == Layout(**expected)


@pytest.mark.parametrize(("strategy", "reason"), [
    ("fsdp", "its strategy fsdp is not one the planner prices"),
    ({"class_path": "lightning.pytorch.strategies.FSDPStrategy"}, "FSDPStrategy is not one the planner prices"),
    ({"class_path": "lightning_p2r.P2RStrategy", "init_args": {"device_memory_budget": "12GB"}},
     "device_memory_budget decides at setup"),
])
def test_a_recipes_layout_the_planner_cannot_price_says_why(strategy, reason) -> None:
    from lightning_p2r.planning.cli import recipe_layout

    layout, description = recipe_layout({"strategy": strategy, "accumulate": 1})
    assert layout is None and reason in description


def test_plan_says_where_the_recipes_own_layout_ranks(capsys, tmp_path) -> None:
    """The recipe's layout (tp2 x ep2 under ZeRO-3) priced beside the plan: its step, its ratio to the best, and how
    many of the layouts that fit are faster, counted from the CSV of every fitting layout; on more devices than its
    batch splits over, why it cannot run; on devices too small, why it does not fit."""
    out = plan(capsys, "--devices", "8", "--csv", str(tmp_path / "plans.csv"))
    line = next(line for line in out.splitlines() if line.startswith("the recipe's own layout"))
    match = re.fullmatch(r"the recipe's own layout \(zero3 tp2 ep2\): (\S+) s per step, (\S+)x the best layout's; "
                         r"(\d+) of the (\d+) that fit are faster", line)
    assert match, line
    import csv

    rows = list(csv.DictReader((tmp_path / "plans.csv").open()))
    own = float(match.group(1))
    best = float(rows[0]["step_s"])
    assert float(match.group(2)) == pytest.approx(own / best, abs=0.01)
    assert int(match.group(4)) == len(rows)
    faster = sum(float(row["step_s"]) < own * (1 - 1e-3) for row in rows)
    assert faster <= int(match.group(3)) <= sum(float(row["step_s"]) < own * (1 + 1e-3) for row in rows)
    assert "the recipe's own layout (zero3 tp2 ep2) cannot run on 64 devices: the global batch (16) must split" in \
        plan(capsys)
    small = tmp_path / "small.yaml"
    small.write_text(CLUSTER.read_text().replace("device_memory: 80GB", "device_memory: 2MB"))
    with pytest.raises(SystemExit, match="no layout fits"):
        main(["plan", "--cluster", str(small), "--config", str(RECIPES / "tp_ep_moe.yaml"), "--devices", "8"])
    assert "the recipe's own layout (zero3 tp2 ep2) does not fit: device memory" in capsys.readouterr().out
