"""Prepared data: rows read into the datasets cache once per content and memory-mapped, the tokenised cache keyed on
the files and the settings, prepared by one process while the others wait; every format bounded per row and text
cut before tokenisation (issue #33 point 7); BOM, blank files and folders mixing layouts (point 8)."""

import json
import os

import datasets
import pytest

from hftrain.config import DataSection, DataSource
from hftrain.data import build_datasets, tokenize_example
from hftrain.data import rows as rows_module
from hftrain.data import sources as sources_module
from hftrain.data.rows import char_bound
from hftrain.errors import DataError

from .conftest import PY, run

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data_share_worker.py")


def write_jsonl(path, rows, prefix=b""):
    path.write_bytes(prefix + "".join(json.dumps(r) + "\n" for r in rows).encode())
    return str(path)


def section(*paths, **kw) -> DataSection:
    return DataSection(sources=[DataSource(path=str(p)) for p in paths], **kw)


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    cache = tmp_path / "dscache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    return cache


@pytest.fixture
def counted(monkeypatch):
    """How many times the JSON rows were read into the cache, and rows were tokenised."""
    seen = {"read": 0, "tokenised": 0}
    read, tokenise = sources_module._write_json_rows, rows_module.RowExamples.__call__

    def counting_read(*a):
        seen["read"] += 1
        return read(*a)

    def counting_tokenise(self, batch, indices):
        seen["tokenised"] += len(indices)
        return tokenise(self, batch, indices)

    monkeypatch.setattr(sources_module, "_write_json_rows", counting_read)
    monkeypatch.setattr(rows_module.RowExamples, "__call__", counting_tokenise)
    return seen


def texts(tokenizer, ds) -> list[str]:
    return [tokenizer.decode(x) for x in ds["input_ids"]]


def test_an_unchanged_file_is_not_read_again_a_changed_one_is(tmp_path, tokenizer, own_cache, counted, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"a {i}"} for i in range(5)])
    first = build_datasets(section(path), tokenizer)
    assert counted == {"read": 1, "tokenised": 5}
    mapped = []
    from_file = datasets.Dataset.from_file
    monkeypatch.setattr(datasets.Dataset, "from_file", lambda f, *a, **k: mapped.append(f) or from_file(f, *a, **k))
    again = build_datasets(section(path), tokenizer)
    assert counted == {"read": 1, "tokenised": 5}  # found by name: nothing read, nothing tokenised
    assert [os.path.basename(f).split("-")[0] for f in mapped] == ["tokens"]  # only the examples are mapped
    assert texts(tokenizer, again.train) == texts(tokenizer, first.train)
    assert all(f["filename"].startswith(str(own_cache)) for f in again.train.cache_files)  # memory-mapped

    build_datasets(section(path, max_length=8), tokenizer)  # another setting: tokenised anew from the same rows
    assert counted == {"read": 1, "tokenised": 10}
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"b {i}"} for i in range(5)])  # same size, new content and mtime
    changed = build_datasets(section(path), tokenizer)
    assert counted == {"read": 2, "tokenised": 15}
    assert texts(tokenizer, changed.train)[0].startswith("b 0")


def test_a_changed_chat_template_is_tokenised_anew(tmp_path, tiny_model_dir, own_cache, counted):
    from hftrain.config import ModelSection
    from hftrain.modeling import load_tokenizer

    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [chat] * 3)
    build_datasets(section(path), load_tokenizer(ModelSection(name_or_path=tiny_model_dir)))
    other = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")
    tok = load_tokenizer(ModelSection(name_or_path=tiny_model_dir), other)
    data = build_datasets(section(path), tok)
    assert counted == {"read": 1, "tokenised": 6}
    assert tok.decode(data.train[0]["input_ids"]) == "user: hi\nassistant: yo\n"


def test_a_moved_model_finds_its_cache_an_edited_tokenizer_does_not(tmp_path, tiny_model_dir, own_cache, counted):
    """The cache key is the tokenizer's content, not the folder it was loaded from (datasets' Hasher of the tokenizer
    pickles its name_or_path: every copy of a model tokenised every source again)."""
    import shutil

    from hftrain.config import ModelSection
    from hftrain.modeling import load_tokenizer

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"a {i}"} for i in range(5)])
    build_datasets(section(path), load_tokenizer(ModelSection(name_or_path=tiny_model_dir)))
    moved = shutil.copytree(tiny_model_dir, tmp_path / "moved")
    tok = load_tokenizer(ModelSection(name_or_path=str(moved)))
    build_datasets(section(path), tok)
    assert counted == {"read": 1, "tokenised": 5} and tok.name_or_path == str(moved)  # found; the original untouched
    tok.add_tokens(["<new>"])  # the same folder, another vocabulary: tokenised anew
    build_datasets(section(path), tok)
    assert counted == {"read": 1, "tokenised": 10}


