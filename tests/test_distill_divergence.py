"""The distillation divergences (hftrain/methods/distill/divergence.py): each against a direct torch formula
(kl_div), chunked equal to unchunked in value and gradient, top-k renormalised over the teacher's k tokens; and the
trainer's loss on a batch (logits and on_policy): 0 for a copy of the teacher, else the by-hand divergence per
completion token at the same position."""

import math

import pytest
import torch
import torch.nn.functional as F

from hftrain.methods.distill.divergence import DivergenceSpec, divergence_sum, token_divergences
from tests.exactness import beyond, within


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
    within("distill.divergence.vs_formula.value", got, reference(s, t, kind, beta, temperature))  # fp32 inside


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
    within("distill.divergence.chunked_vs_unchunked.value", values[0], values[1])
    within("distill.divergence.chunked_vs_unchunked.grads", grads[0], grads[1])
    # and the gradient is the reference formula's
    s = logits(seed=3).float().requires_grad_(True)
    reference(s, t, kind, beta, temperature).backward()
    within("distill.divergence.vs_formula.grads", grads[1], s.grad)


def test_every_divergence_of_a_distribution_to_itself_is_zero_and_jsd_is_bounded():
    s, t = logits(seed=5), logits(seed=6)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        spec = DivergenceSpec(kind, 0.3)  # judged against the divergence of two distributions apart, s to t
        within("distill.divergence.to_itself_is_zero", divergence_sum(s, s, spec), 0.0, label=kind,
               scale=float(divergence_sum(s, t, spec)))
    # a generalised JSD is at most the entropy bound h(beta) per token
    bound = -(0.3 * math.log(0.3) + 0.7 * math.log(0.7)) * s.shape[0]
    assert 0 < float(divergence_sum(s, t, DivergenceSpec("jsd", 0.3))) <= bound


def test_top_k_renormalises_both_over_the_teachers_k_tokens():
    s, t = logits(rows=6, seed=7), logits(rows=6, seed=8)
    keep = t.topk(4, -1).indices
    expected = reference(s.gather(-1, keep), t.gather(-1, keep), "reverse_kl")
    got = divergence_sum(s, t, DivergenceSpec("reverse_kl", top_k=4))
    within("distill.divergence.top_k_vs_formula", got, expected)
    # the fault it catches: top_k ignored, the divergence over the whole vocabulary
    beyond("distill.divergence.top_k_vs_formula", reference(s, t, "reverse_kl"), expected)


def test_per_token_values_and_no_rows():
    s, t = logits(rows=3, seed=9), logits(rows=3, seed=10)
    per = token_divergences(s, t, DivergenceSpec("forward_kl"))
    assert per.shape == (3,)
    within("distill.divergence.per_token_vs_formula", per[1], reference(s[1:2], t[1:2], "forward_kl"))
    assert float(divergence_sum(s[:0], t[:0], DivergenceSpec("forward_kl"))) == 0.0


# -- the trainer's loss on a batch: the teacher's and student's distributions compared at the same position ----------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A spiky teacher, a student of another seed, the tokenizer they share (hftrain.tiny)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    from .conftest import DEMO_TRAIN, SMALL

    root, texts = tmp_path_factory.mktemp("distill_pair"), texts_of_jsonl([DEMO_TRAIN])
    spiky = {**SMALL, "initializer_range": 0.3}
    paths = {name: build_tiny_model(str(root / name), texts, config=spiky, vocab_size=300, seed=seed)
             for name, seed in (("teacher", 1), ("student", 0))}
    load = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for name, path in paths.items()}
    return load["teacher"], load["student"], AutoTokenizer.from_pretrained(paths["teacher"]), paths["teacher"]


def distill_trainer(tmp_path, student, teacher, tokenizer, teacher_path, **section):
    from hftrain.config import HFTrainingArguments, ModelSection
    from hftrain.methods.distill.distill_section import DistillSection
    from hftrain.methods.distill.trainer import DistillTrainer

    args = HFTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", seed=3)
    spec = DistillSection(teacher=ModelSection(name_or_path=teacher_path), **section)
    return DistillTrainer(model=student, args=args, processing_class=tokenizer, teacher=teacher, section=spec)


