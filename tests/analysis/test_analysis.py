"""Tests of trl_es.analysis: every value checked against a hand computation."""

import copy
import json
import math
import os

import pytest
import torch
from torch import nn

from trl_es.analysis import (
    analyze,
    barrier,
    estimate_pass_at_k,
    functional_sparsity,
    interpolate_models,
    lm_loss_fn,
    load_pass_at_k_metric,
    mean_pass_at_k,
    mode_connectivity,
    off_task_kl,
    parameter_drift,
    pass_at_k,
    plot_pass_at_k_curves,
    reset_small_updates,
    success_diversity,
    success_diversity_from_matrix,
    tensor_drift,
    update_cosine,
    weights_fingerprint,
)
from trl_es.analysis.drift import group_name
from trl_es.analysis.kl import _completion_mask

LN2 = math.log(2.0)


def _h(p):
    """Binary entropy in nats, written out by hand."""
    return 0.0 if p in (0.0, 1.0) else -p * math.log(p) - (1 - p) * math.log(1 - p)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, snapshot):
    now = model.state_dict()
    assert now.keys() == snapshot.keys()
    for k, v in snapshot.items():
        assert torch.equal(now[k], v), k


def _perturbed(model, scale=0.02, seed=1):
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return out


# ---------------------------------------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
        (5, 0, 1, 0.0),  # c = 0
        (5, 0, 5, 0.0),  # c = 0, n = k
        (5, 5, 1, 1.0),  # c = n
        (5, 5, 5, 1.0),  # c = n = k
        (3, 1, 3, 1.0),  # n = k: any correct sample -> certain
        (10, 1, 3, 1 - 84 / 120),  # 1 - C(9,3)/C(10,3)
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("n, c", [(10, 3), (7, 0), (7, 7), (1, 1), (13, 5)])
def test_pass_at_1_is_fraction_correct(n, c):
    assert pass_at_k(n, c, 1) == pytest.approx(c / n, rel=1e-12, abs=1e-15)


def test_pass_at_k_per_problem_and_mean():
    per = estimate_pass_at_k([10, 4], [3, 2], 2)
    assert per.tolist() == pytest.approx([1 - 21 / 45, 1 - 1 / 6])  # 1 - C(7,2)/C(10,2), 1 - C(2,2)/C(4,2)
    assert mean_pass_at_k(10, [3, 0], 5) == pytest.approx((1 - 21 / 252) / 2)
    assert mean_pass_at_k([10, 10], [3, 0], 1) == pytest.approx(0.15)


@pytest.mark.parametrize(
    "n, c, k, err, match",
    [
        (5, 2, 6, ValueError, "`k`"),
        (5, 6, 1, ValueError, "`num_correct`"),
        (5, -1, 1, ValueError, "`num_correct`"),
        (-5, 0, 1, ValueError, "`num_samples`"),
        (5, 2, 0, ValueError, "`k`"),
        (5, 2, -1, ValueError, "`k`"),
        (5, 2.5, 1, TypeError, "`num_correct`"),
    ],
)
def test_pass_at_k_errors(n, c, k, err, match):
    with pytest.raises(err, match=match):
        pass_at_k(n, c, k)


def test_pass_at_k_length_mismatch():
    with pytest.raises(ValueError, match="num_samples"):
        estimate_pass_at_k([10, 10, 10], [1, 2], 1)


def test_pass_at_k_evaluate_metric_offline(monkeypatch, tmp_path):
    evaluate = pytest.importorskip("evaluate")
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)
    monkeypatch.setattr(evaluate.config, "HF_UPDATE_DOWNLOAD_COUNTS", False)
    metric = load_pass_at_k_metric(cache_dir=str(tmp_path))
    out = metric.compute(predictions=[3, 0, 2], references=[10, 10, 4], k=[1, 2])
    assert set(out) == {"pass@1", "pass@2"}
    assert out["pass@1"] == pytest.approx((0.3 + 0.0 + 0.5) / 3)
    assert out["pass@2"] == pytest.approx(((1 - 21 / 45) + 0.0 + (1 - 1 / 6)) / 3)
    assert out["pass@2"] == pytest.approx(mean_pass_at_k([10, 10, 4], [3, 0, 2], 2), rel=1e-15)
    assert metric.compute(predictions=[1], references=[4]) == {"pass@1": pytest.approx(0.25)}
    with pytest.raises(ValueError, match="`k`"):
        metric.compute(predictions=[1], references=[4], k=[5])


