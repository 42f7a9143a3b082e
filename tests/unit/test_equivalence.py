"""The comparison helpers of tests/unit/equivalence.py: what they accept, what they reject, delinked blocks."""

import pytest
import torch
from equivalence import MOVEMENT_FRACTION, assert_bit_identical, assert_trained_alike, divergence, initial_value_of


def _runs() -> tuple[dict, dict]:
    initial = {"blocks.0.w": torch.zeros(4, 4), "head": torch.ones(3)}
    reference = {"blocks.0.w": torch.full((4, 4), 0.04), "head": torch.full((3,), 1.02)}
    return initial, reference


def test_noise_far_below_the_movement_passes_and_a_share_of_a_step_fails() -> None:
    initial, reference = _runs()
    noisy = {k: v + 1e-3 * (v - initial[k]) for k, v in reference.items()}
    assert_trained_alike(noisy, reference, initial)
    wrong = dict(reference, head=reference["head"] + 0.2 * 0.02)  # a fifth of a 0.02 movement
    with pytest.raises(AssertionError, match="head differs from the reference by 0.2"):
        assert_trained_alike(wrong, reference, initial)


def test_in_norm_one_unlucky_element_passes_and_a_shifted_tensor_fails() -> None:
    initial = {"w": torch.zeros(1000)}
    reference = {"w": torch.full((1000,), 0.02)}
    one_element = {"w": reference["w"].clone()}
    one_element["w"][7] += 0.02 * 0.05  # one element off by 5% of a step: Adam's sign flip where a gradient cancels
    with pytest.raises(AssertionError, match="by max"):
        assert_trained_alike(one_element, reference, initial)
    assert_trained_alike(one_element, reference, initial, measure="norm")
    assert divergence(one_element, reference, initial, "norm")["w"] == pytest.approx(0.05 / 1000 ** 0.5)
    shifted = {"w": reference["w"] + 0.02 * 0.05}  # every element off by 5%: a bug
    with pytest.raises(AssertionError, match="by norm"):
        assert_trained_alike(shifted, reference, initial, measure="norm")


def test_a_tensor_that_did_not_move_must_match_exactly() -> None:
    initial, reference = _runs()
    reference["head"] = initial["head"].clone()
    assert divergence(reference, reference, initial)["head"] == 0.0
    changed = dict(reference, head=reference["head"] + 1e-6 * torch.tensor([1.0, 0, 0]))
    assert divergence(changed, reference, initial)["head"] == float("inf")


def test_delinked_blocks_are_measured_from_the_block_they_were_copied_from() -> None:
    initial = {"m.blocks.0.w": torch.zeros(2), "m.blocks.1.w": torch.ones(2)}
    # Four blocks from two: blocks 0, 1 come from block 0 and blocks 2, 3 from block 1 (consecutive groups).
    assert initial_value_of("m.blocks.1.w", initial, final_blocks=4) is initial["m.blocks.0.w"]
    assert initial_value_of("m.blocks.2.w", initial, final_blocks=4) is initial["m.blocks.1.w"]
    assert initial_value_of("m.blocks.7.w", initial, final_blocks=16) is initial["m.blocks.0.w"]
    with pytest.raises(KeyError, match="not in the initial"):
        initial_value_of("m.head", initial, final_blocks=4)


def test_different_tensor_sets_are_reported() -> None:
    initial, reference = _runs()
    with pytest.raises(AssertionError, match="only the reference"):
        divergence({"head": reference["head"]}, reference, initial)


def test_bit_identical_rejects_one_ulp() -> None:
    a = {"w": torch.tensor([1.0, 2.0])}
    assert_bit_identical({"w": a["w"].clone()}, a)
    with pytest.raises(AssertionError, match="bit-identical"):
        assert_bit_identical({"w": torch.nextafter(a["w"], torch.tensor(3.0))}, a)


def test_the_bound_is_a_small_share_of_the_movement() -> None:
    assert 0 < MOVEMENT_FRACTION <= 0.01
