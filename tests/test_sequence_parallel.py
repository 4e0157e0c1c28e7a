"""Sequence parallelism (strategy.sequence_parallel): the maths of a split sequence, the batches and attention it
needs, the checks before launch; on 2 ranks (tests/test_sequence_parallel_runs.py) the runs themselves."""

import copy

import pytest
import torch
import torch.nn.functional as F

from hftrain import losses
from hftrain import sequence_parallel as sp
from hftrain.checkpoints import layout, layout_problems
from hftrain.config import RecipeError
from hftrain.methods import load_recipe
from hftrain.constants import IGNORE_INDEX
from hftrain.data import make_collator, tokenize_example
from hftrain.errors import LaunchError
from hftrain.launch import check_recipe
from hftrain.launch.plan import ModelFacts, format_plan, plan

from .conftest import DEMO_TRAIN
from .exactness import beyond, within

BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}}


def packed_batch(b=2, t=12, v=13, seed=0):
    """Logits, hidden states, labels and position_ids of packed rows whose sequences cross the middle of the row
    (where 2 slices meet), with uneven target counts."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, 5, generator=g)
    head = torch.randn(v, 5, generator=g)
    labels = torch.randint(0, v, (b, t), generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1]])
    labels[pos == 0] = IGNORE_INDEX  # no sequence predicts the next one's first token
    labels[0, 1:4] = IGNORE_INDEX  # a prompt
    labels[1, -2:] = IGNORE_INDEX  # padding
    return hidden, head, hidden @ head.T, labels, pos


def slices(t: torch.Tensor, n: int):
    w = t.shape[1] // n
    return [t[:, r * w:(r + 1) * w] for r in range(n)]


@pytest.mark.parametrize("mode", losses.MODES)
def test_the_slices_add_up_to_the_rows_loss_and_counts(mode):
    """What each of N ranks computes from its slice (labels shifted by the loader, weights from the whole rows) adds
    up to the loss_sum and counts of the whole rows; weights from a slice alone would not (sequences cross)."""
    hidden, head, logits, labels, pos = packed_batch()
    n = 2
    shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # what DeepSpeed's loader hands each rank, sliced
    whole = losses.loader_shifted(shift, pos)
    weights = losses.weights_of(*whole, mode).reshape(shift.shape)
    parts = [(losses.aligned_ce(lg, tg) * w.reshape(-1)).sum()
             for lg, tg, w in zip(slices(logits, n), slices(shift, n), slices(weights, n))]
    within("sequence_parallel.slices_vs_rows.loss_sum", sum(parts), losses.loss_sum(logits, labels, mode, pos),
           label=mode)
    chunked = [losses.aligned_hidden_loss_sum(h, head, None, tg, w.reshape(-1), chunk_size=3)
               for h, tg, w in zip(slices(hidden, n), slices(shift, n), slices(weights, n))]
    within("sequence_parallel.chunked_slices_vs_rows.loss_sum", sum(chunked),
           losses.loss_sum(logits, labels, mode, pos), label=mode)
    assert losses.counts_of(*whole) == losses.count_targets(labels, pos)
    tokens = sum(int((tg != IGNORE_INDEX).sum()) for tg in slices(shift, n))
    assert tokens == losses.count_targets(labels, pos)[0]
    if mode == "sequence":
        alone = losses.weights_of(*losses.loader_shifted(slices(shift, n)[0], slices(pos, n)[0]), mode)
        assert not torch.allclose(alone, slices(weights, n)[0].reshape(-1))


def test_shardable_rows(tokenizer):
    exs = [tokenize_example({"prompt": f"reverse: {'a ' * k}", "completion": "b " * (k + 2)}, tokenizer, False)
           for k in (1, 8, 2)]
    tokenizer.padding_side = "left"  # the mask is dropped under Ulysses: rows are padded on the right regardless
    try:
        padded = sp.ShardableRows(tokenizer.pad_token_id, 4, rows=5, packed=False)(exs)
    finally:
        tokenizer.padding_side = "right"
    longest = max(len(e["input_ids"]) for e in exs)
    width = -(-longest // 4) * 4
    assert padded["input_ids"].shape == padded["labels"].shape == padded["position_ids"].shape == (5, width)
    for i, e in enumerate(exs):
        assert padded["input_ids"][i, :len(e["input_ids"])].tolist() == e["input_ids"]
        assert padded["labels"][i, :len(e["labels"])].tolist() == e["labels"]
    assert (padded["labels"][3:] == IGNORE_INDEX).all() and (padded["input_ids"][3:] == tokenizer.pad_token_id).all()
    assert all(len(r) == 1 for r in sp.segments(padded["position_ids"]))  # one causal run per row: no split
    inner = make_collator(tokenizer, packing=True)(exs)
    packed = sp.ShardableRows(tokenizer.pad_token_id, 4, rows=3, packed=True)(exs)
    assert packed["input_ids"].shape[0] == 3 and packed["input_ids"].shape[1] % 4 == 0
    w = inner["input_ids"].shape[1]
    assert torch.equal(packed["input_ids"][:2, :w], inner["input_ids"])
    assert torch.equal(packed["position_ids"][:2, :w], inner["position_ids"])
    width = packed["input_ids"].shape[1]  # the padding goes on the last run of each row
    assert sp.segments(packed["position_ids"][:2]) == [r[:-1] + [(r[-1][0], width)]
                                                       for r in sp.segments(inner["position_ids"])]
    assert losses.count_targets(packed["labels"], packed["position_ids"]) == losses.count_targets(
        inner["labels"], inner["position_ids"])


def test_per_example_attention_equals_the_packed_mask(tiny_model_dir, tokenizer):
    """DocumentAttention's kernel (what Ulysses calls with the whole sequence, mask dropped) gives a packed row the
    logits transformers' own packed mask gives; outside training `dispatch` is the kernel with the model's mask."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.config.use_cache = False  # as modeling.load_model sets for packing: with a cache no packed mask is built
    exs = [tokenize_example({"prompt": f"reverse: {'a ' * k}", "completion": "b " * (k + 2)}, tokenizer, False)
           for k in (1, 8, 2)]
    batch = make_collator(tokenizer, packing=True)(exs)
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    attention = sp.DocumentAttention("sdpa")
    calls = []

    def ulysses(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append(attention_mask)  # Ulysses drops it: the kernel sees None and the whole sequence
        return attention.by_document(module, query, key, value, None, *args, **kwargs)

    attention.install()
    try:
        attention.registry["sdpa"] = ulysses
        attention.dispatch_after_prepare()
        with torch.no_grad():
            got_eval = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            assert not calls  # eval: the kernel itself, with transformers' packed mask
            model.train()
            got = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            assert calls
            unmasked = attention.kernel  # a negative control: the kernel on the whole row, causal only
            attention.registry["sdpa"] = lambda m, q, k, v, mask, *a, **kw: unmasked(m, q, k, v, None, *a, **kw)
            leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    finally:
        attention.uninstall()
    within("sequence_parallel.eval_dispatch_vs_packed_mask.logits", got_eval, expected)
    within("sequence_parallel.document_attention_vs_packed_mask.logits", got, expected)
    # the control: attention across the documents of a row (the mask dropped, no split by document)
    beyond("sequence_parallel.eval_dispatch_vs_packed_mask.logits", leaky, expected, label="mask dropped")
    beyond("sequence_parallel.document_attention_vs_packed_mask.logits", leaky, expected, label="mask dropped")


def test_recipe_rules():
    def problems(strategy, **sections):
        with pytest.raises(RecipeError) as e:
            load_recipe(None, raw={**BASE, "strategy": strategy, **sections})
        return str(e.value)

    ok = load_recipe(None, raw={**BASE, "strategy": {"name": "zero3", "sequence_parallel": 2}})
    assert ok.strategy.resolved_sequence_parallel() == 2
    load_recipe(None, raw={**BASE, "strategy": {"name": "ddp", "sequence_parallel": 1}})  # 1 is off anywhere
    assert "set strategy.name: zero3" in problems({"name": "fsdp", "sequence_parallel": 2})
    assert "not 'ddp'" in problems({"name": "ddp", "sequence_parallel": 2})
    assert "must be at least 1" in problems({"name": "zero2", "sequence_parallel": 0})
    assert "multiple of strategy.sequence_parallel (2)" in problems(
        {"name": "zero2", "sequence_parallel": 2, "num_processes": 3})
    assert "model.attn_implementation: 'eager'" in problems(
        {"name": "zero2", "sequence_parallel": 2}, model={"name_or_path": "m", "attn_implementation": "eager"})
    assert "compression.method: 'bf16'" in problems({"name": "zero2", "sequence_parallel": 2},
                                                    compression={"method": "bf16"})
    assert "moe: cannot be combined" in problems({"name": "zero2", "sequence_parallel": 2},
                                                 moe={"aux_loss_coef": 0.01})
    # GRPO passed these checks although nothing splits its rollouts (issue 43)
    grpo = {"rewards": [{"function": "exact_match"}]}
    assert "strategy.sequence_parallel: GRPO does not run under sequence parallelism" in problems(
        {"name": "zero3", "sequence_parallel": 2}, grpo=grpo)
    load_recipe(None, raw={**BASE, "strategy": {"name": "zero3"}, "grpo": grpo})  # negative control: without it


def test_checks_before_launch_heads_and_world(tiny_model_dir, tmp_path):
    """The tiny model has 2 attention heads and 1 key/value head: N=2 fits, N=4 does not; the world must be a
    multiple of N."""
    raw = {"model": {"name_or_path": tiny_model_dir}, "data": {"sources": [{"path": DEMO_TRAIN}]},
           "training": {"output_dir": str(tmp_path / "out")}, "strategy": {"name": "zero2", "sequence_parallel": 2}}
    _, strategy = check_recipe(None, raw=copy.deepcopy(raw))
    assert strategy.sequence_parallel == 2
    with pytest.raises(RecipeError, match="does not divide the model's 2 attention heads"):
        check_recipe(None, ["strategy.sequence_parallel=4", "strategy.num_processes=4"], raw=copy.deepcopy(raw))
    with pytest.raises(RecipeError, match="must divide the 3 processes"):
        check_recipe(None, raw=copy.deepcopy(raw), launcher="zero2", world_size=3)


def test_launcher_config_must_agree(monkeypatch):
    from hftrain.config import StrategySection
    from hftrain.launch.setup import _check_launcher_sequence_parallel

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    _check_launcher_sequence_parallel(StrategySection(name="zero2", sequence_parallel=2))
    with pytest.raises(LaunchError, match="takes it from the recipe"):
        _check_launcher_sequence_parallel(StrategySection(name="zero2"))


def test_plan_splits_the_activations():
    facts = ModelFacts(params=10**9, trainable=10**9, largest_layer=10**7, hidden=4096, layers=32, vocab=32000,
                       weight_bytes=2)
    one = {r.strategy: r for r in plan(facts, 8, 1, 1, 32768, True, True)}
    two = {r.strategy: r for r in plan(facts, 8, 1, 1, 32768, True, True, sequence_parallel=2)}
    for s in ("zero2", "zero3"):
        assert two[s].gpu_activations == pytest.approx(one[s].gpu_activations / 2)
        assert two[s].gpu_model_states == one[s].gpu_model_states
    assert two["ddp"].gpu_activations == one["ddp"].gpu_activations  # cannot split sequences
    assert "hold 1/2 of each sequence" in format_plan(list(two.values()), None, 2)


def test_a_sequence_parallel_checkpoint_resumes_on_its_own_layout(tmp_path):
    import json

    from hftrain.checkpoints import LAYOUT

    (tmp_path / LAYOUT).write_text(json.dumps(layout(4, 1, 2, "zero3", 2)))
    assert layout_problems(str(tmp_path), layout(4, 1, 2, "zero3", 2)) == []
    assert "strategy.sequence_parallel: 2" in layout_problems(str(tmp_path), layout(4, 1, 4, "zero3"))[0]
    assert layout_problems(str(tmp_path), layout(2, 1, 2, "zero3", 2))


def test_trainer_skip_defers_to_the_loader():
    import transformers.trainer as t

    from hftrain.patches.transformers import skip_batches_of_sequence_shards

    class Loader:
        def skip_first_batches(self, k):
            self.skipped = k
            return self

    skip_batches_of_sequence_shards()
    loader = Loader()
    assert t.skip_first_batches(loader, 3) is loader and loader.skipped == 3
    plain = torch.utils.data.DataLoader(list(range(6)), batch_size=2)
    assert [b.tolist() for b in t.skip_first_batches(plain, 2)] == [[4, 5]]

