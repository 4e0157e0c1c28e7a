import json

import datasets
import pytest
import torch

from hftrain.errors import DataError
from hftrain.constants import IGNORE_INDEX
from hftrain.data import (
    build_datasets,
    make_collator,
    tokenize_example,
    to_messages_or_text,
)
from hftrain.config import DataSection, DataSource
from tests.exactness import beyond, within


def trainable_text(tok, out) -> str:
    ids = [i for i, lab in zip(out["input_ids"], out["labels"]) if lab != IGNORE_INDEX]
    assert ids == [lab for lab in out["labels"] if lab != IGNORE_INDEX]  # labels copy the inputs where trainable
    return tok.decode(ids)


def section(**kw) -> DataSection:
    sources = kw.pop("sources")
    return DataSection(sources=[DataSource(**s) for s in sources], **kw)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


CHAT = [{"role": "user", "content": "reverse: a b c"}, {"role": "assistant", "content": "c b a"}]


def test_messages_golden_assistant_only(tokenizer):
    out = tokenize_example({"messages": CHAT}, tokenizer, train_on_prompt=False)
    assert tokenizer.decode(out["input_ids"]) == (
        "<|im_start|>user\nreverse: a b c<|im_end|>\n<|im_start|>assistant\nc b a<|im_end|>\n"
    )
    assert trainable_text(tokenizer, out) == "c b a<|im_end|>"
    # The mask is one contiguous block: prompt tokens -100, then every token of the answer up to its stop token (the
    # "\n" the template writes after it is never generated).
    n_masked = out["labels"].index(next(x for x in out["labels"] if x != IGNORE_INDEX))
    assert out["labels"] == [IGNORE_INDEX] * n_masked + out["input_ids"][n_masked:-1] + [IGNORE_INDEX]
    assert tokenizer.decode(out["input_ids"][:n_masked]) == ("<|im_start|>user\nreverse: a b c<|im_end|>\n"
                                                             "<|im_start|>assistant\n")


def test_messages_multi_turn_masks_every_assistant_turn(tokenizer):
    msgs = CHAT + [{"role": "user", "content": "reverse: d e"}, {"role": "assistant", "content": "e d"}]
    out = tokenize_example({"messages": msgs}, tokenizer, train_on_prompt=False)
    assert trainable_text(tokenizer, out) == "c b a<|im_end|>e d<|im_end|>"


def test_messages_all_tokens_when_assistant_only_off(tokenizer):
    out = tokenize_example({"messages": CHAT}, tokenizer, train_on_prompt=True)
    assert out["labels"] == out["input_ids"]


def test_prompt_completion_golden(tokenizer):
    out = tokenize_example({"prompt": "reverse: a b ->", "completion": " b a"}, tokenizer, train_on_prompt=False)
    assert tokenizer.decode(out["input_ids"]) == "reverse: a b -> b a<|im_end|>"
    assert trainable_text(tokenizer, out) == " b a<|im_end|>"


def test_alpaca_uses_chat_template_when_present_else_prompt(tokenizer):
    ex = {"instruction": "reverse", "input": "a b", "output": "b a"}
    canon = to_messages_or_text(ex, "alpaca", has_template=True)
    assert canon["messages"] == [{"role": "user", "content": "reverse\n\na b"}, {"role": "assistant", "content": "b a"}]
    canon = to_messages_or_text(ex, "alpaca", has_template=False)
    assert canon["prompt"] == "### Instruction:\nreverse\n\n### Input:\na b\n\n### Response:\n"
    out = tokenize_example(canon, tokenizer, train_on_prompt=False)
    assert trainable_text(tokenizer, out) == "b a<|im_end|>"


def test_text_trains_on_everything(tokenizer):
    out = tokenize_example({"text": "a b c"}, tokenizer, train_on_prompt=True)
    assert tokenizer.decode(out["input_ids"]) == "a b c<|im_end|>"
    assert out["labels"] == out["input_ids"]


@pytest.mark.parametrize(
    "rows,fmt",
    [
        ([{"messages": CHAT}], "messages"),
        ([{"prompt": "p", "completion": "c"}], "prompt_completion"),
        ([{"instruction": "i", "input": "", "output": "o"}], "alpaca"),
        ([{"text": "t"}], "text"),
    ],
)
def test_format_detection_and_loading(tmp_path, tokenizer, rows, fmt):
    path = write_jsonl(tmp_path / "d.jsonl", rows * 3)
    data = build_datasets(section(sources=[{"path": path}]), tokenizer)
    assert len(data.train) == 3 and set(data.train.column_names) == {"input_ids", "labels"}
    explicit = build_datasets(section(sources=[{"path": path, "format": fmt}]), tokenizer)
    assert explicit.train["labels"] == data.train["labels"]


