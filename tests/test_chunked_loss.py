"""Chunked linear cross-entropy (issue #18): the same loss and gradients as the logits path, without the logits."""

import pytest
import torch

from hftrain import losses
from hftrain.losses.chunked_ce import HeadMath, capture_hidden, head_of, linear_ce
from hftrain.constants import IGNORE_INDEX
from tests.exactness import beyond, within


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
    return list(torch.autograd.grad(loss, [x for x in xs if x is not None], retain_graph=True))


def reference(hidden, weight, bias, labels, mode, pos, math=HeadMath(), smoothing=0.0):
    logits = math.apply(torch.nn.functional.linear(hidden, weight, bias))
    return losses.loss_sum(logits, labels, mode, pos, smoothing)


def chunked(hidden, weight, bias, labels, mode, pos, math=HeadMath(), smoothing=0.0, chunk=4, fused=True):
    """fused: the training loss (gradients computed in forward); else per-position CE (recomputed in backward)."""
    if fused:
        return losses.hidden_loss_sum(hidden, weight, bias, labels, mode, pos, math, smoothing, chunk)
    return losses.sum_ce(losses.hidden_ce(hidden, weight, bias, labels, math, smoothing, chunk), labels, mode, pos)


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 1000])  # 1000: one chunk; 3, 7: an uneven last chunk
@pytest.mark.parametrize("mode", losses.MODES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_loss_and_gradients_equal_the_logits_path(chunk, mode, packed, fused):
    hidden, weight, bias, labels = problem(bias=True)
    pos = packed_position_ids(*labels.shape) if packed else None
    ref = reference(hidden, weight, bias, labels, mode, pos)
    got = chunked(hidden, weight, bias, labels, mode, pos, chunk=chunk, fused=fused)
    within("chunked_loss.vs_logits.loss", got, ref)
    ref_grads = grads(ref, hidden, weight, bias)
    within("chunked_loss.vs_logits.grads", grads(got, hidden, weight, bias), ref_grads)
    # Negative control: a wrong shift (hidden not shifted against the labels) is far outside the bounds.
    wrong = losses.sum_ce(losses.hidden_ce(hidden[:, 1:], weight, bias, labels[:, :-1], chunk_size=chunk),
                          labels[:, :-1], mode)
    beyond("chunked_loss.vs_logits.loss", wrong, ref)
    beyond("chunked_loss.vs_logits.grads", grads(wrong, hidden, weight, bias), ref_grads)


@pytest.mark.parametrize("math", [HeadMath(softcap=3.0), HeadMath(scale=0.25), HeadMath(divide=4.0),
                                  HeadMath(scale=2.0, softcap=1.5)])
def test_head_maths_and_label_smoothing(math):
    hidden, weight, _, labels = problem()
    for smoothing in (0.0, 0.1):
        ref = reference(hidden, weight, None, labels, "token", None, math, smoothing)
        for fused in (True, False):
            got = chunked(hidden, weight, None, labels, "token", None, math, smoothing, chunk=5, fused=fused)
            label = f"smoothing {smoothing}, fused {fused}"
            within("chunked_loss.head_maths.loss", got, ref, label=label)
            within("chunked_loss.head_maths.grads", grads(got, hidden, weight), grads(ref, hidden, weight), label=label)
    plain = reference(hidden, weight, None, labels, "token", None)
    # the maths changes the loss: the test can see it (the head's maths and the smoothing left out)
    beyond("chunked_loss.head_maths.loss", plain, ref)
    beyond("chunked_loss.head_maths.grads", grads(plain, hidden, weight), grads(ref, hidden, weight))


def test_bf16_within_bf16_tolerance():
    hidden, weight, _, labels = problem(dtype=torch.bfloat16, v=300)
    ref = reference(hidden, weight, None, labels, "token", None)
    got = chunked(hidden, weight, None, labels, "token", None, chunk=5)
    within("chunked_loss.bf16.loss", got, ref.float())
    for i, (g, r) in enumerate(zip(grads(got, hidden, weight), grads(ref, hidden, weight))):
        within("chunked_loss.bf16.grads", g, r, label=("hidden", "weight")[i])  # bf16: one rounding of 8 bits
        assert g.dtype == torch.bfloat16


def test_example_sums_from_chunks_equal_from_logits():
    hidden, weight, _, labels = problem()
    with torch.no_grad():
        ce = losses.hidden_ce(hidden, weight, None, labels, chunk_size=4)
        ref = losses.example_sums(hidden @ weight.T, labels)
    within("chunked_loss.example_sums_vs_logits", losses.example_sums(None, labels, ce=ce), ref)


def test_no_targets_gives_zero_loss_and_zero_gradients():
    hidden, weight, _, labels = problem()
    labels[:] = IGNORE_INDEX
    got = chunked(hidden, weight, None, labels, "token", None)
    assert float(got.detach()) == 0.0
    gh, gw = grads(got, hidden, weight)
    assert float(gh.abs().sum()) == 0.0 and float(gw.abs().sum()) == 0.0


def test_rows_without_a_target_are_never_projected():
    hidden, weight, _, labels = problem()
    ce = linear_ce(hidden[:, :-1].reshape(-1, 16), weight, None, labels[:, 1:].reshape(-1), chunk_size=4)
    assert (ce[labels[:, 1:].reshape(-1) == IGNORE_INDEX] == 0).all()
    assert (ce[labels[:, 1:].reshape(-1) != IGNORE_INDEX] > 0).all()


# -- the Trainer path ----------------------------------------------------------------------------------------------

def tiny_lm(vocab=512, tie=True, kind="llama", seed=0):
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie, use_cache=False)
    if kind == "gemma2":  # final_logit_softcapping 30 by default; a small cap so that it matters on random weights
        return Gemma2ForCausalLM(Gemma2Config(**common, final_logit_softcapping=0.1)).float()
    if kind == "cohere":  # logits * logit_scale
        from transformers import CohereConfig, CohereForCausalLM

        return CohereForCausalLM(CohereConfig(**common, logit_scale=4.0)).float()
    if kind == "granite":  # logits / logits_scaling
        from transformers import GraniteConfig, GraniteForCausalLM

        return GraniteForCausalLM(GraniteConfig(**common, logits_scaling=0.25)).float()
    return LlamaForCausalLM(LlamaConfig(**common)).float()


