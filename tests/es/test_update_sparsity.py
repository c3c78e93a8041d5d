"""keep_update_fraction / update_fraction_curve (arXiv 2608.27351, functional sparsity): exact masks and endpoints."""

import pytest
import torch
from torch import nn

from trl_es.analysis import KEEP_MODES, keep_update_fraction, update_fraction_curve
from trl_es.analysis.fingerprint import weights_fingerprint
from tiny import build_llama, build_tokenizer


class Pair(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))
        self.b = nn.Parameter(torch.tensor(b))


def hand_pair():
    base = Pair([0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # |delta| (exact in float32): a = [0.5, 3, 0.125, 2]  b = [0.25, 0.25, 4, 0, 1, 0.375]; the tie 0.25 / 0.25 is
    # broken by position
    cur = Pair([0.5, -3.0, 0.125, 2.0], [1.25, 0.75, 5.0, 1.0, 0.0, 1.375])
    return cur, base


def kept_mask(copy, cur, base):
    """Per tensor: True where the copy holds the model's value and it differs from the base."""
    return {n: (p.detach() == getattr(cur, n).detach()) & (getattr(cur, n).detach() != getattr(base, n).detach())
            for n, p in copy.named_parameters()}


def test_global_keeps_the_k_largest_entries_over_all_tensors():
    cur, base = hand_pair()
    copy, kept = keep_update_fraction(cur, base, 0.3, "global")  # round(0.3 * 10) = 3: |delta| 4, 3, 2
    assert kept == 3
    assert copy.a.tolist() == [0.0, -3.0, 0.0, 2.0] and copy.b.tolist() == [1.0, 1.0, 5.0, 1.0, 1.0, 1.0]
    copy, kept = keep_update_fraction(cur, base, 0.65, "global")  # round(6.5) = 7: + 1, 0.5, 0.375, the first 0.25
    assert kept == 7
    assert copy.a.tolist() == [0.5, -3.0, 0.0, 2.0] and copy.b.tolist() == [1.25, 1.0, 5.0, 1.0, 0.0, 1.375]
    assert cur.a.tolist() == [0.5, -3.0, 0.125, 2.0]  # the input is untouched


def test_per_tensor_keeps_the_largest_of_every_tensor():
    cur, base = hand_pair()
    copy, kept = keep_update_fraction(cur, base, 0.5, "per_tensor")  # a: 2 of 4 (3, 2); b: 3 of 6 (4, 1, 0.375)
    assert kept == 5
    assert copy.a.tolist() == [0.0, -3.0, 0.0, 2.0] and copy.b.tolist() == [1.0, 1.0, 5.0, 1.0, 0.0, 1.375]


def test_random_keeps_exactly_k_entries_from_its_seed():
    cur, base = hand_pair()
    a, kept_a = keep_update_fraction(cur, base, 0.4, "random", seed=3)
    b, kept_b = keep_update_fraction(cur, base, 0.4, "random", seed=3)
    c, _ = keep_update_fraction(cur, base, 0.4, "random", seed=4)
    assert kept_a == kept_b == 4
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    expected = torch.zeros(10, dtype=torch.bool)
    expected[perm[:4]] = True
    changed = torch.ones(10, dtype=torch.bool)
    changed[7] = False  # b[3]: delta 0, the model's value whether kept or not
    model_values = torch.cat([cur.a.detach(), cur.b.detach()])
    base_values = torch.cat([base.a.detach(), base.b.detach()])
    values = torch.cat([a.a.detach(), a.b.detach()])
    assert torch.equal(values, torch.where(expected, model_values, base_values))
    assert int((expected & changed).sum()) >= 3
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


@pytest.mark.parametrize("mode", KEEP_MODES)
def test_endpoints_are_the_base_and_the_model_bitwise(mode):
    tokenizer = build_tokenizer()
    base, model = build_llama(tokenizer, seed=0), build_llama(tokenizer, seed=1)
    copy, kept = keep_update_fraction(model, base, 1.0, mode)
    assert weights_fingerprint(copy) == weights_fingerprint(model)
    assert kept == sum(p.numel() for p in model.parameters())
    copy, kept = keep_update_fraction(model, base, 0.0, mode)
    assert weights_fingerprint(copy) == weights_fingerprint(base) and kept == 0


def test_curve_counts_and_rewards_on_a_tiny_model():
    tokenizer = build_tokenizer()
    base, model = build_llama(tokenizer, seed=0), build_llama(tokenizer, seed=1)
    total = sum(p.numel() for p in model.parameters())
    scored = []

    def distance_to_model(m):  # 0 for the model itself, grows with what was reset
        value = sum(float((p.detach() - q.detach()).pow(2).sum()) for p, q in zip(m.parameters(), model.parameters()))
        scored.append(value)
        return -value

    out = update_fraction_curve(model, base, [0.0, 0.001, 0.1, 1.0], distance_to_model, modes=["global", "random"])
    assert out["num_coordinates"] == total
    assert out["kept"]["global"] == [0, round(0.001 * total), round(0.1 * total), total]
    assert out["kept"]["random"] == out["kept"]["global"]
    assert out["reward"]["global"][-1] == 0.0 == out["reward"]["random"][-1]
    # keeping the largest entries removes more of the distance than keeping as many random ones
    assert out["reward"]["global"][2] > out["reward"]["random"][2]
    assert len(scored) == 8


def test_bad_fraction_or_mode_names_the_field():
    cur, base = hand_pair()
    with pytest.raises(ValueError, match="fractions"):
        keep_update_fraction(cur, base, 1.5)
    with pytest.raises(ValueError, match="mode must be one of"):
        keep_update_fraction(cur, base, 0.5, "largest")
    with pytest.raises(TypeError, match="reward_fn"):
        update_fraction_curve(cur, base, [0.5], reward_fn=3)
