"""Layouts and files: detection, the canonical form of each layout, column and role mappings, and bad rows refused
with the file and the row in the file's own numbering (JSONL line, JSON index, parquet/csv row), also after an
eval_fraction split."""

import json
import os
import typing

import datasets
import pytest
import yaml

from hftrain.cli import main as cli_main
from hftrain.config import DataSection, DataSource, RecipeError
from hftrain.methods import load_recipe
from hftrain.constants import DataLayout
from hftrain.data import build_datasets, detect_format, read_canonical, to_messages_or_text
from hftrain.data.layouts import LAYOUT_COLUMNS
from hftrain.errors import DataError
from hftrain.tiny import texts_of_data

from .conftest import REPO

EXAMPLES = os.path.join(REPO, "data", "examples")
KEY = "data.sources.0"
UNIT_TOOL = {"type": "function", "function": {
    "name": "unit_convert", "description": "Convert a quantity between units",
    "parameters": {"type": "object", "properties": {"value": {"type": "number"}, "from": {"type": "string"},
                                                    "to": {"type": "string"}}, "required": ["value", "from", "to"]}}}
FIRST = {  # the canonical form of each example file's first row
    "messages.jsonl": ("messages", {"messages": [
        {"role": "system", "content": "You convert units. Use the tool when a number is involved."},
        {"role": "user", "content": "How many kilometres is 26.2 miles?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {  # arguments as given
            "name": "unit_convert", "arguments": "{\"value\": 26.2, \"from\": \"mi\", \"to\": \"km\"}"}}]},
        {"role": "tool", "content": "42.16", "name": "unit_convert"},
        {"role": "assistant", "content": "26.2 miles is about 42.2 km."}], "tools": [UNIT_TOOL]}),
    "sharegpt.json": ("sharegpt", {"messages": [
        {"role": "user", "content": "What time is it in Tokyo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "local_time", "arguments": {"city": "Tokyo"}}}]},
        {"role": "tool", "content": "{\"time\": \"21:05\"}", "name": "local_time"},
        {"role": "assistant", "content": "It is 21:05 in Tokyo."}], "tools": [{"type": "function", "function": {
            "name": "local_time", "description": "Current local time of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}),
    "alpaca.jsonl": ("alpaca", {"messages": [
        {"role": "system", "content": "You are a terse editor."},
        {"role": "user", "content": "Fix: teh cat"}, {"role": "assistant", "content": "the cat"},
        {"role": "user", "content": "Fix: a apple"}, {"role": "assistant", "content": "an apple"},
        {"role": "user", "content": "Fix the spelling.\n\nrecieve"}, {"role": "assistant", "content": "receive"}]}),
    "prompt_completion.jsonl": ("prompt_completion", {"prompt": "2 + 3 =", "completion": " 5"}),
    "text.jsonl": ("text", {"text": "Tides rise and fall twice a day, pulled mostly by the Moon."}),
}


def section(*sources, **kw) -> DataSection:
    return DataSection(sources=[DataSource(**s) for s in sources], **kw)


def write_jsonl(path, rows, blank_first=False):
    path.write_text(("\n" if blank_first else "") + "".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat(user="hi", assistant="hello"):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


@pytest.mark.parametrize("name", sorted(FIRST))
def test_example_files_load_detect_and_canonicalise(name, tokenizer, capsys):
    path = os.path.join(EXAMPLES, name)
    layout, expected = FIRST[name]
    fmt, rows = read_canonical(DataSource(path=path), KEY, has_template=True)
    assert fmt == layout and 3 <= len(rows) <= 6
    assert rows[0][1] == expected
    assert f"hftrain: {KEY} ({path}): layout {layout}, {len(rows)} rows" in capsys.readouterr().err
    data = build_datasets(section({"path": path}), tokenizer)  # and they train: rendered, tokenised, trainable
    assert len(data.train) == len(rows)


def test_detection_order_and_every_layout_has_columns():
    assert tuple(LAYOUT_COLUMNS) == typing.get_args(DataLayout)
    assert detect_format(["conversations", "system", "tools"]) == "sharegpt"
    assert detect_format(["messages", "tools"]) == "messages"
    assert detect_format(["instruction", "input", "output", "history"]) == "alpaca"
    assert detect_format(["prompt", "completion", "text"]) == "prompt_completion"
    assert detect_format(["text", "id"]) == "text"
    assert detect_format(["question", "answer"]) is None


def test_content_parts_arguments_reasoning_and_tools_are_canonicalised_as_given():
    """Content parts stay parts, arguments stay JSON text or an object, the call's id stays (render.py hands each
    template the forms it reads); reasoning under any usual spelling is reasoning_content; bare tools are wrapped."""
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a "}, {"text": "b"}]},
        {"role": "assistant", "content": None, "thinking": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": [1, 2]}"}},
            {"name": "g", "arguments": {"y": 1}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "assistant", "content": "done", "reasoning": "sure", "tool_calls": None, "name": None}],  # nulls
        "tools": "[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}, {\"name\": \"g\"}]"}
    assert to_messages_or_text(row, "messages", has_template=True) == {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "f", "arguments": "{\"x\": [1, 2]}"}},
            {"type": "function", "function": {"name": "g", "arguments": {"y": 1}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
        {"role": "assistant", "content": "done", "reasoning_content": "sure"}],
        "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]}
    assert "tools" not in to_messages_or_text(chat(), "messages", has_template=True)  # no tools column, no key
    both = {"messages": [MSG, {"role": "assistant", "content": "x", "reasoning": "a", "thinking": "b"}]}
    with pytest.raises(DataError, match=r"messages\[1\] has reasoning under \['reasoning', 'thinking'\]; keep one"):
        to_messages_or_text(both, "messages", has_template=True)


def test_reasoning_field_mapped_by_columns(tmp_path):
    rows = [{"messages": [MSG, {"role": "assistant", "content": "x", "cot": "because"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    _, out = read_canonical(DataSource(path=path, columns={"reasoning_content": "cot"}), KEY, True)
    assert out[0][1]["messages"][1] == {"role": "assistant", "content": "x", "reasoning_content": "because"}
    with pytest.raises(DataError, match=rf"{KEY}.columns: no message of \S+ has the field\(s\) \['chain'\] "
                                        r"\(reasoning_content: chain\)"):
        read_canonical(DataSource(path=path, columns={"reasoning_content": "chain"}), KEY, True)


def test_alpaca_history_without_a_template_is_one_prompt():
    row = {"system": "S", "history": [["u1", "a1"]], "instruction": "i", "input": "x", "output": "o"}
    assert to_messages_or_text(row, "alpaca", has_template=False) == {
        "prompt": "S\n\n### Instruction:\nu1\n\n### Response:\na1\n\n### Instruction:\ni\n\n### Input:\nx\n\n"
                  "### Response:\n", "completion": "o"}


def test_column_and_role_mappings(tmp_path):
    rows = [{"dialog": [{"from": "customer", "value": "hi"}, {"from": "bot", "value": "hello"}], "id": 1}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    src = {"path": path, "columns": {"conversations": "dialog"}}
    with pytest.raises(DataError, match=rf"{KEY}: \S*d.jsonl:1: conversations\[0\]: unknown role 'customer'; map it "
                                        rf"with {KEY}.roles"):
        read_canonical(DataSource(**src), KEY, True)
    fmt, out = read_canonical(DataSource(**src, roles={"customer": "user", "bot": "assistant"}), KEY, True)
    assert fmt == "sharegpt"
    assert out[0][1] == {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    # the same mapping on OpenAI-style messages
    path = write_jsonl(tmp_path / "m.jsonl", [{"chat": [{"role": "customer", "content": "hi"},
                                                        {"role": "agent", "content": "yo"}]}])
    fmt, out = read_canonical(DataSource(path=path, columns={"messages": "chat"},
                                         roles={"customer": "user", "agent": "assistant"}), KEY, True)
    assert fmt == "messages" and [m["role"] for m in out[0][1]["messages"]] == ["user", "assistant"]
    # ShareGPT turns mapped to `messages` by columns keep ShareGPT's role names; `roles` still wins
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "human", "value": "hi"},
                                                                 {"from": "gpt", "value": "yo"}]}])
    fmt, out = read_canonical(DataSource(path=path, columns={"messages": "conversations"}, roles={"gpt": "system"}),
                              KEY, True)
    assert fmt == "messages" and [m["role"] for m in out[0][1]["messages"]] == ["user", "system"]


def test_roles_mapping_targets_are_validated(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"sources": [
        {"path": "d.jsonl", "roles": {"bot": "assistant", "human": "person"}}]}}))
    with pytest.raises(RecipeError) as e:
        load_recipe(str(recipe))
    assert "data.sources.0.roles.human: unknown role 'person': map human to one of system, user, assistant, tool" \
        in str(e.value)
    assert "roles.bot" not in str(e.value)


def test_rows_are_named_in_each_file_types_numbering(tmp_path):
    rows = [{"text": "a"}, {"text": "b"}, {"text": 5}, {"text": "d"}]
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=1))
    write_jsonl(tmp_path / "d.jsonl", rows, blank_first=True)  # line 4: the blank line counts
    cases = {"d.json": r"d.json index 2", "d.jsonl": r"d.jsonl:4"}
    for name, where in cases.items():
        with pytest.raises(DataError, match=rf"{KEY}: \S*{where}: text is a number \(5\) where text is expected; "
                                            r"quote it"):
            build_datasets(section({"path": str(tmp_path / name)}), None)
    table = datasets.Dataset.from_list([{"text": "a"}, {"text": "b"}, {"text": None}])
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    for name in ("d.parquet", "d.csv"):
        with pytest.raises(DataError, match=rf"{name} row 2: text is null where text is expected"):
            read_canonical(DataSource(path=str(tmp_path / name)), KEY, True)