def trainer_for(model, impl, tmp_path, **kwargs):
    from hftrain.config import HFTrainingArguments
    from hftrain.methods.sft import SFTTrainer

    args = HFTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", loss_impl=impl,
                               label_smoothing_factor=kwargs.pop("label_smoothing", 0.0),
                               **{k: kwargs.pop(k) for k in ("loss_averaging",) if k in kwargs})
    return SFTTrainer(model=model, args=args, **kwargs)


def lm_batch(vocab, b=2, t=48, packed=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :10] = IGNORE_INDEX
    labels[1, 30:] = IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["position_ids"] = packed_position_ids(b, t)
    else:
        batch["attention_mask"] = torch.ones_like(ids)
    return batch


def loss_and_grads(model, impl, tmp_path, batch, chunk=16, **kwargs):
    import copy

    model = copy.deepcopy(model)
    trainer = trainer_for(model, impl, tmp_path, **kwargs)
    trainer.loss_chunk_size = chunk
    model.train()
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    return trainer, float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def trainer_case(case: str):
    """(model kind, tiny model, batch, trainer options) of a named case of the trainer-step tests."""
    kind = {"gemma2_softcap": "gemma2", "cohere": "cohere", "granite": "granite"}.get(case, "llama")
    model = tiny_lm(tie=case != "untied", kind=kind)
    batch = lm_batch(512, b=3 if case == "packed" else 2, packed=case == "packed")
    kwargs = {"loss_averaging": "sequence"} if case == "sequence" else {}
    if case == "label_smoothing":
        kwargs["label_smoothing"] = 0.1
    return kind, model, batch, kwargs


