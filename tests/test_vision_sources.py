"""A data source's keys on an image recipe (issue 58): `columns`, `roles`, `format` and `weight` honoured as the text
sources honour them (the text side's own code: data/layouts.py source_layout, data/build.py mix); what image rows
cannot read (a text-only layout, a column or role they have no place for) refused by `hftrain check` and the run
alike (exit 2), for data.sources and data.eval_sources, all at once."""

from __future__ import annotations

import pytest

from hftrain.config import DataSection, DataSource
from hftrain.errors import DataError
from hftrain.vision.image_datasets import build_image_datasets
from hftrain.vision.processor import load_processor

from .test_vision import PROCESSORS, _examples, _write, image_dir, marker_rows, refusals_of_check_and_run  # noqa: F401
from .test_vision import part_rows, vlm_dirs  # noqa: F401
from .test_vision_sharegpt import sharegpt_rows


def _built(folder, family, *sources: DataSource):
    processor = load_processor(folder, PROCESSORS[family])
    return build_image_datasets(DataSection(sources=list(sources)), processor, seed=0)


def _renamed(rows, **names):
    return [{names.get(k, k): v for k, v in r.items()} for r in rows]


def test_columns_rename_the_messages_and_images_columns(vlm_dirs, image_dir):  # noqa: F811
    _, plain = _examples(vlm_dirs["llava"], "llava", _write(image_dir / "marked.jsonl", marker_rows()))
    theirs = _write(image_dir / "theirs.jsonl", _renamed(marker_rows(), messages="dialogue", images="pics"))
    mapped = _built(vlm_dirs["llava"], "llava",
                    DataSource(path=theirs, columns={"messages": "dialogue", "images": "pics"}))
    assert mapped.train[:] == plain.train[:]


def test_columns_rename_sharegpt_conversations_and_system(vlm_dirs, image_dir):  # noqa: F811
    _, plain = _examples(vlm_dirs["llava"], "llava", _write(image_dir / "s.jsonl", sharegpt_rows("you name colours")))
    theirs = _write(image_dir / "theirs.jsonl",
                    _renamed(sharegpt_rows("you name colours"), conversations="turns", system="preamble"))
    mapped = _built(vlm_dirs["llava"], "llava",
                    DataSource(path=theirs, columns={"conversations": "turns", "system": "preamble"}))
    assert mapped.train[:] == plain.train[:]


def test_a_mapped_column_the_file_lacks_is_named(vlm_dirs, image_dir):  # noqa: F811
    path = _write(image_dir / "marked.jsonl", marker_rows())
    with pytest.raises(DataError, match=r"data.sources.0.columns: \['dialogue'\] not in"):
        _built(vlm_dirs["llava"], "llava", DataSource(path=path, columns={"messages": "dialogue"}))


def test_roles_map_message_roles_and_sharegpt_from_values(vlm_dirs, image_dir):  # noqa: F811
    _, plain = _examples(vlm_dirs["llava"], "llava", _write(image_dir / "marked.jsonl", marker_rows()))
    said = {"user": "customer", "assistant": "agent"}
    rows = [dict(r, messages=[dict(m, role=said[m["role"]]) for m in r["messages"]]) for r in marker_rows()]
    mapped = _built(vlm_dirs["llava"], "llava", DataSource(path=_write(image_dir / "roles.jsonl", rows),
                                                           roles={"customer": "user", "agent": "assistant"}))
    assert mapped.train[:] == plain.train[:]
    said = {"human": "asker", "gpt": "answerer"}
    shared = [dict(r, conversations=[dict(t, **{"from": said[t["from"]]}) for t in r["conversations"]])
              for r in sharegpt_rows()]
    mapped = _built(vlm_dirs["llava"], "llava", DataSource(path=_write(image_dir / "from.jsonl", shared),
                                                           roles={"asker": "user", "answerer": "assistant"}))
    assert mapped.train[:] == plain.train[:]


def test_format_selects_the_layout(vlm_dirs, image_dir):  # noqa: F811
    path = _write(image_dir / "sharegpt.jsonl", sharegpt_rows())
    with pytest.raises(DataError, match=r"data.sources.0: format 'messages' needs column\(s\) \['messages'\]"):
        _built(vlm_dirs["llava"], "llava", DataSource(path=path, format="messages"))
    _, plain = _examples(vlm_dirs["llava"], "llava", path)
    assert _built(vlm_dirs["llava"], "llava", DataSource(path=path, format="sharegpt")).train[:] == plain.train[:]


