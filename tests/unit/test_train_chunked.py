"""The chunked TTT loss (train.chunked) against the plain one: the same loss, metrics and gradients."""

import pytest
import torch

from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.train.chunked import ChunkedTTTLoss, chunked_target_view
from eagle3.train.loss import target_view, ttt_loss
from eagle3.train.target import TargetHead

V, D, H, K = 60, 24, 32, 4


def drafter(seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    c = DrafterConfig(
        arch="llama",
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        vocab_size=V,
        draft_vocab_size=D,
        target_hidden_size=H,
        aux_layer_ids=[1, 2, 3],
    )
    return Eagle3Drafter(c)


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 17
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * H, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 11:] = False  # padded rows
    mask = (torch.rand(B, T, generator=g) > 0.3).long() * valid
    head = TargetHead(
        torch.randn(V, H, generator=g), torch.rand(H, generator=g) + 0.5, torch.randn(V, H, generator=g), 1e-6, {}
    )
    last = torch.randn(B, T, H, generator=g)
    draft_ids = torch.sort(torch.randperm(V, generator=g)[:D]).values
    d2t = draft_ids - torch.arange(D)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    return ids, aux, valid, mask, head, last, d2t, t2d


def counts(mask):
    return [int(mask[:, 2 + k :].sum()) for k in range(K)]


def plain(model, ids, aux, valid, mask, head, last, d2t, t2d):
    view = target_view(head.logits(last), d2t, t2d)
    return ttt_loss(model(ids, aux, valid, K), view, mask, d2t, 0.8, counts(mask))


def chunked(model, ids, aux, valid, mask, head, last, d2t, t2d, chunk):
    view = chunked_target_view(head, last, d2t, t2d, chunk)
    loss_head = ChunkedTTTLoss(view, mask, d2t, 0.8, counts(mask), K, chunk)
    return loss_head.finish(model(ids, aux, valid, K, head=loss_head))


def test_the_chunked_target_view_equals_the_plain_one():
    _, _, _, _, head, last, d2t, t2d = batch()
    a, b = target_view(head.logits(last), d2t, t2d), chunked_target_view(head, last, d2t, t2d, 5)
    torch.testing.assert_close(b.draft_logits, a.draft_logits)
    assert torch.equal(a.top1, b.top1) and torch.equal(a.top1_in_draft, b.top1_in_draft)
    assert not a.top1_in_draft.all() and a.top1_in_draft.any()  # both kinds of position are exercised


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_the_chunked_loss_equals_the_plain_one_with_its_gradients(chunk):
    data = batch()
    reference, mine = drafter(), drafter()
    mine.load_state_dict(reference.state_dict())
    ref_loss, ref_stats = plain(reference, *data)
    ref_loss.backward()
    loss, stats = chunked(mine, *data, chunk)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert stats["counted"] == ref_stats["counted"] and stats["positions"] == ref_stats["positions"]
    assert stats["correct"] == ref_stats["correct"] and stats["chain"] == ref_stats["chain"]
    torch.testing.assert_close(torch.tensor(stats["ce_sum"]), torch.tensor(ref_stats["ce_sum"]), rtol=1e-5, atol=1e-5)
    grads = 0
    for (name, p), q in zip(reference.named_parameters(), mine.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        grads += 1
        assert p.grad.abs().sum() > 0, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert grads >= 10  # fc, every layer weight and the lm_head


def test_a_scaled_backward_scales_the_chunked_gradients():
    """The trainer backpropagates loss x processes x weight: the kept gradients follow the scale."""
    data = batch()
    one, three = drafter(), drafter()
    three.load_state_dict(one.state_dict())
    chunked(one, *data, 8)[0].backward()
    (chunked(three, *data, 8)[0] * 3.0).backward()
    torch.testing.assert_close(three.lm_head.weight.grad, 3.0 * one.lm_head.weight.grad)
    torch.testing.assert_close(three.fc.weight.grad, 3.0 * one.fc.weight.grad)


def test_without_gradients_the_chunked_loss_gives_the_same_metrics():
    data = batch()
    model = drafter()
    with torch.no_grad():
        ref_loss, ref_stats = plain(model, *data)
        loss, stats = chunked(model, *data, 6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert {k: v for k, v in stats.items() if k != "ce_sum"} == {k: v for k, v in ref_stats.items() if k != "ce_sum"}
