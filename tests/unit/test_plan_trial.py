"""``lightning-p2r plan --trial K``: the K best layouts run on this machine, measured beside predicted, and the
refusals when they cannot run here."""

import pytest
import yaml

from lightning_p2r.cli import main
from lightning_p2r.measure.run import host_threads
from lightning_p2r.measure.trial import run_trials, trial_refusal, trial_spec
from lightning_p2r.models.config import M6Config
from lightning_p2r.planning import Cluster, write_cluster
from lightning_p2r.planning.layout import Layout, Workload

TINY = {"vocab_size": 64, "max_seq_len": 16, "num_layers": 2, "dim": 16, "num_heads": 2, "num_experts": 2,
        "moe_layers": [1], "capacity_factor": None, "init_seed": 0}


def _inputs(tmp_path, devices: int = 1):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"config": TINY}, "data": {"batch_size": 4, "seq_len": 16},
                                      "trainer": {"devices": devices}}))
    cluster = tmp_path / "cluster.yaml"
    write_cluster(Cluster(name="here", devices=devices, devices_per_node=devices, device_memory=8e9,
                          device_flops=50e9, attention_flops=20e9, memory_bandwidth=10e9,
                          elementwise_bandwidth=5e9, operator_overhead=2e-5, overlap_collectives=False,
                          overlap_copies=False), cluster)
    return ["plan", "--cluster", str(cluster), "--config", str(recipe)]


@pytest.mark.slow
def test_trial_runs_the_best_layouts_and_recommends_the_measured_best(capsys, tmp_path) -> None:
    main(_inputs(tmp_path) + ["--trial", "2", "--trial-steps", "3", "--sharding", "none", "--micro-batches", "1,2",
                              "--offload-fractions", "0"])
    out = capsys.readouterr().out
    table = out[out.index("trials:"):]
    assert "trial 1/2" in table and "trial 2/2" in table and "measured_s" in table and "predicted_s" in table
    assert "measured best: rank" in table
    fragment = yaml.safe_load(table[table.index("trainer:"):])
    assert fragment["trainer"]["devices"] == 1


def test_trial_spec_gives_standard_accumulation_to_the_trainer() -> None:
    spec = trial_spec(M6Config(**TINY), Layout(micro_batches=2), Workload(global_batch=4, seq_len=16), devices=1,
                      steps=3, accelerator="cpu", out="x")
    assert spec["accumulate_grad_batches"] == 2 and "micro_batches" not in spec["strategy"]
    layered = trial_spec(M6Config(**TINY), Layout(micro_batches=2, accumulation="layered"),
                         Workload(global_batch=4, seq_len=16), devices=1, steps=3, accelerator="cpu", out="x")
    assert layered["accumulate_grad_batches"] == 1 and layered["strategy"]["micro_batches"] == 2


def test_trials_time_the_host_with_the_threads_a_run_would_use(monkeypatch) -> None:
    """One thread per process on CPU (each process is a device); beside GPUs the cores divided among the processes:
    an offloaded block's host optimizer timed on one thread would run several times slower than in the run."""
    assert host_threads("cpu", 2, 16) == 1
    assert host_threads("cuda", 1, 16) == 16 and host_threads("cuda", 4, 16) == 4 and host_threads("cuda", 8, 4) == 1
    monkeypatch.setattr("lightning_p2r.measure.run.usable_cores", lambda: 16)
    args = (M6Config(**TINY), Layout(), Workload(global_batch=4, seq_len=16))
    assert trial_spec(*args, devices=2, steps=3, accelerator="cuda", out="x")["threads"] == 8
    assert trial_spec(*args, devices=2, steps=3, accelerator="cpu", out="x")["threads"] == 1


def test_trial_refusals_are_one_line() -> None:
    assert "must be >= 1" in trial_refusal(0, 1, "cpu", 2)
    message = trial_refusal(2, 16, "cuda", 8)
    assert "need 16 devices" in message and "8 GPUs" in message and "\n" not in message
    assert trial_refusal(2, 2, "cpu", 2) is None


@pytest.mark.parametrize(("args", "message"), [
    (["--trial", "0"], "--trial must be >= 1"), (["--trial", "1", "--trial-steps", "2"], "--trial-steps must be >= 3"),
    (["--trial", "1", "--trial-rounds", "0"], "--trial-rounds must be >= 1"),
    (["--trial-steps", "30"], "--trial-steps applies only to trials: add --trial K"),
    (["--trial-steps", "30", "--trial-rounds", "3"], "--trial-steps and --trial-rounds apply only to trials")])
def test_plan_refuses_a_bad_trial(capsys, tmp_path, args, message) -> None:
    with pytest.raises(SystemExit):
        main(_inputs(tmp_path) + args)
    assert message in capsys.readouterr().err


def test_plan_refuses_a_trial_on_more_devices_than_this_machine_has(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit):
        main(_inputs(tmp_path, devices=1) + ["--devices", "512", "--trial", "1"])
    assert "need 512 devices" in capsys.readouterr().err


def _scripted_trials(monkeypatch, seconds: list[float]) -> list[str]:
    """Replace the worker by ``seconds`` returned in call order; the layouts in the order they ran."""
    order, left = [], list(seconds)

    def run_trial(spec):
        order.append(spec["name"])
        return left.pop(0)

    monkeypatch.setattr("lightning_p2r.measure.trial.run_trial", run_trial)
    return order


def test_trial_rounds_run_the_layouts_in_turn_and_compare_medians(monkeypatch) -> None:
    """Round-robin, so that a drifting machine slows every layout alike; each layout's median and range."""
    order = _scripted_trials(monkeypatch, [0.30, 0.20, 0.10, 0.21, 0.12, 0.50])
    layouts = [(Layout(), 0.1), (Layout(micro_batches=2), 0.2)]
    workload = Workload(global_batch=4, seq_len=16)
    rows = run_trials(M6Config(**TINY), layouts, workload, devices=1, steps=3, accelerator="cpu", rounds=3)
    assert order == ["none", "none m2"] * 3
    assert [row["measured_s"] for row in rows] == [0.12, 0.21]
    assert (rows[0]["measured_min_s"], rows[0]["measured_max_s"]) == (0.10, 0.30)
    assert rows[1]["error_pct"] == pytest.approx(100 * (0.2 - 0.21) / 0.21)
    _scripted_trials(monkeypatch, [0.4])
    one, = run_trials(M6Config(**TINY), layouts[:1], workload, devices=1, steps=3, accelerator="cpu")
    assert one["measured_s"] == 0.4 and "measured_min_s" not in one


def test_plan_prints_each_layouts_median_and_range_over_its_rounds(capsys, monkeypatch, tmp_path) -> None:
    order = _scripted_trials(monkeypatch, [0.3, 0.15, 0.1, 0.15])
    main(_inputs(tmp_path) + ["--trial", "2", "--trial-rounds", "2", "--sharding", "none", "--micro-batches", "1,2",
                              "--offload-fractions", "0"])
    out = capsys.readouterr().out
    table = out[out.index("trials:"):]
    assert "in turn 2 times" in table and "(round 2/2)" in table and "measured_min_s" in table
    assert order[:2] == order[2:] and len(set(order)) == 2
    # The first layout's median (0.2) is above the second's (0.15), though its best round (0.1) was the fastest.
    assert f"measured best: rank 2 ({order[1]}, 0.15 s per step)" in table
