"""Tensor and expert parallelism on 2 and 4 gloo processes against one process on the same global batch.

The shared worker launches (conftest.py) run one process for the references (and a checkpoint), two processes,
four processes (and a checkpoint saved at tensor_parallel=2 x expert_parallel=2), one process again to resume that
checkpoint. The model
is MoE in every layer, dropless and fp32, with a large balance-loss weight, and the gradients are clipped: the
losses and the gradient norms of every step must then equal one process's within a relative 1e-4. (Adam hides a
constant factor on a gradient, so the losses alone could not catch one: the norms and the clipping can, as the
negative control shows.) Each rank must hold only its share of every split parameter.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from equivalence import assert_trained_alike  # noqa: E402
from mesh_configs import FOUR_PROCESSES, REFERENCE_OF, TWO_PROCESSES  # noqa: E402

from lightning_p2r.measure.collectives import KINDS, predicted_bytes  # noqa: E402

GLOBAL_BATCH = 8  # the worker's
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def runs(mesh_runs: Path) -> Path:
    return mesh_runs


def _report(runs: Path, name: str) -> dict:
    return json.loads((runs / f"{name}.json").read_text())


def _relative_differences(values: list[float], reference: list[float]) -> list[float]:
    assert len(values) == len(reference), (values, reference)
    return [abs(v - r) / abs(r) for v, r in zip(values, reference)]


def _assert_matches(runs: Path, name: str, reference: str) -> None:
    run, ref = _report(runs, name), _report(runs, reference)
    for key in ("losses", "grad_norms"):
        worst = max(_relative_differences(run[key], ref[key]))
        assert worst < TOLERANCE, f"{name} {key}: {run[key]} vs {reference} {ref[key]}"


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [c["name"] for c in TWO_PROCESSES + FOUR_PROCESSES
                                  if "resume" not in c and "forget" not in c["name"]])
def test_every_layout_gives_the_one_process_losses_and_gradient_norms(runs: Path, name: str) -> None:
    reference = REFERENCE_OF.get(name, "reference")
    _assert_matches(runs, name, reference)
    assert _report(runs, name)["path"] == "model_parallel"
    initial = torch.load(runs / f"{reference}.pt", weights_only=True)  # only its keys and shapes matter here
    trained = torch.load(runs / f"{name}.pt", weights_only=True)
    assert trained.keys() == initial.keys()


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_zero1_partitions_the_optimizer_over_the_data_ranks_of_a_tensor_parallel_position(runs: Path) -> None:
    """tp2 x zero1 on 4 ranks (2 data ranks per tensor-parallel position), delinked mid-run: ZeRO-1's optimizer
    (over views of each rank's tensor-parallel parts) gives one process's losses and gradient norms (the layout
    test above) and is the one that stepped."""
    assert _report(runs, "tp2_zero1_on_4")["optimizer"] == "ReplicatedZeroOptimizer"


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_zero1_under_expert_parallelism_partitions_dense_weights_and_experts_apart(runs: Path) -> None:
    """ep2 x zero1 on 4 ranks: the dense weights' optimizer states partitioned over the 4 data ranks, the experts'
    over the 2 ranks holding the same experts (SplitZeroOptimizer), delinked mid-run, gives one process's losses and
    gradient norms (the layout test above); its checkpoint resumes on one process with the uninterrupted run's next
    step, and one process's checkpoint resumes at ep2 x zero1 with the reference's steps 3-4."""
    assert _report(runs, "ep2_zero1_on_4")["optimizer"] == "SplitZeroOptimizer"
    resumed, reference = _report(runs, "one_process_resumes_ep2_zero1"), _report(runs, "reference_delink_5_steps")
    assert len(resumed["losses"]) == 1
    assert _relative_differences(resumed["losses"], reference["losses"][4:])[0] < TOLERANCE
    resumed, reference = _report(runs, "ep2_zero1_resumes_one_process"), _report(runs, "reference_4_steps")
    assert _relative_differences(resumed["losses"], reference["losses"][3:])[0] < TOLERANCE
    assert resumed["optimizer"] == "SplitZeroOptimizer"


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_experts_sharing_one_ffn_are_split_once_upcycled(runs: Path) -> None:
    """ep2: the shallow model's experts share one FFN, kept whole on both ranks; growth upcycles them into 4 experts,
    re-placed 2 per rank (the run matches one process: the layout test above)."""
    report = _report(runs, "ep2_grown_upcycled")
    assert report["blocks"] == 4
    for rank in report["held"]:
        local, whole = rank["transformer.blocks.3.ffn.experts.w_in"]
        assert local * 2 == whole


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_delinking_under_tensor_parallel_re_splits_the_real_blocks(runs: Path) -> None:
    for name in ("tp2_delink", "tp2_ep2_delink_offload", "tp2_grown"):
        report = _report(runs, name)
        assert report["blocks"] == 4
        for rank in report["held"]:
            local, whole = rank["transformer.blocks.3.attn.qkv.weight"]
            assert local * 2 == whole  # the new block is split over the tensor-parallel ranks too


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_summed_expert_gradient_fails_the_comparison(runs: Path) -> None:
    """Negative control: without the experts' gradient scale the losses of an unclipped run would still match (Adam
    divides a constant factor out), but the gradient norms are off and the clipped steps differ."""
    run, ref = _report(runs, "ep2_forgets_gradient_scale"), _report(runs, "reference")
    assert max(_relative_differences(run["grad_norms"], ref["grad_norms"])) > 100 * TOLERANCE
    with pytest.raises(AssertionError):
        _assert_matches(runs, "ep2_forgets_gradient_scale", "reference")


# Elements of each parameter a rank holds, as a fraction of the whole: (tensor split) x (expert split) x (FSDP2).
SHARE = {
    "tp2": {"attn.qkv.weight": 2, "attn.out.weight": 2, "experts.w_in": 2, "experts.w_out": 2, "attn_norm.weight": 1,
            "router.weight": 1, "tok_embeddings.weight": 2},
    "ep2": {"attn.qkv.weight": 1, "experts.w_in": 2, "experts.w_out": 2, "router.weight": 1},
    "tp2_zero3": {"attn.qkv.weight": 2, "experts.w_in": 2, "attn_norm.weight": 1},
    "tp2_ep2_zero3": {"attn.qkv.weight": 4, "experts.w_in": 4, "experts.w_out": 4, "attn_norm.weight": 2,
                      "tok_embeddings.weight": 4},
    "ep2_zero2_on_4": {"attn.qkv.weight": 4, "experts.w_in": 4, "router.weight": 4},
}


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(SHARE))
def test_each_rank_holds_only_its_share(runs: Path, name: str) -> None:
    for rank, holdings in enumerate(_report(runs, name)["held"]):
        for suffix, split in SHARE[name].items():
            matches = [v for k, v in holdings.items() if k.endswith(suffix)]
            assert matches, suffix
            for local, whole in matches:
                assert local * split == whole, (name, rank, suffix, local, whole)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_checkpoints_reshard_between_one_process_and_a_tp2_ep2_mesh(runs: Path) -> None:
    """Saved at tp=2 x ep=2 (4 ranks, ZeRO-3), resumed on one process; saved on one process, resumed at tp=2 x
    ep=2: both continue with the loss the uninterrupted run has at step 4."""
    reference = _report(runs, "reference_4_steps")
    for name in ("one_process_resumes_tp2_ep2", "tp2_ep2_resumes_one_process"):
        resumed = _report(runs, name)
        assert len(resumed["losses"]) == 1
        assert _relative_differences(resumed["losses"], reference["losses"][3:])[0] < TOLERANCE, name
    initial = torch.load(runs / "reference.pt", weights_only=True)
    assert_trained_alike(torch.load(runs / "one_process_resumes_tp2_ep2.pt", weights_only=True),
                         torch.load(runs / "reference_4_steps.pt", weights_only=True), initial,
                         name="one_process_resumes_tp2_ep2")


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["tp2", "ep2", "tp2_zero3", "tp2_ep2_zero3", "ep2_zero2_on_4",
                                  "tp2_sequence_parallel"])
def test_counted_collective_bytes_equal_the_formulas(runs: Path, name: str) -> None:
    """Tensor parallel's all-reduces and gather, expert parallel's all-to-alls, the balance loss's all-reduces, the
    clipping norm's all-reduce and FSDP2's data-parallel traffic, counted in the last step and averaged over the
    ranks, equal ``lightning_p2r.planning.traffic`` (the parallel benchmark's comparison)."""
    report = _report(runs, name)
    config = next(c for c in TWO_PROCESSES + FOUR_PROCESSES if c["name"] == name)
    predicted = predicted_bytes(report["model"], config["strategy"], report["devices"], GLOBAL_BATCH, report,
                                clipping=True, gloo=True)
    ranks = report["counted_bytes"]
    for kind in KINDS:
        mean = sum(rank.get(kind, 0) for rank in ranks) / len(ranks)
        assert mean == predicted[kind], (name, kind, mean, predicted[kind])
    assert predicted["all_reduce"] > 0


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["tp2", "tp2_ep2_zero3", "tp2_sequence_parallel"])
def test_validation_gathers_the_logits_and_gives_the_one_process_loss(runs: Path, name: str) -> None:
    """In training each rank keeps its vocabulary shard of the logits (loss parallel: no all-gather is counted, see
    the byte test); in evaluation the head gathers them, so the validation loss and metrics read whole logits."""
    run, reference = _report(runs, name), _report(runs, "reference")
    assert abs(run["val_loss"] - reference["val_loss"]) / reference["val_loss"] < TOLERANCE


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_sequence_parallel_exchanges_positions_instead_of_all_reducing(runs: Path) -> None:
    """Sequence parallelism turns tensor parallelism's activation all-reduces into reduce-scatters and all-gathers
    of the same activations (one data rank here, so FSDP2 issues none of them), and the norms' weights, now seeing
    a rank's positions only, have their gradients all-reduced."""
    plain = _report(runs, "tp2")["counted_bytes"][0]
    sequence = _report(runs, "tp2_sequence_parallel")["counted_bytes"][0]
    assert plain.get("reduce_scatter", 0) == 0 and plain.get("all_gather", 0) == 0
    assert sequence["reduce_scatter"] > 0 and sequence["all_gather"] > 0
    # What stays an all-reduce: the MoE layers' (they gather the whole sequence), the loss's and the norms' gradients.
    assert sequence["all_reduce"] < plain["all_reduce"]
    for local, whole in (v for k, v in _report(runs, "tp2_sequence_parallel")["held"][0].items()
                         if k.endswith("attn.qkv.weight")):
        assert local * 2 == whole
