import io

import pytest
import torch

from lightning_p2r import M6Config, M6Transformer


def _config(**changes) -> M6Config:
    base = {"vocab_size": 64, "max_seq_len": 16, "num_layers": 4, "dim": 32, "num_heads": 4, "num_experts": 4}
    return M6Config(**(base | changes))


def _block_params(model: M6Transformer) -> int:
    return sum(p.numel() for p in model.blocks.parameters())


def test_logits_shape_and_losses() -> None:
    model = M6Transformer(_config())
    out = model(torch.randint(0, 64, (3, 10)))
    assert out.logits.shape == (3, 10, 64)
    assert out.aux_loss.shape == () and out.z_loss.shape == ()
    assert sorted(out.routing) == [0, 1, 2, 3]


def test_dense_model_has_no_router_losses() -> None:
    out = M6Transformer(_config(moe_layers=[]))(torch.randint(0, 64, (2, 8)))
    assert float(out.aux_loss) == 0.0 and out.routing == {}


def test_pseudo_model_holds_one_over_num_layers_of_the_block_parameters() -> None:
    real, pseudo = M6Transformer(_config()), M6Transformer(_config(num_unique_blocks=1))
    assert _block_params(real) == 4 * _block_params(pseudo)
    assert len(pseudo.blocks) == 1 and pseudo.layer_to_block == [0, 0, 0, 0]
    grouped = M6Transformer(_config(num_unique_blocks=2))
    assert _block_params(real) == 2 * _block_params(grouped)
    # shared tensors appear once in parameters() and in the state dict
    names = [n for n in pseudo.state_dict() if n.startswith("blocks.")]
    assert all(n.startswith("blocks.0.") for n in names)


def test_pseudo_model_runs_the_same_block_at_every_layer() -> None:
    model = M6Transformer(_config(num_unique_blocks=1))
    calls = []
    model.blocks[0].register_forward_hook(lambda *args: calls.append(1))
    model(torch.randint(0, 64, (1, 8)))
    assert len(calls) == 4


def test_state_dict_round_trips() -> None:
    model = M6Transformer(_config(num_unique_blocks=2))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    clone = M6Transformer(_config(num_unique_blocks=2))
    clone.load_state_dict(torch.load(buffer, weights_only=True))
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(tokens).logits, clone(tokens).logits)


def test_tied_embeddings_are_one_tensor() -> None:
    model = M6Transformer(_config(tie_embeddings=True))
    assert model.lm_head.weight is model.tok_embeddings.weight
    untied = M6Transformer(_config(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_embeddings.weight


def test_too_long_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        M6Transformer(_config())(torch.randint(0, 64, (1, 17)))


@pytest.mark.parametrize("changes", [{}, {"num_prototypes": 2}, {"moe_top_k": 2, "capacity_factor": None},
                                     {"num_unique_blocks": 1, "attention": "alternating", "sparse_window": 4},
                                     {"position_embedding": "learned", "moe_layers": [1, 3]}])
@pytest.mark.slow
def test_tiny_model_overfits_one_batch(changes: dict) -> None:
    torch.manual_seed(0)
    model = M6Transformer(_config(**changes))
    batch = torch.randint(0, 64, (4, 17))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        out = model(inputs)
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
        (loss + 0.01 * out.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        first = first if first is not None else float(loss)
    assert float(loss) < 0.1 * first, (first, float(loss))


def test_router_losses_are_summed_over_moe_layers_as_in_switch() -> None:
    """Switch and ST-MoE weigh each MoE layer's loss by the coefficient: the model's aux and z losses are the sums
    of the layers' (issue 13 item 4b), so router_aux_loss_coef=0.01 means what it means in the papers."""
    from lightning_p2r.models import M6Transformer

    model = M6Transformer(M6Config(vocab_size=64, max_seq_len=8, num_layers=3, dim=16, num_heads=2, num_experts=4,
                                   moe_layers=[0, 2], init_seed=0))
    per_layer = []
    for block in model.blocks:
        if block.is_moe:
            block.ffn.register_forward_hook(lambda module, args, out: per_layer.append(out))
    out = model(torch.randint(0, 64, (2, 8)))
    assert len(per_layer) == 2
    torch.testing.assert_close(out.aux_loss, per_layer[0].aux_loss + per_layer[1].aux_loss, rtol=0, atol=0)
    torch.testing.assert_close(out.z_loss, per_layer[0].z_loss + per_layer[1].z_loss, rtol=0, atol=0)
