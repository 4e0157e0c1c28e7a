"""The docs point at what exists: README's links resolve, and every row of docs/features.md names recipe keys the
schema has, commands the CLI has, modules that exist and tests that are defined."""

import argparse
import dataclasses
import os
import re
import typing

import pytest
from transformers import TrainingArguments

from hftrain.cli import build_parser
from hftrain.config import sections
from hftrain.config.training import HFTrainOptions
from hftrain.methods import Recipe

from .conftest import REPO

FEATURES = os.path.join(REPO, "docs", "features.md")


def _rows():
    with open(FEATURES, encoding="utf-8") as fh:
        lines = [ln for ln in fh if ln.startswith("| ") and not ln.startswith("| Feature") and "---" not in ln]
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _section_keys() -> dict[str, set[str]]:
    """section -> the keys a recipe may set in it."""
    keys = {"training": _field_names(TrainingArguments) | _field_names(HFTrainOptions)}
    hints = typing.get_type_hints(Recipe)  # config's sections and the methods'
    for f in dataclasses.fields(Recipe):
        kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
        kind = next((t for t in kinds if isinstance(t, type) and dataclasses.is_dataclass(t)), None)
        if kind is not None:
            keys[f.name] = _field_names(kind)
    keys["data"] |= _field_names(sections.DataSource)  # data.sources' entries: data.columns etc. name those
    return keys


def _commands(parser: argparse.ArgumentParser, prefix=()) -> set[tuple[str, ...]]:
    out = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.add((*prefix, name))
                out |= _commands(sub, (*prefix, name))
    return out


def test_readme_links_resolve():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        links = set(re.findall(r"\]\(([^)#\s]+)", fh.read()))
    missing = [link for link in sorted(links) if "://" not in link and not os.path.exists(os.path.join(REPO, link))]
    assert not missing, missing


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r[0][:40])
def test_feature_row_names_what_exists(row):
    feature, keys, modules, tests = row
    problems = []
    section_keys = _section_keys()
    commands = _commands(build_parser())
    for key in re.findall(r"`([a-z_]+\.[a-z_]+)", keys):
        section, name = key.split(".")
        if name not in section_keys.get(section, ()):
            problems.append(f"recipe key {key}")
    for cmd in re.findall(r"`hftrain ([a-z-]+(?: [a-z-]+)?)", keys):
        words = tuple(cmd.split())
        if words not in commands and words[:1] not in commands:
            problems.append(f"command hftrain {cmd}")
    for path in re.findall(r"`(hftrain/[\w/.]*)`", modules):
        if not os.path.exists(os.path.join(REPO, path)):
            problems.append(f"module {path}")
    for path, name in re.findall(r"`(tests/\w+\.py)::(\w+)`", tests):
        file = os.path.join(REPO, path)
        if not os.path.exists(file) or not re.search(rf"^def {name}\(", open(file, encoding="utf-8").read(), re.M):
            problems.append(f"test {path}::{name}")
    assert re.search(r"`tests/\w+\.py::\w+`", tests), f"{feature}: no test named"
    assert not problems, f"{feature}: {problems}"


def test_no_page_holds_a_placeholder():
    """A figure still to be measured is not left as a marker line (MEASURED_BENCH, <!-- FIGURES -->) in a page."""
    found = []
    for page in sorted(os.listdir(os.path.join(REPO, "docs"))) + ["../README.md"]:
        with open(os.path.join(REPO, "docs", page), encoding="utf-8") as fh:
            found += [f"{page}:{i}: {ln.strip()}" for i, ln in enumerate(fh, 1)
                      if re.fullmatch(r"[A-Z][A-Z_]{5,}|<!--.*-->", ln.strip())]
    assert not found, found


def test_the_check_sees_a_missing_name(monkeypatch):
    """The row check is not vacuous: a renamed test, module or key in a row is reported."""
    row = ["x", "`data.packng`", "`hftrain/nope.py`", "`tests/test_loss.py::test_renamed`"]
    with pytest.raises(AssertionError) as e:
        test_feature_row_names_what_exists(row)
    assert "recipe key data.packng" in str(e.value) and "module hftrain/nope.py" in str(e.value)
    assert "test tests/test_loss.py::test_renamed" in str(e.value)


