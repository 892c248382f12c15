"""The draft vocabulary: d2t/t2d consistency, top-k choice, kept tokens, identity, coverage."""

import numpy as np
import pytest

from eagle3.vocab.mapping import build, load, save, sum_counts


def counts_of(size, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.zipf(1.3, size) % 10_000).astype(np.int64)


@pytest.mark.parametrize("draft, target", [(32, 500), (100, 4096), (4095, 4096)])
def test_d2t_and_t2d_agree(draft, target):
    counts = counts_of(target)
    vocab = build(counts, draft, keep=[target - 1])
    assert vocab.d2t.dtype == np.int64 and vocab.t2d.dtype == np.bool_
    assert len(vocab.d2t) == draft and len(vocab.t2d) == target
    targets = np.arange(draft) + vocab.d2t
    assert vocab.t2d[targets].all() and vocab.t2d.sum() == draft
    assert (np.diff(targets) > 0).all(), "draft ids follow target order"
    assert (np.diff(vocab.d2t) >= 0).all()


def test_top_k_with_kept_tokens():
    counts = np.array([50, 0, 40, 30, 1, 20, 10, 0], dtype=np.int64)
    vocab = build(counts, 4, keep=[7])  # 7 never occurs but must be proposable (end-of-turn)
    chosen = np.arange(4) + vocab.d2t
    assert chosen.tolist() == [0, 2, 3, 7]
    assert vocab.coverage == pytest.approx(120 / 151)
    assert not vocab.identity


def test_every_unchosen_token_is_at_most_as_frequent_as_every_freely_chosen_one():
    counts = counts_of(2000, seed=3)
    keep = [5, 6]
    vocab = build(counts, 300, keep)
    chosen = set((np.arange(300) + vocab.d2t).tolist())
    free = [counts[i] for i in chosen - set(keep)]
    unchosen = [counts[i] for i in set(range(2000)) - chosen]
    assert min(free) >= max(unchosen)
    assert set(keep) <= chosen


def test_identity_when_draft_covers_target():
    vocab = build(counts_of(64), 64, keep=[1])
    assert vocab.identity and (vocab.d2t == 0).all() and vocab.t2d.all() and vocab.coverage == 1.0
    assert build(counts_of(64), 1000, keep=[]).identity


def test_too_many_kept_tokens_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot hold the 3 tokens that must be kept"):
        build(counts_of(100), 2, keep=[1, 2, 3])


def test_save_load_round_trip_and_count_size_mismatch(tmp_path):
    from safetensors.numpy import save_file

    vocab = build(counts_of(300), 50, keep=[0])
    save(vocab, tmp_path / "v.safetensors")
    d2t, t2d = load(tmp_path / "v.safetensors")
    assert (d2t == vocab.d2t).all() and (t2d == vocab.t2d).all()
    save_file({"counts": np.ones(10, dtype=np.int64)}, str(tmp_path / "a.safetensors"))
    save_file({"counts": np.ones(12, dtype=np.int64)}, str(tmp_path / "b.safetensors"))
    assert sum_counts([tmp_path / "a.safetensors"], 10).tolist() == [1] * 10
    with pytest.raises(ValueError, match="another tokenizer"):
        sum_counts([tmp_path / "a.safetensors", tmp_path / "b.safetensors"], 10)