def prompt_completion_batch(vocab, pad):
    """3 rows, right-padded as the collator pads: prompts of 5, 9 and 3 tokens, completions of 6, 2 and 11."""
    g = torch.Generator().manual_seed(7)
    lengths = [(5, 6), (9, 2), (3, 11)]
    width = max(p + c for p, c in lengths) + 2
    ids = torch.full((3, width), pad)
    labels, mask = torch.full_like(ids, -100), torch.zeros_like(ids)
    for i, (p, c) in enumerate(lengths):
        ids[i, :p + c] = torch.randint(3, vocab, (p + c,), generator=g)
        labels[i, p:p + c], mask[i, :p + c] = ids[i, p:p + c], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def by_hand(student, teacher, batch, kind, temperature=1.0, beta=0.5):
    """Per completion token (labels[b, t] set, t >= 1): the divergence between the teacher's and the student's
    distributions at position t - 1 (the one that predicts token t), summed over those tokens / their count."""
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    with torch.no_grad():
        s_all = student(input_ids=ids, attention_mask=mask).logits.double()
        t_all = teacher(input_ids=ids, attention_mask=mask).logits.double()
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if labels[b, t] == -100:
                continue
            log_s = torch.log_softmax(s_all[b, t - 1] / temperature, -1)
            log_t = torch.log_softmax(t_all[b, t - 1] / temperature, -1)
            s, p = log_s.exp(), log_t.exp()
            if kind == "forward_kl":
                value = (p * (log_t - log_s)).sum()
            elif kind == "reverse_kl":
                value = (s * (log_s - log_t)).sum()
            else:
                m = torch.log(beta * p + (1 - beta) * s)
                value = beta * (p * (log_t - m)).sum() + (1 - beta) * (s * (log_s - m)).sum()
            total, count = total + float(value), count + 1
    return total / count


SECTIONS = [{"mode": "logits", "divergence": "forward_kl"}, {"mode": "logits", "divergence": "jsd", "beta": 0.3,
                                                             "temperature": 2.0},
            {"mode": "on_policy", "divergence": "reverse_kl", "max_new_tokens": 8},
            {"mode": "on_policy", "divergence": "forward_kl", "temperature": 1.5, "max_new_tokens": 8}]


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: f"{s['mode']}-{s['divergence']}")
def test_the_trainers_loss_is_zero_for_a_copy_of_the_teacher_and_the_by_hand_divergence_otherwise(tmp_path, pair,
                                                                                                   section):
    """(a) student = a copy of the teacher: the loss DistillTrainer.compute_loss gives a batch is 0; (b) another
    student: it is the mean over the completion tokens (not the prompt, not the padding) of the divergence between
    the teacher's and the student's next-token distributions at the same position. on_policy: on the batch the
    student sampled (trainer._on_policy), whose completions are checked to be the student's."""
    import copy

    teacher, student, tokenizer, teacher_path = pair
    batch = prompt_completion_batch(len(tokenizer), tokenizer.pad_token_id)
    kind, temperature = section["divergence"], section.get("temperature", 1.0)
    for model, expected in ((copy.deepcopy(teacher), 0.0), (copy.deepcopy(student), None)):
        trainer = distill_trainer(tmp_path, model, teacher, tokenizer, teacher_path, **section)
        rows = batch
        if section["mode"] == "on_policy":
            rows = trainer._on_policy([batch])[0]
            assert torch.equal(rows["input_ids"][:, :3], batch["input_ids"][:, :3])  # the prompts kept
            assert (rows["labels"] != -100).sum() > 3 and not torch.equal(rows["labels"], batch["labels"])
        with torch.no_grad():
            loss = float(trainer.compute_loss(model.eval(), dict(rows)))
        bound = "distill.trainer_loss.copy_is_zero"
        if expected is None:
            expected = by_hand(model, teacher, rows, kind, temperature, section.get("beta", 0.5))
            assert expected > 0.05
            bound = "distill.trainer_loss.vs_by_hand"
        within(bound, loss, expected, scale=0.1)  # a loss near 0 is judged against 0.1 nat (was abs 1e-6, rel 1e-5)