def test_pass_at_k_has_one_implementation_and_the_metric_no_cycle():
    """The metric module and trl_es.analysis share one estimator, which imports nothing of trl_es; the metric imports
    it relatively (evaluate.load copies it along), not trl_es.analysis (which loads the metric by path)."""
    import ast

    from trl_es.analysis import PASS_AT_K_METRIC_PATH
    from trl_es.metrics.pass_at_k import estimator

    assert pass_at_k is estimator.pass_at_k and mean_pass_at_k is estimator.mean_pass_at_k
    assert estimate_pass_at_k is estimator.estimate_pass_at_k

    def imports(path):
        tree = ast.parse(open(path, encoding="utf-8").read())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        return names + ["." * n.level + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]

    assert not [m for m in imports(PASS_AT_K_METRIC_PATH) if m.startswith("trl_es")]
    assert set(imports(estimator.__file__)) <= {"__future__", "numbers", "collections.abc", "numpy"}


# ----------------------------------------------------------------------------------------------------------- drift


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(2, 1, bias=False)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(2, 2)
        self.layers = nn.ModuleList([_Block(), _Block()])


def _toy(q_w, q_b, up0, up1):
    m = _Toy()
    with torch.no_grad():
        m.q_proj.weight.copy_(torch.tensor(q_w))
        m.q_proj.bias.copy_(torch.tensor(q_b))
        m.layers[0].up_proj.weight.copy_(torch.tensor(up0))
        m.layers[1].up_proj.weight.copy_(torch.tensor(up1))
    return m


