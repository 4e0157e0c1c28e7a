"""Chunked linear cross-entropy (issue #18): the same loss and gradients as the logits path, without the logits."""

import pytest
import torch

from hftrain import losses
from hftrain.chunked_ce import HeadMath, capture_hidden, head_of, linear_ce
from hftrain.constants import IGNORE_INDEX


def problem(b=3, t=11, h=16, v=37, seed=0, bias=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    b_ = (torch.randn(v, generator=g, dtype=torch.float64) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :6] = IGNORE_INDEX  # uneven target counts per row, a prompt mask
    labels[1, -2:] = IGNORE_INDEX
    labels[2, 3] = IGNORE_INDEX  # a hole inside a row
    return hidden, weight, b_, labels


def packed_position_ids(b, t):
    pos = torch.arange(t).repeat(b, 1)
    pos[0, 4:] -= 4  # row 0 holds two sequences (0..3, 0..6), row 2 three
    pos[2, 3:] -= 3
    pos[2, 8:] -= 5
    return pos


def grads(loss, *xs):
    return [g for g in torch.autograd.grad(loss, [x for x in xs if x is not None])]


def reference(hidden, weight, bias, labels, mode, pos, math=HeadMath(), smoothing=0.0):
    logits = math.apply(torch.nn.functional.linear(hidden, weight, bias))
    return losses.loss_sum(logits, labels, mode, pos, smoothing)


def chunked(hidden, weight, bias, labels, mode, pos, math=HeadMath(), smoothing=0.0, chunk=4):
    return losses.sum_ce(losses.hidden_ce(hidden, weight, bias, labels, math, smoothing, chunk), labels, mode, pos)


def assert_rel(a, b, rel=1e-5):
    a, b = a.detach().double(), b.detach().double()
    err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
    assert err <= rel, f"relative difference {err:.2e}"


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 1000])  # 1000: one chunk; 3, 7: an uneven last chunk
@pytest.mark.parametrize("mode", losses.MODES)
@pytest.mark.parametrize("packed", [False, True])
def test_loss_and_gradients_equal_the_logits_path(chunk, mode, packed):
    hidden, weight, bias, labels = problem(bias=True)
    pos = packed_position_ids(*labels.shape) if packed else None
    ref = reference(hidden, weight, bias, labels, mode, pos)
    got = chunked(hidden, weight, bias, labels, mode, pos, chunk=chunk)
    assert_rel(got, ref)
    for g, r in zip(grads(got, hidden, weight, bias), grads(ref, hidden, weight, bias)):
        assert_rel(g, r)
    # Negative control: a wrong shift (hidden not shifted against the labels) is far outside the tolerance.
    wrong = losses.sum_ce(losses.hidden_ce(hidden[:, 1:], weight, bias, labels[:, :-1], chunk_size=chunk),
                          labels[:, :-1], mode)
    assert abs(float(wrong) - float(ref)) > 1e-3 * abs(float(ref))


@pytest.mark.parametrize("math", [HeadMath(softcap=3.0), HeadMath(scale=0.25), HeadMath(divide=4.0),
                                  HeadMath(scale=2.0, softcap=1.5)])
def test_head_maths_and_label_smoothing(math):
    hidden, weight, _, labels = problem()
    for smoothing in (0.0, 0.1):
        ref = reference(hidden, weight, None, labels, "token", None, math, smoothing)
        got = chunked(hidden, weight, None, labels, "token", None, math, smoothing, chunk=5)
        assert_rel(got, ref)
        for g, r in zip(grads(got, hidden, weight), grads(ref, hidden, weight)):
            assert_rel(g, r)
    plain = reference(hidden, weight, None, labels, "token", None)
    assert abs(float(plain) - float(ref)) > 1e-3 * float(ref)  # the maths changes the loss: the test can see it


def test_bf16_within_bf16_tolerance():
    hidden, weight, _, labels = problem(dtype=torch.bfloat16, v=300)
    ref = reference(hidden, weight, None, labels, "token", None)
    got = chunked(hidden, weight, None, labels, "token", None, chunk=5)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    for g, r in zip(grads(got, hidden, weight), grads(ref, hidden, weight)):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-3)  # bf16 gradients: one rounding of 8 bits
        assert g.dtype == torch.bfloat16


def test_example_sums_from_chunks_equal_from_logits():
    hidden, weight, _, labels = problem()
    with torch.no_grad():
        ce = losses.hidden_ce(hidden, weight, None, labels, chunk_size=4)
        ref = losses.example_sums(hidden @ weight.T, labels)
    torch.testing.assert_close(losses.example_sums(None, labels, ce=ce), ref)


def test_no_targets_gives_zero_loss_and_zero_gradients():
    hidden, weight, _, labels = problem()
    labels[:] = IGNORE_INDEX
    got = chunked(hidden, weight, None, labels, "token", None)
    assert float(got) == 0.0
    gh, gw = grads(got, hidden, weight)
    assert float(gh.abs().sum()) == 0.0 and float(gw.abs().sum()) == 0.0


def test_rows_without_a_target_are_never_projected():
    hidden, weight, _, labels = problem()
    ce = linear_ce(hidden[:, :-1].reshape(-1, 16), weight, None, labels[:, 1:].reshape(-1), chunk_size=4)
    assert (ce[labels[:, 1:].reshape(-1) == IGNORE_INDEX] == 0).all()
    assert (ce[labels[:, 1:].reshape(-1) != IGNORE_INDEX] > 0).all()