def test_a_source_of_a_text_layout_is_named(vlm_dirs, image_dir):  # noqa: F811
    path = _write(image_dir / "pc.jsonl", [{"prompt": "what colour", "completion": "red"}])
    with pytest.raises(DataError, match=r"data.sources.0: .*pc.jsonl is prompt_completion rows; image rows are "):
        _built(vlm_dirs["llava"], "llava", DataSource(path=path))


def test_weights_mix_the_sources_as_text_sources_mix(vlm_dirs, image_dir):  # noqa: F811
    from hftrain.data import mix

    one = _write(image_dir / "one.jsonl", marker_rows()[:1])
    two = _write(image_dir / "two.jsonl", marker_rows()[1:])
    alone = [_built(vlm_dirs["llava"], "llava", DataSource(path=p)).train for p in (one, two)]
    mixed = _built(vlm_dirs["llava"], "llava", DataSource(path=one, weight=1.0), DataSource(path=two, weight=4.0))
    assert mixed.train[:] == mix(alone, [1.0, 4.0], 0)[:]
    assert len(mixed.train) > 2  # the heavier source drawn again, as interleave_datasets draws it


def test_keys_image_rows_cannot_read_are_refused_by_check_and_the_run(vlm_dirs, tmp_path, capsys,  # noqa: F811
                                                                      monkeypatch):
    def spoil(tree):
        path = tree["data"]["sources"][0]["path"]
        tree["data"]["sources"][0].update(format="prompt_completion", columns={"prompt": "question"})
        tree["data"].pop("eval_fraction")
        tree["data"]["eval_sources"] = [{"path": path, "columns": {"reasoning_content": "cot"},
                                         "roles": {"obs": "tool"}}]

    checked, ran = refusals_of_check_and_run(tmp_path, vlm_dirs["llava"], spoil, capsys, monkeypatch)
    assert checked == ran
    for said in ["data.sources.0.format: image rows are conversations",
                 "data.sources.0.columns.prompt: image rows read only",
                 "data.eval_sources.0.columns.reasoning_content: image rows read only",
                 "data.eval_sources.0.roles.obs: image rows have no tool turns"]:
        assert said in checked, checked


def test_train_turns_last_trains_the_last_assistant_turn_only(vlm_dirs, image_dir):  # noqa: F811
    path = _write(image_dir / "marked.jsonl", marker_rows())
    processor, every = _examples(vlm_dirs["llava"], "llava", path)
    _, last = _examples(vlm_dirs["llava"], "llava", path, train_turns="last")
    trained = [[t for t, lab in zip(e["input_ids"], e["labels"]) if lab != -100]
               for e in (every.train[1], last.train[1])]
    words = [processor.tokenizer.decode(t) for t in trained]
    assert "blue" in words[0] and "green" in words[0], words
    assert "blue" not in words[1] and "green" in words[1], words
    assert every.train[1]["input_ids"] == last.train[1]["input_ids"]


def test_data_keys_image_rows_do_not_use_are_refused_by_check_and_the_run(vlm_dirs, tmp_path, capsys,  # noqa: F811
                                                                            monkeypatch):
    keys = {"chat_template": "trl:qwen2_5", "completion_only_loss": False, "num_proc": 2}
    checked, ran = refusals_of_check_and_run(tmp_path, vlm_dirs["qwen2_5_vl"], lambda tree: tree["data"].update(keys),
                                             capsys, monkeypatch)
    assert checked == ran
    for said in ["data.chat_template: an image-text-to-text recipe renders with its processor's chat template",
                 "data.completion_only_loss: applies to prompt/completion rows",
                 "data.num_proc: image rows are read and their images checked in one process"]:
        assert said in checked, checked


@pytest.mark.parametrize("spoil, said", [
    (lambda r: r["messages"][1].update(reasoning_content="red, since the square is red"),
     r"\(.*:1\): messages\[1\] has reasoning_content: image rows carry a turn's role and content only"),
    (lambda r: r.update(tools=[{"type": "function", "function": {"name": "zoom"}}]), r"\(.*:1\): the row has tools"),
])
def test_a_message_field_image_rows_would_drop_is_an_error(vlm_dirs, image_dir, spoil, said):  # noqa: F811
    rows = part_rows()
    spoil(rows[0])
    rows[1]["messages"][1]["reasoning_content"] = ""  # empty, as a column other rows fill: passes
    with pytest.raises(DataError, match=said):
        _examples(vlm_dirs["llava"], "llava", _write(image_dir / "fields.jsonl", rows))
