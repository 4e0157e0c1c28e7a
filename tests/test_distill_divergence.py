"""The distillation divergences (hftrain/methods/distill/divergence.py): each against a direct torch formula
(kl_div), chunked equal to unchunked in value and gradient, top-k renormalised over the teacher's k tokens."""

import math

import pytest
import torch
import torch.nn.functional as F

from hftrain.methods.distill.divergence import DivergenceSpec, divergence_sum, token_divergences


def logits(rows=37, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3


def reference(student, teacher, kind, beta=0.5, temperature=1.0):
    """torch's kl_div, summed over tokens: kl_div(input=log q, target=log p, log_target) = KL(p || q)."""
    log_s = F.log_softmax(student / temperature, -1)
    log_t = F.log_softmax(teacher / temperature, -1)
    if kind == "forward_kl":
        return F.kl_div(log_s, log_t, reduction="sum", log_target=True)
    if kind == "reverse_kl":
        return F.kl_div(log_t, log_s, reduction="sum", log_target=True)
    m = torch.log(beta * log_t.exp() + (1 - beta) * log_s.exp())
    return (beta * F.kl_div(m, log_t, reduction="sum", log_target=True)
            + (1 - beta) * F.kl_div(m, log_s, reduction="sum", log_target=True))


CASES = [("forward_kl", 0.5, 1.0), ("reverse_kl", 0.5, 2.0), ("jsd", 0.5, 1.0), ("jsd", 0.1, 0.7)]


@pytest.mark.parametrize("kind,beta,temperature", CASES)
def test_divergence_is_the_direct_formula(kind, beta, temperature):
    s, t = logits(seed=1), logits(seed=2)
    got = divergence_sum(s, t, DivergenceSpec(kind, beta, temperature))
    assert float(got) == pytest.approx(float(reference(s, t, kind, beta, temperature)), rel=1e-6)  # fp32 inside


@pytest.mark.parametrize("kind,beta,temperature", CASES)
def test_chunked_equals_unchunked_values_and_gradients(kind, beta, temperature):
    spec = DivergenceSpec(kind, beta, temperature)
    t = logits(seed=4).float()
    grads, values = [], []
    for chunk in (5, 1000):  # 8 chunks (the last of 2 rows) against one
        s = logits(seed=3).float().requires_grad_(True)
        value = divergence_sum(s, t, spec, chunk_size=chunk)
        value.backward()
        values.append(float(value.detach()))
        grads.append(s.grad)
    assert values[0] == pytest.approx(values[1], rel=1e-6)
    assert torch.allclose(grads[0], grads[1], rtol=1e-6, atol=1e-7)
    # and the gradient is the reference formula's
    s = logits(seed=3).float().requires_grad_(True)
    reference(s, t, kind, beta, temperature).backward()
    assert torch.allclose(grads[1], s.grad, rtol=1e-5, atol=1e-6)


def test_every_divergence_of_a_distribution_to_itself_is_zero_and_jsd_is_bounded():
    s, t = logits(seed=5), logits(seed=6)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        assert float(divergence_sum(s, s, DivergenceSpec(kind, 0.3))) == pytest.approx(0.0, abs=1e-4)
    # a generalised JSD is at most the entropy bound h(beta) per token
    bound = -(0.3 * math.log(0.3) + 0.7 * math.log(0.7)) * s.shape[0]
    assert 0 < float(divergence_sum(s, t, DivergenceSpec("jsd", 0.3))) <= bound


def test_top_k_renormalises_both_over_the_teachers_k_tokens():
    s, t = logits(rows=6, seed=7), logits(rows=6, seed=8)
    keep = t.topk(4, -1).indices
    expected = reference(s.gather(-1, keep), t.gather(-1, keep), "reverse_kl")
    got = divergence_sum(s, t, DivergenceSpec("reverse_kl", top_k=4))
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    assert float(got) != pytest.approx(float(reference(s, t, "reverse_kl")), rel=1e-3)


def test_per_token_values_and_no_rows():
    s, t = logits(rows=3, seed=9), logits(rows=3, seed=10)
    per = token_divergences(s, t, DivergenceSpec("forward_kl"))
    assert per.shape == (3,)
    assert float(per[1]) == pytest.approx(float(reference(s[1:2], t[1:2], "forward_kl")), rel=1e-6)
    assert float(divergence_sum(s[:0], t[:0], DivergenceSpec("forward_kl"))) == 0.0
