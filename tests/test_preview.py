"""`hftrain data`: the trained tokens are shown exactly where the labels are, and the counts are the pipeline's."""

import json

from hftrain.cli import main
from hftrain.config import DataSection, DataSource
from hftrain.constants import IGNORE_INDEX
from hftrain.data import tokenize_example
from hftrain.data.preview import marked, preview

from .template_families import FAMILIES, tokenizer_for

MSGS = [{"role": "user", "content": "reverse: a b"}, {"role": "assistant", "content": "b a"}]


def test_marked_text_brackets_exactly_the_labelled_tokens(tokenizer):
    out = tokenize_example({"messages": MSGS}, tokenizer, train_on_prompt=False)
    text = marked(tokenizer, out["input_ids"], out["labels"])
    assert text == "<|im_start|>user\nreverse: a b<|im_end|>\n<|im_start|>assistant\n[[b a<|im_end|>]]\n"
    trained = text[text.index("[[") + 2:text.index("]]")]
    assert trained == tokenizer.decode([t for t in out["labels"] if t != IGNORE_INDEX])
    assert "[[" not in marked(tokenizer, out["input_ids"], [IGNORE_INDEX] * len(out["labels"]))


def test_preview_counts_cut_and_untrainable_rows(tmp_path, tokenizer):
    rows = [{"messages": MSGS}, {"messages": [MSGS[0], {"role": "assistant", "content": "b a " * 40}]}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = preview(DataSection(sources=[DataSource(path=str(path))], max_length=24), tokenizer, examples=1)
    assert f"data.sources.0 ({path}): layout messages, 2 rows" in report
    assert "longer than data.max_length=24: 1 (cut at 24); left with no trained token: 0" in report
    assert f"--- {path}:1:" in report and f"{path}:2:" not in report  # one example shown, named by its line


def test_cli_data_prints_the_report(tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": MSGS}) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({"model": {"name_or_path": tiny_model_dir}, "data": {"sources": [{"path": str(path)}]},
                                  "training": {"output_dir": str(tmp_path / "out")}}))
    assert main(["data", str(recipe), "--examples", "1"]) == 0
    out = capsys.readouterr().out
    assert "layout messages, 1 rows" in out and "[[b a<|im_end|>" in out


def test_a_multi_turn_qwen3_reasoning_conversation_trains_every_turn(tmp_path):
    """Qwen3 drops the reasoning of turns before the last user query: the row becomes one example per turn, each
    trained with its reasoning, and the report says so (issue 27)."""
    tok = tokenizer_for(FAMILIES["qwen3"], str(tmp_path / "qwen3"))
    turns = [("Weather in Paris?", "I should look it up.", "It is sunny."), ("And tomorrow?", "Clouds.", "Rain.")]
    msgs = [m for user, thought, answer in turns for m in (
        {"role": "user", "content": user}, {"role": "assistant", "content": answer, "reasoning_content": thought})]
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    report = preview(DataSection(sources=[DataSource(path=str(path))]), tok, examples=1)
    assert "layout messages, 1 rows -> 2 examples (1 rows split: their template rewrites earlier turns" in report
    assert "writes assistant message(s) 1 differently once later messages follow" in report
    assert "example 1 of 2, trains message(s) [1]" in report and "example 2 of 2, trains message(s) [3]" in report
    for thought, answer in (("I should look it up.", "It is sunny."), ("Clouds.", "Rain.")):
        assert f"<|im_start|>assistant\n[[<think>\n{thought}\n</think>\n\n{answer}<|im_end|>]]\n" in report
    last = preview(DataSection(sources=[DataSource(path=str(path))], train_turns="last"), tok, examples=1)
    assert "layout messages, 1 rows\n" in last and "[[<think>\nI should" not in last