@pytest.mark.parametrize("case", ["tied", "untied", "packed", "gemma2_softcap", "cohere", "granite", "sequence",
                                  "label_smoothing"])
def test_trainer_step_chunked_equals_logits(case, tmp_path):
    kind, model, batch, kwargs = trainer_case(case)
    ref_trainer, ref, ref_grads = loss_and_grads(model, "logits", tmp_path, batch, **kwargs)
    trainer, got, grads_ = loss_and_grads(model, "chunked", tmp_path, batch, **kwargs)
    assert ref_trainer._head is None and trainer._head is not None
    within("chunked_loss.trainer_step.loss", got, ref)
    assert ref_grads.keys() == grads_.keys()
    within("chunked_loss.trainer_step.grads", grads_, ref_grads)
    if case == "tied":  # the head's gradient reached the embedding (the one parameter both use)
        assert float(grads_["model.embed_tokens.weight"].abs().sum()) > 0
    if kind != "llama":  # the head's maths is found and applied: without it the loss differs
        trainer._head = (trainer._head[0], HeadMath())
        _, plain = trainer._ce(trainer.model, {k: v for k, v in batch.items() if k != "labels"}, batch["labels"])
        beyond("chunked_loss.trainer_step.loss",
               float(losses.sum_ce(plain, batch["labels"])) / int((batch["labels"][:, 1:] != -100).sum()), ref)