def test_column_mapping_and_missing_column_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}] * 2)
    with pytest.raises(DataError, match=r"cannot detect the format .*\['question', 'answer'\]"):
        build_datasets(section(sources=[{"path": path}]), tokenizer)
    with pytest.raises(DataError, match=r"format 'prompt_completion' needs column\(s\) \['prompt', 'completion'\]"):
        build_datasets(section(sources=[{"path": path, "format": "prompt_completion"}]), tokenizer)
    data = build_datasets(section(sources=[{"path": path, "columns": {"prompt": "question", "completion": "answer"}}]),
                          tokenizer)
    assert trainable_text(tokenizer, data.train[0]) == "a<|im_end|>"


def test_parquet_csv_and_saved_dataset(tmp_path, tokenizer):
    ds = datasets.Dataset.from_list([{"prompt": "p ", "completion": "x"}] * 4)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for p in ("d.parquet", "d.csv", "saved"):
        data = build_datasets(section(sources=[{"path": str(tmp_path / p)}]), tokenizer)
        assert len(data.train) == 4 and trainable_text(tokenizer, data.train[0]) == "x<|im_end|>"


def test_all_masked_examples_are_an_error_naming_them(tmp_path, tokenizer):
    long_prompt = {"prompt": "a " * 40, "completion": "b"}
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "completion": "c"}, long_prompt, long_prompt])
    cfg = section(sources=[{"path": path}], max_length=16)
    with pytest.raises(DataError, match=r"2 of 3 examples .* no trainable token "
                                        r"\(\S*d.jsonl:2, \S*d.jsonl:3\).*max_length=16"):
        build_datasets(cfg, tokenizer)
    cfg.skip_untrainable = True
    assert len(build_datasets(cfg, tokenizer).train) == 1


def test_truncation_right_and_drop(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c d e f g h"}, {"text": "a"}])
    right = build_datasets(section(sources=[{"path": path}], max_length=4), tokenizer)
    assert [len(x) for x in right.train["input_ids"]] == [4, 2]
    drop = build_datasets(section(sources=[{"path": path}], max_length=4, truncation="drop"), tokenizer)
    assert [len(x) for x in drop.train["input_ids"]] == [2]


def test_bad_files_are_named(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: malformed JSON"):
        build_datasets(section(sources=[{"path": str(bad)}]), tokenizer)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"data.sources.0.path: .*empty.jsonl is empty"):
        build_datasets(section(sources=[{"path": str(empty)}]), tokenizer)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin.jsonl:1: not UTF-8"):
        build_datasets(section(sources=[{"path": str(latin)}]), tokenizer)
    with pytest.raises(DataError, match=r"data.sources.0.path: ./nope.jsonl does not exist"):
        build_datasets(section(sources=[{"path": "./nope.jsonl"}]), tokenizer)


def test_mixing_follows_weights(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}] * 100)
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "b"}] * 100)
    data = build_datasets(section(sources=[{"path": a, "weight": 3.0}, {"path": b, "weight": 1.0}]), tokenizer)
    first = [tokenizer.decode(x[:1]) for x in data.train["input_ids"][:200]]
    share_a = first.count("a") / len(first)
    assert 0.65 < share_a < 0.85  # 3:1 -> 0.75
    # all_exhausted: every example of the rarer source appears at least once
    assert sum(1 for x in data.train["input_ids"] if tokenizer.decode(x[:1]) == "b") >= 100


def test_eval_fraction_holds_out_and_collects_exact_match_examples(tmp_path, tokenizer):
    rows = [{"messages": [{"role": "user", "content": f"reverse: {c}"}, {"role": "assistant", "content": c}]}
            for c in "abcdefghij"]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = build_datasets(section(sources=[{"path": path}], eval_fraction=0.2), tokenizer, exact_match=5)
    assert len(data.train) == 8 and len(data.eval) == 2
    assert len(data.eval_examples) == 2
    ex = data.eval_examples[0]
    assert ex["messages"][-1]["role"] == "user" and ex["reference"] == ex["messages"][0]["content"][-1]


