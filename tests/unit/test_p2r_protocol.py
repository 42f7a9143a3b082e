"""The Pseudo-to-Real benchmark's protocol: run planning, LR choice, paired statistics and the time model."""

import math

import pytest

from lightning_p2r.benchmarks.p2r_protocol import (
    GROWTH_RULE_FRACTION,
    Phase,
    Run,
    ablation_arms,
    best_lr,
    confirmation_arms,
    confirmation_verdict,
    first_crossing,
    growth_arms,
    loss_at,
    main_arms,
    matched_fraction,
    paired_difference,
    seconds_to,
    trunk_of,
    waves,
    wins_on_time,
)
from lightning_p2r.benchmarks.pseudo_to_real import phase_times, timing_specs


def test_main_arms_and_their_delink_steps() -> None:
    arms = {arm.name: arm for arm in main_arms(16)}
    assert list(arms) == ["scratch", "pseudo_only", "p2r", "cycled"]
    assert arms["p2r"].delink_steps(400) == {40: None}
    assert arms["cycled"].blocks == 4 and arms["cycled"].sharing == "cycle"
    assert arms["cycled"].delink_steps(400) == {20: 8, 40: None}
    assert arms["scratch"].delink_steps(400) == {} and arms["pseudo_only"].blocks == 1
    with pytest.raises(ValueError, match="divisible by 4"):
        main_arms(6)


def test_growth_arms_their_points_and_their_model_options() -> None:
    arms = {arm.name: arm for arm in growth_arms(16)}
    assert [name for name, arm in arms.items() if arm.parent is None] == [
        "scratch", "cycled", "stack", "upcycle", "stack_upcycle"]
    # G_stack's point is 1/30 of the budget: step 27 of 800, after a 20-step warmup; the variants 3x either side.
    assert arms["stack"].delink_steps(800) == {27: None} == arms["stack_upcycle"].delink_steps(800)
    assert arms["stack_early"].delink_steps(800) == {9: None} and arms["stack_late"].delink_steps(800) == {80: None}
    assert arms["upcycle"].delink_steps(800) == {80: None}
    assert {arms[n].parent for n in ("stack_early", "stack_late", "stack_zero_outputs")} == {"stack"}
    assert arms["upcycle_reinit"].parent == "upcycle" and arms["upcycle_reinit"].upcycle_router == "reinit"
    assert {arms[n].parent for n in ("drop_upcycle", "drop_upcycle_quarter")} == {"upcycle"}
    assert "--model.config.upcycle_drop=0.5" in arms["drop_upcycle"].cli_args()
    assert "--model.config.upcycle_drop=0.25" in arms["drop_upcycle_quarter"].cli_args()
    assert "--model.config.upcycle_drop=0.0" in arms["upcycle"].cli_args()
    stack = arms["stack_upcycle"].cli_args()
    assert {"--model.config.num_unique_blocks=4", "--model.config.sharing=cycle",
            "--model.config.pseudo_depth=shallow", "--model.config.num_unique_experts=1"} <= set(stack)
    assert "--model.config.num_unique_experts=null" in arms["scratch"].cli_args()
    assert "--model.config.growth_init=zero_outputs" in arms["stack_zero_outputs"].cli_args()
    with pytest.raises(ValueError, match="divisible by 4"):
        growth_arms(6)


def test_growth_arms_build_valid_models() -> None:
    """Every arm's options make a config the model accepts (a typo would only show hours into the benchmark)."""
    from lightning_p2r import M6Config

    for arm in growth_arms(8):
        M6Config(num_layers=8, num_experts=4, **arm.model_options())


def test_branches_wait_for_their_trunk() -> None:
    arms = {arm.name: arm for arm in main_arms(8)}
    arms |= {arm.name: arm for arm in ablation_arms(arms["p2r"], rewarm_steps=5, noise=0.01)}
    runs = [Run(arms["p2r_reset"], 0.01, 1), Run(arms["p2r_init_blocks"], 0.01, 1), Run(arms["scratch"], 0.01, 1),
            Run(arms["p2r_per_layer"], 0.01, 1)]
    first, second = waves(runs, arms)
    assert {r.name for r in first} == {"pseudo_only_lr0.01_s1", "p2r_init_blocks_lr0.01_s1", "scratch_lr0.01_s1",
                                       "p2r_per_layer_lr0.01_s1"}
    assert [r.name for r in second] == ["p2r_reset_lr0.01_s1"]
    assert trunk_of(runs[0], arms) == Run(arms["pseudo_only"], 0.01, 1)
    assert trunk_of(runs[1], arms) is None  # another init: its own shared stage


def test_first_crossing_interpolates_and_says_never() -> None:
    assert first_crossing([0, 10, 20], [5.0, 4.0, 3.0], 3.5) == pytest.approx(15.0)
    assert first_crossing([0, 10], [3.0, 2.0], 3.5) == 0
    assert first_crossing([0, 10], [5.0, 4.0], 3.0) is None