def test_rows_are_kept_as_indices_and_named_on_demand(tmp_path, tokenizer, own_cache):
    """After an eval split, a row that trains on nothing is still named by its line (the row index is a column,
    its name is made for the message)."""
    rows = [{"prompt": "p", "completion": "c"}] * 9 + [{"prompt": "a " * 40, "completion": "b"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"no trainable token \(\S*d.jsonl:10\)"):
        for seed in range(20):  # some seed keeps row 10 in training
            build_datasets(section(path, max_length=16, eval_fraction=0.2), tokenizer, seed=seed)
    with pytest.raises(DataError, match=r"data.eval_fraction: 0.99 of the 10 rows of data.sources.0 .* leaves no row "
                                        r"to train on"):
        build_datasets(section(path, eval_fraction=0.99), tokenizer)


# -- issue #33 point 7: every format bounded per row; text cut before tokenisation ---------------------------------

BIG = "x" * (9 << 20)


@pytest.mark.parametrize("kind", ["csv", "parquet", "json array"])
def test_every_format_refuses_a_row_over_the_cap_naming_it(tmp_path, tokenizer, own_cache, kind):
    rows = [{"text": "small"}, {"text": BIG}]
    if kind == "json array":
        path = tmp_path / "a.json"
        path.write_text(json.dumps(rows))
        where = "a.json index 1"
    else:
        path = tmp_path / f"d.{kind}"
        ds = datasets.Dataset.from_list(rows)
        ds.to_csv(str(path), index=False) if kind == "csv" else ds.to_parquet(str(path))
        where = f"d.{kind} row 1"
    with pytest.raises(DataError, match=rf"data.sources.0.path: \S*{where}: a row of more than 8 MiB"):
        build_datasets(section(path), tokenizer)


def test_a_json_array_is_read_an_element_at_a_time(tmp_path, monkeypatch):
    """The array is split as it is read: no read of more than a window, elements named by index, lines right."""
    from hftrain.data import jsonrows

    monkeypatch.setattr(jsonrows, "CHUNK", 64)
    path = tmp_path / "a.json"
    rows = [{"text": f"row {i}", "tools": [{"a": i}]} for i in range(40)]
    path.write_text("[\n" + ",\n".join(json.dumps(r, indent=1) for r in rows) + "\n]\n")
    got = list(jsonrows.array_rows(str(path), "k"))
    assert [(i, json.loads(t)) for i, t, _ in got] == list(enumerate(rows))
    path.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows[:30]) + ",\n{\"text\": }\n]")
    with pytest.raises(DataError, match=r"a.json:32: malformed JSON"):
        list(jsonrows.array_rows(str(path), "k"))


def test_text_is_cut_before_tokenisation_and_the_tokens_kept_are_the_same(tmp_path, tokenizer, own_cache,
                                                                          monkeypatch):
    """A 300 kB cell with max_length 64: the tokenizer never sees more than the bound per field (memory: a 5 MB cell
    cost 1.4 GB before), and the examples equal the uncut text's, tokenised whole then truncated."""
    import random

    rng = random.Random(0)
    words = ["reverse", "a", "b", "c", "the", "cat", "ab", "cab", "  ", "\n"]
    long = "".join(rng.choice(words) + " " for _ in range(80_000))[:300_000]
    rows = [{"prompt": long, "completion": " a b"}, {"prompt": "reverse: a", "completion": long},
            {"text": long}, {"messages": [{"role": "user", "content": "hi " + long},
                                          {"role": "assistant", "content": long}]}]
    seen = []
    call = type(tokenizer).__call__

    def spy(self, text, *a, **kw):
        seen.append(len(text) if isinstance(text, str) else 0)
        return call(self, text, *a, **kw)

    for i, row in enumerate(rows):
        path = tmp_path / f"d{i}.parquet"
        datasets.Dataset.from_list([row]).to_parquet(str(path))
        monkeypatch.setattr(type(tokenizer), "__call__", spy)
        got = build_datasets(section(path, max_length=64, assistant_only_loss=False, completion_only_loss=False),
                             tokenizer).train[0]
        monkeypatch.setattr(type(tokenizer), "__call__", call)
        assert max(seen) < 3 * char_bound(tokenizer, 64) < 10_000, max(seen)  # two fields and the template
        seen.clear()
        whole = tokenize_example(row, tokenizer, train_on_prompt=True)
        assert got["input_ids"] == whole["input_ids"][:64] and got["labels"] == whole["labels"][:64]