QWEN3_ROW = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning_content": "I should look it up.", "content": "It is sunny."},
    {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "reasoning_content": "Look again.", "content": "Rainy."},
    {"role": "user", "content": "Berlin?"},
    {"role": "assistant", "reasoning_content": "Once more.", "content": "Cloudy."}]}


def _doc_example(text: str, title: str) -> list[str]:
    """The indented block after the line that starts with `title` in a doc."""
    lines = text.split(title, 1)[1].split("\n\n", 1)[1].split("\n")
    block = []
    for line in lines:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    return [ln for ln in block if ln.strip()]


@pytest.mark.parametrize("turns", ["all", "last"])
def test_the_templates_doc_shows_what_hftrain_data_prints_for_a_qwen3_row(tmp_path, monkeypatch, capsys, turns):
    """docs/templates.md's examples are `hftrain data`'s output on a Qwen3 row of three reasoning turns (issue 43: what
    it reported did not match what the doc said), with a tokenizer trained on the row (token counts are its)."""
    import json

    import trl
    import yaml

    from hftrain.cli import main
    from hftrain.tiny import build_tiny_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.jsonl").write_text(json.dumps(QWEN3_ROW) + "\n")
    words = " ".join(m["content"] + " " + m.get("reasoning_content", "") for m in QWEN3_ROW["messages"])
    build_tiny_model("m", [words + " think"] * 30)
    template = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3.jinja")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({
        "model": {"name_or_path": "m"}, "data": {"sources": [{"path": "r.jsonl"}], "chat_template": template,
                                                 "max_length": 512, "train_turns": turns},
        "training": {"output_dir": "out"}}))
    capsys.readouterr()
    assert main(["data", "r.yaml", "--examples", "1"]) == 0
    printed = [ln for ln in capsys.readouterr().out.split("\n") if ln.strip()]
    with open(os.path.join(REPO, "docs", "templates.md"), encoding="utf-8") as fh:
        doc = fh.read()
    title = ("Example (`hftrain data` on a Qwen3 row with three turns and `reasoning_content`, data.train_turns: all"
             if turns == "all" else "The same row, data.train_turns: last")
    shown = _doc_example(doc, title)
    kept = [ln for ln in printed if not ln.lstrip().startswith(("statistics of", "tokens per example", "longer than"))]
    assert shown == kept[:len(shown)], "\n".join(kept)


GLM_ROW = {"messages": [
    {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "And Rome?"}, {"role": "assistant", "content": "Rainy."},
    {"role": "user", "content": "Berlin?"}, {"role": "assistant", "content": "Cloudy."}]}


def test_the_templates_doc_shows_glm_rows_train_their_stop_tokens(tmp_path, monkeypatch, capsys):
    """docs/templates.md's GLM-4.5 example is `hftrain data`'s output on a multi-turn row, with the GLM-4.5 chat
    template and a tokenizer saved alone (no generation_config.json beside it, issue 38): every turn is trained with
    the <|user|> that ends it, the last one too."""
    import json

    import yaml

    from hftrain.cli import main

    from .template_families import FAMILIES, tokenizer_for

    monkeypatch.chdir(tmp_path)
    tokenizer_for(FAMILIES["glm4moe_tokenizer_only"], "glm").save_pretrained("glm")
    assert not os.path.exists(os.path.join("glm", "generation_config.json"))
    (tmp_path / "glm.jsonl").write_text(json.dumps(GLM_ROW) + "\n")
    (tmp_path / "glm.yaml").write_text(yaml.safe_dump({
        "model": {"name_or_path": "glm"}, "data": {"sources": [{"path": "glm.jsonl"}], "max_length": 512},
        "training": {"output_dir": "out"}}))
    capsys.readouterr()
    assert main(["data", "glm.yaml", "--examples", "1"]) == 0
    printed = [ln for ln in capsys.readouterr().out.split("\n") if ln.strip()]
    with open(os.path.join(REPO, "docs", "templates.md"), encoding="utf-8") as fh:
        shown = _doc_example(fh.read(), "Example (`hftrain data glm.yaml --examples 1` on a GLM-4.5 row")
    kept = [ln for ln in printed if not ln.lstrip().startswith(("statistics of", "tokens per example", "longer than",
                                                                 "hftrain: warning"))]  # printed when not cached
    assert shown == kept[:len(shown)], "\n".join(kept)
    assert sum(ln.count("<|user|>]]") for ln in kept) == 3  # each turn's stop token trained, the last one appended