def _toy_pair():
    base = _toy([[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0], [[0.0, 2.0]], [[1.0, 0.0]])
    cur = _toy([[4.0, 0.0], [0.0, 1.0]], [0.0, 4.0], [[0.0, 2.0]], [[1.0, 12.0]])
    return cur, base


def test_plot_pass_at_k_curves_writes_png(tmp_path):
    path = tmp_path / "pass.png"
    plot_pass_at_k_curves({"a": [0.1, 0.2, 0.4], "b": [0.3, None, 0.5]}, [1, 2, 4], path, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="curve 'a' has 2 values for 3"):
        plot_pass_at_k_curves({"a": [0.1, 0.2]}, [1, 2, 4], tmp_path / "x.png")
    with pytest.raises(ValueError, match="increasing positive"):
        plot_pass_at_k_curves({"a": [0.1, 0.2]}, [2, 1], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_weights_fingerprint_is_bitwise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    twin = copy.deepcopy(model)
    assert weights_fingerprint(model) == weights_fingerprint(twin)
    assert len(weights_fingerprint(model)) == 64
    with torch.no_grad():  # one ulp in one weight
        twin[0].weight[1, 2] = torch.nextafter(twin[0].weight[1, 2], torch.tensor(math.inf))
    assert weights_fingerprint(model) != weights_fingerprint(twin)
    twin = copy.deepcopy(model)
    twin[1].num_batches_tracked += 1  # buffers count
    assert weights_fingerprint(model) != weights_fingerprint(twin)
    assert weights_fingerprint(copy.deepcopy(model).double()) != weights_fingerprint(model)  # dtypes count
    with pytest.raises(TypeError, match="nn.Module"):
        weights_fingerprint({"w": torch.zeros(1)})


def test_weights_fingerprint_value_is_stable():
    """Recipes write the fingerprint into result files: its definition (SHA-256 of name|dtype|shape and raw bytes of
    the sorted state dict) must not change. The values were computed by the original implementation."""
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7)
        model.bias.copy_(torch.tensor([-1.5, 2.25]))
    model.register_buffer("steps", torch.arange(4))
    assert weights_fingerprint(model) == "70af1b28c00851458ed51f17a0ad90ccd7ed30691640070c5587722d88a75737"
    assert weights_fingerprint(model.to(torch.bfloat16)) == (
        "4a2e4db418ba033b17bec8663091bbd7d8eb391a5a12987cd26d4a6004b2e5f1"
    )


def test_tensors_fingerprint_names_shapes_and_size():
    from trl_es.fingerprint import tensors_fingerprint

    model = nn.Linear(3, 2)
    state = dict(sorted(model.state_dict().items()))
    assert tensors_fingerprint(state).hex() == weights_fingerprint(model)
    assert tensors_fingerprint(state, digest_size=16) == tensors_fingerprint(state)[:16]
    assert tensors_fingerprint(list(state.values())) != tensors_fingerprint(state)  # unnamed: named by position
    assert tensors_fingerprint([torch.zeros(2, 3)]) != tensors_fingerprint([torch.zeros(3, 2)])  # shapes count
    transposed = torch.arange(6.0).reshape(2, 3).T
    assert tensors_fingerprint([transposed]) == tensors_fingerprint([transposed.contiguous()])
    with pytest.raises(ValueError, match="digest_size"):
        tensors_fingerprint(state, digest_size=33)


def test_group_name():
    assert group_name("model.layers.3.self_attn.q_proj.weight") == "q_proj"
    assert group_name("model.layers.11.mlp.down_proj.bias") == "down_proj"
    assert group_name("model.embed_tokens.weight") == "embed_tokens"
    assert group_name("model.norm.weight") == "norm"
    assert group_name("lm_head.weight") == "lm_head"
    assert group_name("weight") == "weight"


def test_parameter_drift_hand_computed():
    cur, base = _toy_pair()
    # q_proj: diffs 3 (weight) and 4 (bias) -> 5; base norm^2 = 2.  up_proj: diff 12; base norm^2 = 4 + 1 = 5.
    out = parameter_drift(cur, base)
    assert out["l2"] == pytest.approx(13.0)
    assert out["base_l2"] == pytest.approx(math.sqrt(7.0))
    assert out["relative"] == pytest.approx(13.0 / math.sqrt(7.0))
    assert out["numel"] == 10
    assert set(out["per_group"]) == {"q_proj", "up_proj"}
    assert out["per_group"]["q_proj"] == pytest.approx(
        {"l2": 5.0, "relative": 5.0 / math.sqrt(2.0), "base_l2": math.sqrt(2.0), "numel": 6}
    )
    assert out["per_group"]["up_proj"] == pytest.approx(
        {"l2": 12.0, "relative": 12.0 / math.sqrt(5.0), "base_l2": math.sqrt(5.0), "numel": 4}
    )
    # state dicts and the name->tensor variant give the same numbers; bf16 weights are upcast
    assert parameter_drift(cur.state_dict(), base.state_dict()) == out
    assert tensor_drift(dict(cur.named_parameters()), _snapshot(base), per_group=False) == pytest.approx(
        {k: v for k, v in out.items() if k != "per_group"}
    )
    assert parameter_drift(cur.to(torch.bfloat16), base)["l2"] == pytest.approx(13.0)
    assert parameter_drift(base, base)["l2"] == 0.0


def test_parameter_drift_errors():
    cur, _ = _toy_pair()
    with pytest.raises(ValueError, match="share no"):
        tensor_drift({"a": torch.zeros(2)}, {"b": torch.zeros(2)})
    with pytest.raises(ValueError, match="different shapes"):
        tensor_drift({"a": torch.zeros(2)}, {"a": torch.zeros(3)})
    with pytest.raises(TypeError, match="checkpoint path"):
        parameter_drift(cur, 3)


def test_parameter_drift_peft_lora(tiny_llama):
    peft = pytest.importorskip("peft")
    base = copy.deepcopy(tiny_llama)
    # default LoRA init has B = 0: the merged model equals the base
    zero = peft.get_peft_model(copy.deepcopy(tiny_llama), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert parameter_drift(zero, base)["l2"] == 0.0

    lora = peft.get_peft_model(
        copy.deepcopy(tiny_llama),
        peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False),
    )
    before = _snapshot(lora)
    out = parameter_drift(lora, base)
    _assert_unchanged(lora, before)  # merged in a copy
    assert isinstance(lora, peft.PeftModel)
    # by hand: delta W = (alpha / r) * B @ A in each layer's q_proj, nothing else moves
    expected_sq = 0.0
    for layer in lora.base_model.model.model.layers:
        q = layer.self_attn.q_proj
        delta = 2.0 * q.lora_B["default"].weight.detach().double() @ q.lora_A["default"].weight.detach().double()
        expected_sq += float((delta**2).sum())
    assert out["per_group"]["q_proj"]["l2"] == pytest.approx(math.sqrt(expected_sq), rel=1e-5)
    assert out["l2"] == pytest.approx(math.sqrt(expected_sq), rel=1e-5)
    assert all(v["l2"] == 0.0 for g, v in out["per_group"].items() if g != "q_proj")


# -------------------------------------------------------------------------------------------------------------- KL


def test_completion_mask():
    completion = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert _completion_mask(completion, [2]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_off_task_kl_self_is_zero(tiny_llama, tokenizer):
    prompts = ["hello", [{"role": "user", "content": "hi"}]]
    out = off_task_kl(tiny_llama, tiny_llama, tokenizer, prompts, max_new_tokens=4, num_samples=2, seed=3)
    assert out["kl"] == 0.0
    assert out["per_prompt"] == [0.0, 0.0]
    assert 2 <= out["num_tokens"] <= 2 * 2 * 4  # at most prompts x samples x max_new_tokens, at least one each
    # a separate but identical copy too
    assert off_task_kl(tiny_llama, copy.deepcopy(tiny_llama), tokenizer, prompts, max_new_tokens=4)["kl"] == 0.0


def test_off_task_kl_positive_against_perturbed(tiny_llama, tokenizer):
    sharp = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(300.0)  # a peaked p_current: its samples are far likelier under it than the base
    rng = torch.get_rng_state()
    side = tokenizer.padding_side
    out = off_task_kl(sharp, tiny_llama, tokenizer, ["abc", "xyz"], max_new_tokens=4, num_samples=2, seed=0)
    assert out["kl"] > 0.5
    assert all(v > 0 for v in out["per_prompt"])
    assert torch.equal(torch.get_rng_state(), rng)  # sampling is seeded in a forked RNG
    assert tokenizer.padding_side == side
    assert off_task_kl(sharp, tiny_llama, tokenizer, ["abc", "xyz"], max_new_tokens=4, num_samples=2, seed=0) == out


def test_off_task_kl_errors(tiny_llama, tokenizer):
    with pytest.raises(ValueError, match="max_new_tokens"):
        off_task_kl(tiny_llama, tiny_llama, tokenizer, ["a"], max_new_tokens=0)
    with pytest.raises(ValueError, match="prompts"):
        off_task_kl(tiny_llama, tiny_llama, tokenizer, [])
    with pytest.raises(TypeError, match="state dict"):
        off_task_kl(tiny_llama.state_dict(), tiny_llama, tokenizer, ["a"])


# ------------------------------------------------------------------------------------------------------- sparsity


def _flat_pair():
    """base: all ones; current = base + deltas (0.125, -0.5, 0, 2 | 0.25, -0.0625), all exact in float32."""
    base = nn.Linear(2, 2)
    cur = nn.Linear(2, 2)
    with torch.no_grad():
        base.weight.fill_(1.0)
        base.bias.fill_(1.0)
        cur.weight.copy_(torch.tensor([[1.125, 0.5], [1.0, 3.0]]))
        cur.bias.copy_(torch.tensor([1.25, 0.9375]))
    return cur, base


def test_functional_sparsity_hand_computed():
    cur, base = _flat_pair()
    snap_cur, snap_base = _snapshot(cur), _snapshot(base)
    seen = []

    def reward_fn(m):
        seen.append(m)
        return float(sum(p.detach().sum() for p in m.parameters()))

    out = functional_sparsity(cur, base, [0.0, 0.125, 0.3, 1.0, 3.0], reward_fn)
    # |delta| = 0.125, 0.5, 0, 2, 0.25, 0.0625
    assert out["fraction_reset"] == pytest.approx([1 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0])
    # reward = 6 (base) + the deltas that are kept
    assert out["reward"] == pytest.approx([7.8125, 7.75, 7.5, 8.0, 6.0])
    assert out["num_coordinates"] == 6
    assert out["taus"] == [0.0, 0.125, 0.3, 1.0, 3.0]
    _assert_unchanged(cur, snap_cur)
    _assert_unchanged(base, snap_base)
    assert all(m is not cur and m is not base for m in seen)

    pruned, frac = reset_small_updates(cur, base, 0.3)
    assert frac == pytest.approx(4 / 6)
    assert pruned.weight.tolist() == [[1.0, 0.5], [1.0, 3.0]]
    assert pruned.bias.tolist() == [1.0, 1.0]
    _assert_unchanged(cur, snap_cur)

    assert functional_sparsity(cur, base, [0.3], None)["reward"] is None
    with pytest.raises(ValueError, match="taus"):
        functional_sparsity(cur, base, [-0.1], reward_fn)
    with pytest.raises(TypeError, match="reward_fn"):
        functional_sparsity(cur, base, [0.1], 3)


# ------------------------------------------------------------------------------------------- mode connectivity


def _scalar(w):
    m = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(w)
    return m


def test_interpolate_models():
    a = {"w": torch.tensor([0.0, 2.0]), "step": torch.tensor(7)}
    b = {"w": torch.tensor([2.0, 4.0]), "step": torch.tensor(9)}
    mid = interpolate_models(a, b, 0.25)
    assert mid["w"].tolist() == [0.5, 2.5]
    assert mid["step"].item() == 7  # non-float entries come from theta_a
    assert a["w"].tolist() == [0.0, 2.0]
    # tied (aliased) entries stay tied
    shared = torch.tensor([0.0, 4.0])
    tied = interpolate_models({"e": shared, "h": shared}, {"e": torch.tensor([4.0, 0.0])}, 0.5)
    assert tied["e"].tolist() == tied["h"].tolist() == [2.0, 2.0]
    ma, mb = _scalar(0.0), _scalar(2.0)
    m = interpolate_models(ma, mb, 0.75)
    assert m.weight.item() == 1.5 and ma.weight.item() == 0.0 and mb.weight.item() == 2.0


def test_barrier_function():
    assert barrier([1.0, 0.0, 1.0], [0.0, 0.5, 1.0], higher_is_better=True) == 1.0
    assert barrier([1.0, 3.0, 2.0], [0.0, 0.5, 1.0], higher_is_better=False) == 1.5  # line at 0.5 is 1.5
    assert barrier([1.0, 3.0, 2.0], [0.0, 0.5, 1.0], higher_is_better=True) == 0.0  # above the line: clipped
    with pytest.raises(ValueError, match="end points"):
        barrier([1.0, 2.0], [0.0, 0.5], higher_is_better=True)


def test_mode_connectivity_toy():
    a, b = _scalar(0.0), _scalar(2.0)
    # along w(t) = 2t: r = (w - 1)^2 dips to 0 at t = 0.5 under the chord r = 1 -> barrier 1
    reward = lambda m: (m.weight.item() - 1.0) ** 2
    loss = lambda m: -((m.weight.item() - 1.0) ** 2)
    out = mode_connectivity(a, b, [0.25, 0.5, 0.75], reward_fn=reward, loss_fn=loss)
    assert out["ts"] == [0.0, 0.25, 0.5, 0.75, 1.0]  # end points added
    assert out["reward"] == pytest.approx([1.0, 0.25, 0.0, 0.25, 1.0])
    assert out["reward_barrier"] == pytest.approx(1.0)
    assert out["loss_barrier"] == pytest.approx(1.0)
    linear = mode_connectivity(a, b, [0.5], reward_fn=lambda m: m.weight.item())
    assert linear["reward"] == [0.0, 1.0, 2.0]
    assert linear["reward_barrier"] == 0.0 and linear["loss"] is None and linear["loss_barrier"] is None
    assert a.weight.item() == 0.0 and b.weight.item() == 2.0
    with pytest.raises(ValueError, match="reward_fn"):
        mode_connectivity(a, b)
    with pytest.raises(ValueError, match="ts"):
        mode_connectivity(a, b, [1.5], reward_fn=reward)


def test_mode_connectivity_self_is_zero(tiny_llama, tokenizer):
    loss_fn = lm_loss_fn(tokenizer, ["hello world", [{"role": "user", "content": "hi"}]])
    out = mode_connectivity(tiny_llama, copy.deepcopy(tiny_llama), [0.3, 0.7], loss_fn=loss_fn, reward_fn=loss_fn)
    assert out["loss_barrier"] == 0.0
    assert out["reward_barrier"] == 0.0
    assert len(set(out["loss"])) == 1


def test_lm_loss_fn_uniform_model(tiny_llama, tokenizer):
    with torch.no_grad():
        tiny_llama.lm_head.weight.zero_()  # logits 0 -> every token has probability 1/V
    loss = lm_loss_fn(tokenizer, ["hello", "a much longer text"], batch_size=1)(tiny_llama)
    assert loss == pytest.approx(math.log(len(tokenizer)), rel=1e-6)


def test_update_cosine():
    theta0 = {"w": torch.tensor([1.0, 1.0, 1.0])}
    a = {"w": torch.tensor([4.0, 5.0, 1.0])}  # delta (3, 4, 0)
    assert update_cosine(a, a, theta0) == pytest.approx(1.0, abs=1e-15)
    assert update_cosine(a, {"w": torch.tensor([-2.0, -3.0, 1.0])}, theta0) == pytest.approx(-1.0, abs=1e-15)
    assert update_cosine(a, {"w": torch.tensor([5.0, 4.0, 1.0])}, theta0) == pytest.approx(24 / 25)  # (4, 3, 0)
    assert update_cosine(a, {"w": torch.tensor([1.0, 1.0, 7.0])}, theta0) == 0.0
    with pytest.raises(ValueError, match="zero"):
        update_cosine(theta0, a, theta0)


# ------------------------------------------------------------------------------------------------------ diversity


def test_success_diversity_hand_computed():
    assert success_diversity([0.0, 1.0]) == pytest.approx(LN2)
    assert success_diversity([0.0, 0.0, 1.0, 1.0]) == pytest.approx(LN2)
    assert success_diversity([0.3, 0.3, 0.3]) == 0.0
    assert success_diversity(torch.tensor([1.0])) == 0.0
    assert success_diversity([0.5, 1.0]) == pytest.approx(_h(0.75) - (_h(0.5) + _h(1.0)) / 2)
    assert success_diversity([0.2, 0.4, 0.9]) == pytest.approx(_h(0.5) - (_h(0.2) + _h(0.4) + _h(0.9)) / 3)
    matrix = torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1]])
    assert success_diversity_from_matrix(matrix) == pytest.approx(_h(0.75) - LN2 / 2)
    assert success_diversity_from_matrix([[True, False], [False, True]]) == 0.0  # equal rates 0.5