# -- issue #33 point 8 -----------------------------------------------------------------------------------------------

def test_a_byte_order_mark_is_read_in_json_lines_and_arrays(tmp_path, tokenizer, own_cache):
    bom = b"\xef\xbb\xbf"
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "first"}, {"text": "second"}], prefix=bom)
    b = tmp_path / "b.json"
    b.write_bytes(bom + json.dumps([{"text": "first"}]).encode())
    for path in (a, b):
        assert texts(tokenizer, build_datasets(section(path), tokenizer).train)[0] == "first<|im_end|>"


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.csv", "d.parquet"])
def test_a_file_of_blanks_is_reported_empty(tmp_path, tokenizer, own_cache, name):
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf \n\n\t  \r\n  ")
    with pytest.raises(DataError, match=rf"data.sources.0.path: \S*{name} is empty \(only blanks\); fill it or remove "
                                        "this source"):
        build_datasets(section(path), tokenizer)


def test_a_folder_mixing_layouts_names_its_files(tmp_path, tokenizer, own_cache):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_jsonl(folder / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "yo"}]}])
    write_jsonl(folder / "pairs.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(DataError, match=r"data.sources.0.path: \S*mixed mixes layouts \(chats.jsonl is messages, "
                                        r"pairs.jsonl is prompt_completion\); put each layout in a source of its own"):
        build_datasets(section(folder), tokenizer)
    (folder / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"one kind per source \(found .jsonl: chats.jsonl, pairs.jsonl; .txt: "
                                        r"notes.txt\)"):
        build_datasets(section(folder), tokenizer)


# -- one process prepares, the others wait and map it ---------------------------------------------------------------

@pytest.mark.launches
def test_one_rank_prepares_and_the_others_map_its_files(tmp_path, tiny_model_dir):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": f"row {i}"} for i in range(3000)])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": f"row {i}"} for i in range(2000)] + [{"text": 5}])
    from .support import free_port

    for path, name in ((good, "good"), (bad, "bad")):
        out = tmp_path / name
        out.mkdir()
        cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
               WORKER, tiny_model_dir, path, str(out), str(tmp_path / "cache")]
        r = run(cmd, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
        assert ranks[0]["read"] == 1 and ranks[0]["tokenised"] == (3000 if name == "good" else 2001)
        assert ranks[1]["read"] == 0 and ranks[1]["tokenised"] == 0  # it waited, then mapped rank 0's files
        if name == "good":
            assert ranks[0]["n"] == ranks[1]["n"] == 3000 and ranks[0]["first"] == ranks[1]["first"]
            assert ranks[0]["files"] == ranks[1]["files"] and ranks[0]["files"]
        else:
            assert ranks[0]["error"] == ranks[1]["error"] and "bad.jsonl:2001: text is a number" in ranks[0]["error"]


@pytest.mark.parametrize("env,machine", [
    ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "CROSS_RANK": "0"}, 0),  # DeepSpeed: no LOCAL_WORLD_SIZE
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}, 1),  # torchrun
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, 1),
    ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, 0),  # no launcher said: one machine
], ids=["deepspeed", "torchrun", "local_world", "unsaid"])
def test_the_machine_of_a_rank_is_what_its_launcher_says(monkeypatch, env, machine):
    """once_per_node waits for the first process of the rank's machine: a rank put on a machine of its own waits for
    a preparation no process runs (DeepSpeed's launcher sets CROSS_RANK, no LOCAL_WORLD_SIZE: the job hung)."""
    from hftrain import distributed

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CROSS_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert distributed.machine_index() == machine


# -- the templates merge: a row becomes its per-turn examples in the cache and in the stream --------------------------