PACK_TEXTS = ["j i h g f e d c b a j i h g f e d c b a", "a b", "c d e f", "g", "h i j a b c d", "e f g h i j a"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_isolates_examples(tiny_model_dir, tokenizer, attn):
    """Packed rows (several examples per row, padding at the end of rows): every example's logits equal its logits
    alone, with the model as hftrain loads it for packing; transformers' default (use_cache=True creates a cache,
    which disables packed-mask detection) leaks."""
    from transformers import AutoModelForCausalLM

    from hftrain.modeling import load_model
    from hftrain.config import ModelSection

    model = load_model(ModelSection(name_or_path=tiny_model_dir, attn_implementation=attn), packing=True).train()
    exs = [tokenize_example({"messages": CHAT}, tokenizer, False)]
    exs += [tokenize_example({"text": t}, tokenizer, True) for t in PACK_TEXTS]
    lengths = [len(e["input_ids"]) for e in exs]
    batch = make_collator(tokenizer, packing=True)(exs)
    rows, width = batch["input_ids"].shape
    assert width == max(lengths) and rows < len(exs) and "attention_mask" not in batch
    # Find each example in the rows by its position_ids (a run 0..n-1 of its tokens), check its tokens and labels.
    pos = batch["position_ids"]
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=pos).logits
        stock = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).train()
        leaked = stock(input_ids=batch["input_ids"], position_ids=pos).logits
    found, shared_row, leaks = set(), False, []
    for r in range(rows):
        starts = (pos[r] == 0).nonzero().flatten().tolist() + [width]
        shared_row |= len(starts) > 2
        for a, b in zip(starts, starts[1:]):
            ids = batch["input_ids"][r, a:b].tolist()
            match = [i for i, e in enumerate(exs) if e["input_ids"] == ids and i not in found]
            if not match:  # the padding at the end of the row: never a target
                assert b == width and (batch["labels"][r, a:b] == IGNORE_INDEX).all()
                continue
            i = match[0]
            found.add(i)
            assert batch["labels"][r, a].item() == IGNORE_INDEX
            assert batch["labels"][r, a + 1:b].tolist() == exs[i]["labels"][1:]
            with torch.no_grad():
                alone = model(input_ids=torch.tensor([ids])).logits[0]
            within("data.packed_vs_alone.logits", packed[r, a:b], alone, label=f"{attn}: example {i}")
            if a > 0:
                leaks.append((leaked[r, a:b], alone))
    assert found == set(range(len(exs))) and shared_row  # every example once; some rows hold several
    # the test can see cross-contamination (the worst of the examples placed after another in their row)
    beyond("data.packed_vs_alone.logits", [x for x, _ in leaks], [y for _, y in leaks], label=f"{attn}: leaked")


def test_flash_attention_sees_packed_rows_as_one_row(tiny_model_dir, tokenizer):
    """Flash-attention kernels find packed sequences only in a one-row batch: load_model joins the rows for them.
    The join (tried here on sdpa, the flash kernels need a GPU) gives the logits of the rows, in rows."""
    from hftrain.modeling import join_packed_rows, load_model, reads_packing_from_one_row
    from hftrain.config import ModelSection

    assert (reads_packing_from_one_row("flash_attention_2")
            and reads_packing_from_one_row("kernels-community/flash-attn3"))
    assert not any(map(reads_packing_from_one_row, ("sdpa", "eager", "flex_attention", None)))
    model = load_model(ModelSection(name_or_path=tiny_model_dir, attn_implementation="sdpa"), packing=True).eval()
    batch = make_collator(tokenizer, packing=True)([tokenize_example({"text": t}, tokenizer, True) for t in PACK_TEXTS])
    assert batch["input_ids"].shape[0] > 1
    with torch.no_grad():
        rows = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        join_packed_rows(model)
        seen = []
        model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape), with_kwargs=True)
        joined = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    assert seen == [(1, batch["input_ids"].numel())]
    within("data.joined_vs_rows.logits", joined, rows)


def test_padding_collator_masks_padding(tokenizer):
    exs = [tokenize_example({"text": "a b c d"}, tokenizer, True), tokenize_example({"text": "a"}, tokenizer, True)]
    batch = make_collator(tokenizer, packing=False)(exs)
    n = len(exs[1]["input_ids"])
    assert batch["attention_mask"][1].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
    assert (batch["labels"][1, n:] == IGNORE_INDEX).all()


def test_chat_template_override_from_string_and_file(tmp_path, tiny_model_dir):
    from hftrain.modeling import ModelError, load_tokenizer
    from hftrain.config import ModelSection

    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    f = tmp_path / "t.jinja"
    f.write_text(template)
    for value in (template, str(f)):
        tok = load_tokenizer(ModelSection(name_or_path=tiny_model_dir), value)
        out = tokenize_example({"messages": CHAT}, tok, train_on_prompt=False)
        assert tok.decode(out["input_ids"]) == "user: reverse: a b c\nassistant: c b a\n"
        # " c" is one token straddling the prompt's trailing space: it is the answer's first token, so trained.
        assert trainable_text(tok, out) == " c b a\n"
    with pytest.raises(ModelError, match="data.chat_template: .*missing.jinja does not exist"):
        load_tokenizer(ModelSection(name_or_path=tiny_model_dir), str(tmp_path / "missing.jinja"))