def test_json_array_of_non_objects_and_a_json_object_file(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": "a"}, "b"]))
    with pytest.raises(DataError, match=r"a.json index 1: a row must be a JSON object"):
        read_canonical(DataSource(path=str(tmp_path / "a.json")), KEY, True)
    (tmp_path / "b.json").write_text(json.dumps({"text": "one row"}))  # a single object reads as one JSON line
    assert read_canonical(DataSource(path=str(tmp_path / "b.json")), KEY, True)[1] == [
        (str(tmp_path / "b.json") + ":1", {"text": "one row"})]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_original_row_named_after_eval_fraction(tmp_path, tokenizer, seed):
    rows = [chat(f"q{i}", f"a{i}") for i in range(10)]
    rows[6] = {"messages": [{"role": "user", "content": "no answer"}]}  # line 7: nothing to train on
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"1 of \d examples of \S+ have no trainable token \(\S*d.jsonl:7\)"):
        build_datasets(section({"path": path}, eval_fraction=0.3), tokenizer, seed=seed)
    ok = build_datasets(section({"path": path}, eval_fraction=0.3, skip_untrainable=True), tokenizer, seed=seed)
    assert set(ok.train.column_names) == {"input_ids", "labels"} == set(ok.eval.column_names)
    assert len(ok.train) + len(ok.eval) == 9


