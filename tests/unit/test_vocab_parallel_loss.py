"""The vocabulary-parallel loss reads logits of the whole vocabulary as the ordinary cross-entropy, and refuses
logits of any other width than one rank's share (a model whose forward reshaped them after its head) in one line
instead of summing the wrong shards."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lightning_p2r.strategy.parallel.loss import VocabParallelCrossEntropy


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_whole_logits_take_the_ordinary_loss_and_other_widths_are_refused(mesh) -> None:
    loss = VocabParallelCrossEntropy(mesh, vocab_size=8)
    logits, targets = torch.randn(2, 3, 8), torch.randint(0, 8, (2, 3))
    assert torch.equal(loss(logits, targets), F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    with pytest.raises(ValueError, match="logits 6 wide: neither the vocabulary \\(8\\)"):
        loss(torch.randn(2, 3, 6), targets)