def test_lora_trains_through_the_chunked_loss(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_lm(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    batch = lm_batch(512)
    _, ref, ref_grads = loss_and_grads(model, "logits", tmp_path, batch)
    trainer, got, grads_ = loss_and_grads(model, "chunked", tmp_path, batch)
    assert trainer._head is not None
    within("chunked_loss.trainer_step.loss", got, ref, label="lora")
    assert len(grads_) == 4 and grads_.keys() == ref_grads.keys()  # the LoRA matrices only
    within("chunked_loss.trainer_step.grads", grads_, ref_grads, label="lora")


def test_a_head_it_cannot_reproduce_falls_back_under_auto_and_is_refused_when_asked(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    from hftrain.errors import ModelError

    model = get_peft_model(tiny_lm(tie=False), LoraConfig(r=4, target_modules=["lm_head"]))
    assert head_of(model)[0] is None and "not a plain torch.nn.Linear" in head_of(model)[2]
    assert trainer_for(model, "auto", tmp_path)._head is None
    assert "hftrain: loss: the cross-entropy from the model's logits (training.loss_impl: auto; the chunked loss " \
        "cannot run: " in capsys.readouterr().out
    with pytest.raises(ModelError, match="training.loss_impl: chunked cannot be used"):
        trainer_for(model, "chunked", tmp_path)
    assert trainer_for(tiny_lm(), "auto", tmp_path)._head is not None  # auto on a plain causal LM: chunked


def test_eval_sums_in_chunks_equal_from_logits(tmp_path):
    model = tiny_lm().eval()
    batch = lm_batch(512)
    a = trainer_for(model, "chunked", tmp_path)
    b = trainer_for(model, "logits", tmp_path)
    for t in (a, b):
        t.prediction_step(model, dict(batch), prediction_loss_only=True)
    within("chunked_loss.eval_sums_vs_logits", a._eval_sums[0], b._eval_sums[0])
    # No metric reads the logits (compute_metrics None): chunked too, and no logits returned; the logits path
    # returns them.
    assert a.prediction_step(model, dict(batch), prediction_loss_only=False) == (None, None, None)
    assert b.prediction_step(model, dict(batch), prediction_loss_only=False)[1].shape == (2, 48, 512)
    within("chunked_loss.eval_sums_vs_logits", a._eval_sums[1], b._eval_sums[1])


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest number of elements of any tensor an op creates (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_the_full_logits_is_ever_created(tmp_path):
    vocab, chunk = 8192, 32
    model = tiny_lm(vocab=vocab, tie=False)
    batch = lm_batch(vocab, b=2, t=128)
    n_targets = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    largest = {}
    for impl in ("logits", "chunked"):
        trainer = trainer_for(model, impl, tmp_path)
        trainer.loss_chunk_size = chunk
        model.zero_grad()
        with LargestTensor() as mode:
            trainer.compute_loss(model, dict(batch)).backward()
        largest[impl] = mode.largest
    # Negative control: the logits path creates (tokens x vocabulary) tensors.
    assert largest["logits"] >= 2 * 128 * vocab
    # Chunked: nothing larger than the head's weight (and its gradient), the only vocabulary-sized tensor left;
    # a chunk's logits are chunk x vocabulary, 32 times less than the targets' logits.
    assert largest["chunked"] <= vocab * 32
    assert n_targets * vocab > 4 * largest["chunked"]


class HeadDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """The dtypes of every matmul output whose last dimension is the vocabulary (the head's logits)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.dtypes = vocab, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default) \
                and out.shape[-1] == self.vocab:
            self.dtypes.add(out.dtype)
        return out


def test_the_head_runs_under_the_autocast_of_the_forward(tmp_path):
    """accelerate's mixed precision wraps the model's forward in autocast, not the loss: the chunked head must
    still run in bf16, as lm_head does in the logits path."""
    model = tiny_lm(vocab=512)
    forward = model.forward
    model.forward = lambda *a, **k: torch.autocast("cpu", torch.bfloat16)(forward)(*a, **k)
    batch = lm_batch(512)
    seen, loss = {}, {}
    for impl in ("logits", "chunked"):
        trainer = trainer_for(model, impl, tmp_path)
        with HeadDtypes(512) as mode:
            loss[impl] = trainer.compute_loss(model, dict(batch))
            loss[impl].backward()
        seen[impl] = mode.dtypes
    assert seen["logits"] == {torch.bfloat16} and seen["chunked"] == {torch.bfloat16}
    within("chunked_loss.autocast_bf16.loss", loss["chunked"], loss["logits"])
    del model.forward
    with HeadDtypes(512) as mode:  # negative control: without the forward's autocast the head runs in fp32
        trainer.compute_loss(model, dict(batch))
    assert mode.dtypes == {torch.float32}


def test_loss_impl_key():
    from hftrain.config import RecipeError
    from hftrain.methods import load_recipe
    from hftrain.launch.setup import training_arguments

    base = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}}
    assert load_recipe(None, [], raw=dict(base)).training["loss_impl"] == "auto"
    assert load_recipe(None, ["training.loss_impl=chunked"], raw=dict(base)).training["loss_impl"] == "chunked"
    expected = "training.loss_impl: expected one of 'auto', 'chunked', 'fused', 'logits', got 'x'"
    with pytest.raises(RecipeError, match=expected):
        load_recipe(None, ["training.loss_impl=x"], raw=dict(base))
    # typed end to end: the trainer reads it from its arguments
    assert training_arguments(load_recipe(None, ["training.loss_impl=chunked"], raw=dict(base))).loss_impl == "chunked"


def test_placeholder_is_in_the_graph_but_passes_no_gradient():
    """ZeRO-3 pairs lm_head's backward hooks only when a gradient passes lm_head's output (SFTTrainer._ce
    (ChunkedLossMixin) adds 0 * its sum): the placeholder must require grad, let a gradient through and add nothing
    to the hidden states."""
    head = torch.nn.Linear(4, 7)
    h = torch.randn(2, 3, 4, requires_grad=True)
    with capture_hidden(head) as captured:
        out = head(h)
    assert captured.hidden is h and captured.weight is head.weight
    assert out.shape == (2, 3, 1) and out.requires_grad and not out.any()
    seen = []
    out.register_hook(seen.append)
    (out.sum() * 0 + h.sum()).backward()
    assert len(seen) == 1  # the gradient passed the output, where ZeRO-3's pre-backward hook sits
    torch.testing.assert_close(h.grad, torch.ones_like(h), rtol=0, atol=0)  # and added nothing to the input
    assert head.weight.grad is None