MSG = {"role": "user", "content": "hi"}
BAD_ROWS = [
    ("number_content", {"messages": [{"role": "user", "content": 7}]},
     r"messages\[0\].content is a number \(7\) where text is expected"),
    ("null_prompt", {"prompt": None, "completion": "c"}, r"prompt is null where text is expected"),
    ("null_completion", {"prompt": "p", "completion": None}, r"completion is null where text is expected"),
    ("string_messages", {"messages": "[{\"role\": \"user\"}]"}, r"'messages' is a string, not a list of messages"),
    ("empty_messages", {"messages": []}, r"empty conversation \('messages' is \[\]\)"),
    ("empty_sharegpt", {"conversations": []}, r"empty conversation \('conversations' is \[\]\)"),
    ("no_role", {"messages": [{"content": "x"}]}, r"messages\[0\] has no role"),
    ("no_content", {"messages": [MSG, {"role": "assistant"}]}, r"messages\[1\] \(assistant\) has no content"),
    ("unknown_role", {"messages": [{"role": "bot", "content": "x"}]},
     rf"messages\[0\]: unknown role 'bot'; map it with {KEY}.roles \(e.g. {{bot: assistant}}\)"),
    ("function_call_not_json", {"conversations": [{"from": "human", "value": "t?"},
                                                  {"from": "function_call", "value": "clock(Tokyo)"}]},
     r"conversations\[1\] is a function_call whose value is not JSON"),
    ("arguments_not_json", {"messages": [MSG, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "x=1"}}]}]},
     r"messages\[1\].tool_calls\[0\].arguments is a string that is not JSON"),
    ("image_part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
     r"messages\[0\].content\[0\] is not a text part"),
    ("bad_history", {"instruction": "i", "output": "o", "history": [["only one"]]},
     r"history\[0\] is \[\"only one\"\]; each turn before the last is a \[user, assistant\] pair"),
]