def test_best_lr_takes_the_lowest_mean_and_treats_divergence_as_failure() -> None:
    assert best_lr({0.001: [3.0, 3.2], 0.002: [3.0, 3.0], 0.004: [math.nan]}) == 0.002
    assert best_lr({0.001: [3.0], 0.002: [3.0]}) == 0.001  # ties: the smaller LR


def test_paired_difference_and_its_significance() -> None:
    diff = paired_difference({0: 3.0, 1: 3.1, 2: 2.9, 3: 9.9}, {0: 3.2, 1: 3.25, 2: 3.15})
    assert diff.n == 3 and diff.diffs == pytest.approx((-0.2, -0.15, -0.25))
    assert diff.mean == pytest.approx(-0.2) and diff.se == pytest.approx(0.05 / math.sqrt(3))
    assert diff.significant
    assert not paired_difference({0: 3.0, 1: 3.3}, {0: 3.2, 1: 3.2}).significant  # -0.2 and +0.1: noise
    assert not paired_difference({0: 1.0}, {0: 2.0}).significant  # one seed proves nothing


def test_seconds_to_prices_each_stage_and_each_delink() -> None:
    phases = [Phase(0, 0.5), Phase(40, 1.0)]
    assert seconds_to(20, phases) == pytest.approx(10.0)
    assert seconds_to(100, phases, delink_seconds=2.0) == pytest.approx(40 * 0.5 + 60 * 1.0 + 2.0)
    assert seconds_to(40, phases, delink_seconds=2.0) == pytest.approx(20.0)  # the delink not crossed yet
    # The criterion: 10% pseudo at half the cost buys 5% of the run.
    assert wins_on_time(0.04, 0.1, 0.5) and not wins_on_time(0.06, 0.1, 0.5)
    assert not wins_on_time(0.0, 0.1, 1.0)  # no cheaper steps: no time to win


def test_phase_times_leave_out_warmup_steps_and_price_the_delink() -> None:
    steps = [1.0, 0.5, 0.5, 0.5, 0.5, 3.0, 1.0, 1.0, 1.0, 1.0]  # a delink (+2 s) at step 5
    clock = [sum(steps[: i + 1]) for i in range(len(steps))]
    means, delink = phase_times(clock, [5])
    assert means == pytest.approx([0.5, 1.0])
    assert delink == pytest.approx(2.0)


def test_timing_specs_keep_the_tokens_per_step_and_the_budget(tmp_path) -> None:
    arms = {arm.name: arm for arm in main_arms(8)}
    specs = timing_specs(arms, ("scratch", "p2r", "cycled"), ["--data.batch_size=16"], tmp_path, phase_steps=5,
                         budget=1234, threads=2)
    by_name = {spec["name"]: spec for spec in specs}
    settings, arm_names = ("single", "zero3", "offload"), ("scratch", "p2r", "cycled")
    assert set(by_name) == {f"timing_{s}_{a}" for s in settings for a in arm_names}
    zero3 = by_name["timing_zero3_cycled"]
    assert "--trainer.devices=2" in zero3["args"] and "--data.batch_size=8" in zero3["args"]
    assert zero3["schedule"] == {5: 4, 10: None} and "--trainer.max_steps=15" in zero3["args"]
    assert "--trainer.strategy.device_memory_budget=1234" in by_name["timing_offload_p2r"]["args"]
    grown = timing_specs({arm.name: arm for arm in growth_arms(8)}, ("stack_upcycle",), [], tmp_path, phase_steps=5,
                         budget=1, threads=2)
    assert "--model.config.pseudo_depth=shallow" in grown[0]["args"] and grown[0]["schedule"] == {5: None}


def test_the_time_ratio_at_an_arms_own_final_loss() -> None:
    """A stack arm (first stage at a quarter of the real step) whose final loss scratch reaches at 90% of its steps:
    the arm's whole run over scratch's time to that loss."""
    from lightning_p2r.benchmarks.pseudo_to_real import _own_final_ratio

    stack = {arm.name: arm for arm in growth_arms(16)}["stack_late"]  # grown at step 80 of 800
    measured = {"scratch": {"phases": [0.2], "delink_s": 0.0}, "stack": {"phases": [0.05, 0.2], "delink_s": 1.0}}
    own = 80 * 0.05 + 720 * 0.2 + 1.0
    assert _own_final_ratio(stack, measured, [720.0, 720.0], 800) == pytest.approx(own / (720 * 0.2))
    assert math.isnan(_own_final_ratio(stack, measured, [720.0, None], 800))  # a seed scratch never gets to