@pytest.mark.parametrize("bad", [[0.5, 1.5], [-0.1], [], [[0.5]], [float("nan")]])
def test_success_diversity_errors(bad):
    with pytest.raises(ValueError, match="success_rates"):
        success_diversity(bad)


def test_success_diversity_matrix_errors():
    with pytest.raises(ValueError, match="0/1"):
        success_diversity_from_matrix([[0.5, 1.0]])
    with pytest.raises(ValueError, match="2-D"):
        success_diversity_from_matrix([1, 0])


# --------------------------------------------------------------------------------------------------------- report


def _sum_reward(m):
    return float(sum(p.detach().double().sum() for p in m.parameters()))


def test_analyze_in_memory(tiny_llama, tokenizer, tmp_path, capsys):
    a, b = _perturbed(tiny_llama, seed=1), _perturbed(tiny_llama, seed=2)
    snaps = [_snapshot(m) for m in (tiny_llama, a, b)]
    report = analyze(
        tiny_llama,
        a,
        b,
        tokenizer,
        prompts=["hi", "abc"],
        reward_fn=_sum_reward,
        taus=[0.0, 0.05],
        ts=[0.0, 0.5, 1.0],
        output_dir=tmp_path,
        max_new_tokens=2,
    )
    for m, s in zip((tiny_llama, a, b), snaps):
        _assert_unchanged(m, s)
    assert report["drift"]["a"] == parameter_drift(a, tiny_llama)
    assert set(report["kl"]) == {"a", "b"}
    assert report["sparsity"]["a"]["fraction_reset"][0] == 0.0  # every coordinate moved
    assert report["mode_connectivity"]["endpoints"] == ["a", "b"]
    assert report["mode_connectivity"]["loss"] is not None  # default lm loss on the prompts
    assert report["update_cosine"] == pytest.approx(update_cosine(a, b, tiny_llama))
    assert report["skipped"] == {}
    assert sorted(report["plots"]) == ["drift.png", "kl.png", "mode_connectivity.png", "sparsity.png"]
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["update_cosine"] == pytest.approx(report["update_cosine"])
    assert on_disk["drift"]["b"]["l2"] == pytest.approx(report["drift"]["b"]["l2"])
    for name in report["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # One progress bar over every evaluation: 2 drifts + 2 KLs + 2 x 2 sparsity rewards + 3 x (reward, loss) on the
    # path + the cosine = 15, all done.
    progress = capsys.readouterr().err
    assert "15/15" in progress and "mode connectivity a -> b (3 points)" in progress


def test_analyze_from_paths(tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    a_dir = str(tmp_path / "a")
    _perturbed(base).save_pretrained(a_dir)
    out = tmp_path / "report"
    report = analyze(tiny_model_dir, a_dir, prompts=["hi"], ts=[0.0, 1.0], output_dir=str(out), max_new_tokens=2)
    assert report["models"] == {"base": tiny_model_dir, "a": a_dir}
    assert report["drift"]["a"]["l2"] > 0
    assert report["mode_connectivity"]["endpoints"] == ["base", "a"]
    assert set(report["skipped"]) == {"sparsity", "update_cosine"}
    assert sorted(os.listdir(out)) == ["drift.png", "kl.png", "mode_connectivity.png", "report.json"]


def test_analyze_peft_adapter_path(tiny_model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lora = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        peft.LoraConfig(r=2, target_modules=["v_proj"], init_lora_weights=False),
    )
    adapter_dir = str(tmp_path / "adapter")
    lora.save_pretrained(adapter_dir)
    report = analyze(tiny_model_dir, adapter_dir, ts=[0.0, 1.0])  # no prompts, no reward: drift only
    assert report["drift"]["a"]["l2"] == pytest.approx(parameter_drift(lora, base)["l2"], rel=1e-6)
    assert report["drift"]["a"]["per_group"]["v_proj"]["l2"] > 0
    assert report["drift"]["a"]["per_group"]["q_proj"]["l2"] == 0.0
    assert set(report["skipped"]) == {"kl", "sparsity", "mode_connectivity", "update_cosine"}