def reasoning_chat(thoughts: list[str]) -> list[dict]:
    """A conversation of one user question and reasoned answer per thought (Qwen3 drops the reasoning of the turns
    before the last question: the row becomes one example per turn)."""
    return [m for k, thought in enumerate(thoughts) for m in (
        {"role": "user", "content": f"question {k}?"},
        {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\nanswer {k}."})]


def test_the_cache_and_the_stream_make_every_turns_example_keyed_on_train_turns(tmp_path, own_cache):
    from hftrain.data import tokenize_examples
    from hftrain.data.stream import stream_dataset

    from .template_families import FAMILIES, tokenizer_for

    tok = tokenizer_for(FAMILIES["qwen3"], str(tmp_path / "qwen3"))
    rows = [{"messages": reasoning_chat(["look it up", "recall it"])}, {"messages": reasoning_chat(["just one"])}]
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    for turns in ("all", "last"):  # the second build is not served from the first's cache
        want = [ex["input_ids"] for r in rows for ex in tokenize_examples(r, tok, False, train_turns=turns)]
        assert len(want) == (3 if turns == "all" else 2)
        got = build_datasets(section(path, train_turns=turns), tok).train
        assert got["input_ids"] == want
        stream = stream_dataset(section(path, train_turns=turns, streaming=True, shuffle_buffer=8), tok, seed=0)
        made = [ex["input_ids"] for ex, _ in zip(stream, range(len(want)))]
        assert sorted(made) == sorted(want)  # one pass, shuffled


def test_a_cut_the_template_would_write_differently_is_not_made(tmp_path, own_cache):
    """Qwen3 drops an earlier turn's inline reasoning (the text before its </think>): cut before the </think>, the
    reasoning would be written whole into the later example and push its question and answer out of max_length. The
    row is tokenised uncut: the examples equal the uncut ones, truncated."""
    from hftrain.data import tokenize_examples

    from .template_families import FAMILIES, tokenizer_for

    tok = tokenizer_for(FAMILIES["qwen3"], str(tmp_path / "qwen3"))
    long = "step " * (char_bound(tok, 64) // 2)
    row = {"messages": reasoning_chat([long, "short"])}
    path = write_jsonl(tmp_path / "r.jsonl", [row])
    got = build_datasets(section(path, max_length=64), tok).train
    want = tokenize_examples(row, tok, False)
    assert len(got) == len(want) == 2
    assert got["input_ids"] == [ex["input_ids"][:64] for ex in want]
    assert got["labels"] == [ex["labels"][:64] for ex in want]
    assert "answer 0." in tok.decode(got["input_ids"][1])  # the second example writes the first turn's answer only


# -- a damaged or unwritable cache (issue 43 point 3) ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["tokens", "rows"])
def test_a_truncated_cache_file_is_prepared_again_not_a_traceback(tmp_path, tokenizer, own_cache, counted, kind,
                                                                   capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"a {i}"} for i in range(300)])
    first = build_datasets(section(path), tokenizer)
    (damaged_file,) = (own_cache / "hftrain").glob(f"{kind}-*.arrow")
    with open(damaged_file, "r+b") as fh:  # a disk that filled up, a copy cut short
        fh.truncate(damaged_file.stat().st_size // 2)
    again = build_datasets(section(path), tokenizer)
    assert texts(tokenizer, again.train) == texts(tokenizer, first.train)
    assert counted == ({"read": 1, "tokenised": 600} if kind == "tokens" else {"read": 2, "tokenised": 300})
    err = capsys.readouterr().err
    assert f"hftrain: the cached {damaged_file.stem} in {own_cache / 'hftrain'} is damaged" in err
    assert "preparing it again" in err
    # A meta file that lists files outside its entry: nothing but the entry's own files is removed.
    outside = tmp_path / "keep.arrow"
    outside.write_text("not hftrain's")
    (meta,) = (own_cache / "hftrain").glob(f"{kind}-*.json")
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "files": ["../../keep.arrow"], "sizes": [1]}))
    build_datasets(section(path), tokenizer)
    assert outside.read_text() == "not hftrain's"


def test_a_cold_cache_that_cannot_be_written_is_named_with_the_fix(tmp_path, tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache's parent folder should be")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(blocked / "cache"))
    with pytest.raises(DataError) as e:
        build_datasets(section(path), tokenizer)
    assert str(e.value).startswith(f"data.sources.0: the datasets cache {blocked / 'cache' / 'hftrain'} cannot be "
                                   "written (Not a directory) and holds no prepared copy of this source: make it "
                                   "writable, or point HF_DATASETS_CACHE at a writable folder")


def test_a_template_file_edited_in_the_model_folder_is_tokenised_anew(tmp_path, tiny_model_dir, own_cache, counted):
    """The tokenizer's folder rebuilt with another chat_template.jinja: another key (the key hashes the loaded
    tokenizer, its template included), so the examples follow the new template."""
    import shutil

    from hftrain.config import ModelSection
    from hftrain.modeling import load_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [chat] * 3)
    build_datasets(section(path), load_tokenizer(ModelSection(name_or_path=str(folder))))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                                "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    tok = load_tokenizer(ModelSection(name_or_path=str(folder)))
    data = build_datasets(section(path), tok)
    assert counted == {"read": 1, "tokenised": 6}
    assert tok.decode(data.train[0]["input_ids"]) == "user: hi\nassistant: yo\n"