def test_confirmation_arms_follow_the_committed_rule() -> None:
    """docs/pseudo_to_real.md, "The confirmation, fixed before it runs": grow 4x at 30% of the steps; scratch, a
    compute-matched scratch, the grown arm and Drop-Upcycling (r = 0.5, at 10%) swept; re-warmup a variant."""
    arms = {arm.name: arm for arm in confirmation_arms(24, warmup_steps=20, matched=0.79)}
    assert [name for name, arm in arms.items() if arm.parent is None] == [
        "scratch", "scratch_matched", "grow", "drop_upcycle"]
    assert GROWTH_RULE_FRACTION == 0.3 and arms["grow"].delink_steps(800) == {240: None}
    assert {"--model.config.num_unique_blocks=6", "--model.config.pseudo_depth=shallow",
            "--model.config.sharing=cycle"} <= set(arms["grow"].cli_args())
    assert arms["drop_upcycle"].delink_steps(800) == {80: None} and arms["drop_upcycle"].upcycle_drop == 0.5
    assert arms["drop_upcycle"].unique_experts == 1
    assert arms["grow_rewarm"].parent == "grow" and arms["grow_rewarm"].rewarm_steps == 20
    assert arms["grow_rewarm"].delink_steps(800) == {240: None}
    matched = arms["scratch_matched"]
    assert matched.blocks is None and not matched.schedule and matched.own_steps(800, 25) == 625  # 632 -> 625
    assert arms["scratch"].own_steps(800, 25) == 800 and matched.own_steps(10, 25) == 25  # at least one interval
    with pytest.raises(ValueError, match="divisible"):
        confirmation_arms(18, warmup_steps=20, matched=0.8)


def test_the_compute_matched_length_is_the_grown_arms_compute() -> None:
    # 30% of the run at a third of a real step, then 70% at full cost.
    assert matched_fraction(0.3, 1 / 3) == pytest.approx(0.8)
    assert matched_fraction(0.3, 1.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="step-time ratio"):
        matched_fraction(0.3, 0.0)


def test_loss_at_reads_a_curve_between_its_samples() -> None:
    assert loss_at([0, 10, 20], [5.0, 4.0, 3.0], 15) == pytest.approx(3.5)
    assert loss_at([0, 10, 20], [5.0, 4.0, 3.0], 10) == 4.0 and loss_at([0, 10], [5.0, 4.0], 0) == 5.0
    assert math.isnan(loss_at([0, 10], [5.0, 4.0], 11)) and math.isnan(loss_at([], [], 1))


def test_the_verdict_needs_all_three_conditions() -> None:
    grow = {3: 4.50, 4: 4.52, 5: 4.49}
    scratch_then = {3: 4.60, 4: 4.61, 5: 4.60}  # scratch's curve at the time grow finished: higher on every seed
    matched = {3: 4.55, 4: 4.57, 5: 4.53}
    verdict = confirmation_verdict(grow, scratch_then, matched, time_ratio=0.86)
    assert verdict["lower_by_2se"] and verdict["sooner"] and verdict["not_worse_than_matched"]
    assert verdict["confirmed"] and verdict["diff_at_equal_time"] == pytest.approx(-0.1, abs=1e-9)
    assert not confirmation_verdict(grow, scratch_then, matched, time_ratio=math.inf)["confirmed"]  # never there
    assert not confirmation_verdict(grow, scratch_then, {3: 4.4, 4: 4.5, 5: 4.45}, 0.86)["confirmed"]  # matched wins
    noisy = {3: 4.70, 4: 4.40, 5: 4.65}  # lower on average, not by 2 standard errors
    assert not confirmation_verdict(grow, noisy, matched, 0.86)["lower_by_2se"]


def test_confirmation_rows_read_scratch_at_the_grown_runs_time() -> None:
    """The grown run (30% of 100 steps at 0.05 s, 70% at 0.2 s, one 1 s delink) takes 16.5 s: scratch (0.2 s per
    step) is at step 82.5 then, read off its curve between its samples at 75 and 100."""
    from lightning_p2r.benchmarks.pseudo_to_real import confirmation_rows

    arms = {arm.name: arm for arm in confirmation_arms(8, warmup_steps=2, matched=0.825)}
    curve = [[25, 5.0], [50, 4.6], [75, 4.4], [100, 4.2]]
    results = {"scratch": {3: {"points": curve}, 4: {"points": curve}},
               "grow": {3: {"points": [[100, 4.30]]}, 4: {"points": [[100, 4.32]]}},
               "scratch_matched": {3: {"points": [[75, 4.31]]}, 4: {"points": [[75, 4.35]]}}}
    timing = {"single": {"scratch": {"phases": [0.2], "delink_s": 0.0},
                         "grow": {"phases": [0.05, 0.2], "delink_s": 1.0}}}
    analysis = {"results": results, "time": [{"arm": "grow", "setting": "single", "time_ratio": 0.9}]}
    row, = confirmation_rows(analysis, timing, arms, 100)
    assert row["grow_seconds"] == pytest.approx(16.5) and row["scratch_step_at_that_time"] == pytest.approx(82.5)
    assert row["diff_at_equal_time"] == pytest.approx((4.30 + 4.32) / 2 - 4.34)
    assert row["diff_vs_matched"] == pytest.approx(-0.02) and row["time_ratio"] == 0.9
    assert confirmation_rows({"results": {"scratch": {}}, "time": []}, timing, arms, 100) == []