@pytest.mark.parametrize("name,bad,message", BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
def test_bad_rows_are_refused_with_file_and_row(tmp_path, name, bad, message):
    good = {"prompt": "p", "completion": "c"} if "prompt" in bad else {
        "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]} if "conversations" in bad \
        else {"instruction": "i", "output": "o"} if "instruction" in bad else chat()
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, bad])
    with pytest.raises(DataError, match=rf"^{KEY}: \S*d.jsonl:3: {message}"):
        read_canonical(DataSource(path=path), KEY, True)


def test_mixed_layouts_in_one_file_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(), {"text": "plain"}])
    with pytest.raises(DataError, match=rf"{KEY}: \S*d.jsonl:2: mixed layouts: this row is text \(columns \['text'\]\),"
                                        r" the source is messages; put each layout in a source of its own"):
        read_canonical(DataSource(path=path), KEY, True)
    (tmp_path / "m.json").write_text(json.dumps([{"prompt": "p", "completion": "c"}, chat()]))
    with pytest.raises(DataError, match=r"m.json index 0: mixed layouts: this row is prompt_completion"):
        read_canonical(DataSource(path=str(tmp_path / "m.json")), KEY, True)


def test_tiny_model_reads_a_json_array_and_sharegpt(tmp_path, capsys):
    array = tmp_path / "chats.json"
    array.write_text(json.dumps([chat("zebra crossing", "quokka"), chat("x", "y")]))
    sharegpt = os.path.join(EXAMPLES, "sharegpt.json")
    texts = texts_of_data([str(array), sharegpt])
    assert {"zebra crossing", "quokka", "What time is it in Tokyo?", "local_time", "Tokyo"} <= set(texts)
    out = tmp_path / "tiny"
    assert cli_main(["tiny-model", "--data", str(array), sharegpt, "--output", str(out), "--vocab-size", "300",
                     "--config", json.dumps({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                             "num_attention_heads": 2, "num_key_value_heads": 1})]) == 0
    assert "layout sharegpt, 3 rows" in capsys.readouterr().err and (out / "tokenizer.json").exists()
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"question": "why", "answer": "because"}])  # no layout: all strings
    assert texts_of_data([qa]) == ["why", "because"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([chat(), {"messages": []}]))
    with pytest.raises(DataError, match=r"--data \S+bad.json: \S+bad.json index 1: empty conversation"):
        texts_of_data([str(bad)])


def test_tiny_model_with_a_chat_template_learns_its_text_and_renders_with_it(tmp_path):
    """--chat-template: the tokenizer carries the template, and its fixed text (Qwen2.5's tool-calling system prompt)
    trained the vocabulary, so a rendered conversation with tools is less than half the tokens it is with ChatML's
    vocabulary; an unknown TRL template is refused naming the option."""
    from transformers import AutoTokenizer

    sharegpt = os.path.join(EXAMPLES, "sharegpt.json")
    small = json.dumps({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                        "num_key_value_heads": 1})
    for name, extra in (("plain", []), ("qwen", ["--chat-template", "trl:qwen2_5"])):
        assert cli_main(["tiny-model", "--data", sharegpt, "--output", str(tmp_path / name), "--vocab-size", "1000",
                         "--config", small, *extra]) == 0
    plain, qwen = (AutoTokenizer.from_pretrained(str(tmp_path / n)) for n in ("plain", "qwen"))
    conversation = texts_of_data([sharegpt])  # any strings of the data: the template's text is what differs
    tools = [{"type": "function", "function": {"name": "local_time", "description": "time",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": conversation[0]}]
    rendered = qwen.apply_chat_template(messages, tools=tools, tokenize=False)
    assert "You may call one or more functions" in rendered  # the tokenizer's template is Qwen2.5's
    plain.chat_template = qwen.chat_template
    ids = qwen.apply_chat_template(messages, tools=tools, return_dict=True)["input_ids"]
    ids_plain = plain.apply_chat_template(messages, tools=tools, return_dict=True)["input_ids"]
    assert 2 * len(ids) < len(ids_plain), (len(ids), len(ids_plain))
    with pytest.raises(SystemExit):
        cli_main(["tiny-model", "--data", sharegpt, "--output", str(tmp_path / "x"), "--chat-template", "trl:nope"])
