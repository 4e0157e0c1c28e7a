"""data.streaming: examples made as training goes, each process its own rows, and a resume that continues from the
checkpoint's stream position exactly as the uninterrupted run went on (losses and weights equal)."""

import json
import os

import pytest

from hftrain.config import DataSection, DataSource, RecipeError
from hftrain.methods import load_recipe
from hftrain.data.stream import CHECK_ROWS, Position, SourceStream, TrainStream, stream_dataset
from hftrain.data.stream_position import POSITION_FILE, StreamPositionMixin
from hftrain.errors import DataError

from .conftest import DEMO_TRAIN
from .exactness import beyond, within


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_trainer(model_dir, out, sources, resume_mixin=True, **training):
    from hftrain.data import build_datasets
    from hftrain.launch.setup import training_arguments
    from hftrain.modeling import load_model, load_tokenizer
    from hftrain.methods.sft import SFTTrainer

    recipe = load_recipe(None, raw={
        "model": {"name_or_path": model_dir, "dtype": "float32"},
        "data": {"sources": sources, "max_length": 32, "streaming": True, "shuffle_buffer": 7},
        "training": {"output_dir": str(out), "max_steps": 4, "save_steps": 2, "per_device_train_batch_size": 2,
                     "gradient_accumulation_steps": 2, "learning_rate": 1e-3, "logging_steps": 1,
                     "report_to": "none", "seed": 0, "disable_tqdm": True, **training},
    })
    args = training_arguments(recipe)
    tokenizer = load_tokenizer(recipe.model)
    data = build_datasets(recipe.data, tokenizer, seed=args.seed)
    cls = SFTTrainer if resume_mixin else type(
        "ReplayingTrainer", tuple(b for b in SFTTrainer.__bases__ if b is not StreamPositionMixin), {})
    return cls(model=load_model(recipe.model), args=args, train_dataset=data.train, processing_class=tokenizer,
               data_collator=data.collator)


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """A JSON-lines source of chats and a parquet source of completions, mixed 2:1."""
    import datasets

    d = tmp_path_factory.mktemp("streams")
    pc = datasets.Dataset.from_list([{"prompt": f"count to {i}:",
                                      "completion": " " + " ".join("abcdefghij"[:i % 9 + 1])}
                                     for i in range(40)])
    pc.to_parquet(str(d / "pc.parquet"))
    return [{"path": DEMO_TRAIN, "weight": 2.0}, {"path": str(d / "pc.parquet"), "weight": 1.0}]


def test_resume_continues_the_stream_exactly(tmp_path, tiny_model_dir, two_sources, monkeypatch):
    """4 steps at once vs 2 steps, a checkpoint, and a resumed run of the last 2: the same losses and weights.
    The resumed stream starts at the recorded position (8 examples in, inside a shuffle window of 7 rows of the
    first source), it does not replay; and a resume that ignored the position would train on other batches (the
    check can fail)."""
    full = make_trainer(tiny_model_dir, tmp_path / "full", two_sources)
    full.train()
    ck = tmp_path / "full" / "checkpoint-2"
    position = json.loads((ck / POSITION_FILE.format(rank=0)).read_text())
    assert position["examples"] == 2 * 2 * 2 and position["draws"] == 8

    resumed = make_trainer(tiny_model_dir, tmp_path / "resumed", two_sources)
    made = []
    orig = TrainStream.__iter__

    def counting(self):
        made.append(self.start["examples"] if self.start else 0)
        return orig(self)

    monkeypatch.setattr(TrainStream, "__iter__", counting)
    resumed.train(resume_from_checkpoint=str(ck))
    assert made == [8] and resumed.args.ignore_data_skip
    a, b = losses(full), losses(resumed)
    assert sorted(b) == [1, 2, 3, 4]  # 1-2 restored from the checkpoint's state
    within("stream.resume_vs_uninterrupted.losses", [b[3], b[4]], [a[3], a[4]], scale=1.0)
    within("stream.resume_vs_uninterrupted.weights", {k: p.detach() for k, p in resumed.model.named_parameters()},
           {k: p.detach() for k, p in full.model.named_parameters()})

    monkeypatch.setattr(StreamPositionMixin, "_load_rng_state", lambda self, ck: None)
    ignored = make_trainer(tiny_model_dir, tmp_path / "ignored", two_sources, save_strategy="no")
    ignored.train(resume_from_checkpoint=str(ck))
    c = losses(ignored)
    beyond("stream.resume_vs_uninterrupted.losses", [c[3], c[4]], [a[3], a[4]], label="stream position ignored",
           scale=1.0)


def raw_rows_of_pass(stream: SourceStream, pass_no: int) -> list:
    """The raw rows a process reads in one pass (windows of its blocks)."""
    return [place for _, place, _ in stream.raw.rows(pass_no, None)]


def test_each_process_reads_its_own_rows(tmp_path, tokenizer, monkeypatch):
    """Two processes' shares of a pass are disjoint and cover every row; a later pass deals the blocks anew."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(300)])
    cfg = DataSection(sources=[DataSource(path=path)], streaming=True, max_length=16)
    shares = []
    for r in range(2):
        s = SourceStream(0, cfg.sources[0], cfg, tokenizer, seed=0, rank_=r, world=2)
        shares.append([raw_rows_of_pass(s, p) for p in (0, 1)])
    for p in (0, 1):
        a, b = set(shares[0][p]), set(shares[1][p])
        assert not a & b and len(a | b) == 300 and len(a) > 50 and len(b) > 50
    assert set(shares[0][0]) != set(shares[0][1])
    # and the examples of one process, read through windows, are its rows, each once per pass
    monkeypatch.setattr("hftrain.data.stream.rank", lambda: 1)
    monkeypatch.setattr("hftrain.data.stream.world_size", lambda: 2)
    stream = stream_dataset(cfg, tokenizer, seed=0).hftrain_stream
    texts = [tokenizer.decode(ex["input_ids"]) for ex, _ in zip(stream, range(len(shares[1][0])))]
    text_at, offset = {}, 0
    for line in open(path, "rb").read().splitlines(keepends=True):
        text_at[(0, offset)] = json.loads(line)["text"]
        offset += len(line)
    assert sorted(texts) == sorted(text_at[place] + "<|im_end|>" for place in shares[1][0])


def test_stream_errors_name_the_file_and_row(tmp_path, tokenizer):
    """A bad row past the rows checked before training stops training with the file and line, as prepared data
    would; one among them stops the build."""
    rows = [{"text": f"row {i}"} for i in range(CHECK_ROWS + 300)]
    rows[CHECK_ROWS + 199] = {"text": 5}
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataSection(sources=[DataSource(path=path)], streaming=True, max_length=16, shuffle_buffer=50)
    stream = stream_dataset(cfg, tokenizer, seed=0).hftrain_stream
    with pytest.raises(DataError, match=rf"data.sources.0: {path}:{CHECK_ROWS + 200}: text is a number \(5\)"):
        for _ in stream:
            pass
    rows[CHECK_ROWS + 199] = {"text": "fine"}
    write_jsonl(tmp_path / "d.jsonl", rows)
    with open(path, "a") as fh:
        fh.write("{\"text\": broken\n")
    stream = stream_dataset(cfg, tokenizer, seed=0).hftrain_stream
    with pytest.raises(DataError, match=rf"data.sources.0.path: {path}:{CHECK_ROWS + 301}: malformed JSON"):
        for _ in stream:
            pass
    early = write_jsonl(tmp_path / "e.jsonl", [{"text": "a"}, {"text": None}])
    with pytest.raises(DataError, match=rf"{early}:2: text is null"):
        stream_dataset(DataSection(sources=[DataSource(path=early)], streaming=True), tokenizer, seed=0)


def test_streaming_recipe_rules(tmp_path):
    base = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": DEMO_TRAIN}], "streaming": True},
            "training": {"output_dir": str(tmp_path / "o")}}
    with pytest.raises(RecipeError) as e:
        load_recipe(None, raw=base)
    assert "training.max_steps: data.streaming needs training.max_steps > 0" in str(e.value)
    bad = {**base, "data": {**base["data"], "eval_fraction": 0.1},
           "training": {**base["training"], "max_steps": 5, "dataloader_num_workers": 2}}
    with pytest.raises(RecipeError) as e:
        load_recipe(None, raw=bad)
    assert "data.eval_fraction: cannot hold rows out of a stream" in str(e.value)
    assert "training.dataloader_num_workers: must be 0 with data.streaming" in str(e.value)
    with pytest.raises(RecipeError, match="data.shuffle_buffer: applies to data.streaming: true only"):
        load_recipe(None, raw={**base, "data": {"sources": [{"path": DEMO_TRAIN}], "shuffle_buffer": 5}})
    ok = load_recipe(None, raw={**base, "training": {**base["training"], "max_steps": 5}})
    from hftrain.config.training import arguments_kwargs

    assert arguments_kwargs(ok, False)["accelerator_config"] == {"dispatch_batches": False}


def test_position_is_a_pure_function_of_the_examples_made(tokenizer, tmp_path):
    """Restarting a stream from the position after n examples gives the same next examples as going on."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i} " + "x " * (i % 5)} for i in range(57)])
    cfg = DataSection(sources=[DataSource(path=path), DataSource(path=DEMO_TRAIN, weight=0.5)], streaming=True,
                      max_length=16, shuffle_buffer=10, skip_untrainable=True)
    stream = stream_dataset(cfg, tokenizer, seed=3).hftrain_stream
    it = iter(stream)
    first = [next(it)["input_ids"] for _ in range(150)]  # past a pass of the small source
    for n in (0, 1, 9, 10, 11, 77, 120):
        again = TrainStream(cfg, tokenizer, seed=3)
        for s, checked in zip(again.sources, stream.sources):
            s.fn = checked.fn  # as stream_dataset sets it up (without checking the first rows again)
        again.resume(json.loads(json.dumps(stream.state_after(n))))
        rest = iter(again)
        assert [next(rest)["input_ids"] for _ in range(150 - n)] == first[n:], n
    assert Position().pass_no == 0


@pytest.mark.launches
def test_two_processes_train_on_their_own_rows(tmp_path, tiny_model_dir):
    """Under `accelerate launch` with 2 processes, the Trainer's dataloaders (accelerate's sharding of the stream,
    dispatch_batches off) give each process rows the other never sees, and the run trains."""
    from .support import free_port

    from .conftest import ACCELERATE_LAUNCH, REPO, run

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(500)])
    out = tmp_path / "out"
    out.mkdir()
    cmd = [*ACCELERATE_LAUNCH, "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2",
           "--main_process_port", str(free_port()), os.path.join(REPO, "tests", "stream_worker.py"), tiny_model_dir,
           path, str(out)]
    r = run(cmd, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = (json.loads((out / f"rank{i}.json").read_text()) for i in range(2))
    assert a["dispatch"] is False and len(a["texts"]) == len(b["texts"]) == 20
    rows = {f"row {i}<|im_end|>" for i in range(500)}
    assert set(a["texts"]) <= rows and set(b["texts"]) <= rows and not set(a["texts"]) & set(b["texts"])


def test_data_preview_of_a_streaming_recipe_says_what_it_sampled(tmp_path, tokenizer):
    from hftrain.data.preview import preview

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(CHECK_ROWS + 50)])
    report = preview(DataSection(sources=[DataSource(path=path)], streaming=True, max_length=16), tokenizer, 1)
    assert (f"statistics of the {CHECK_ROWS} examples of the first {CHECK_ROWS} rows (streaming: never prepared "
            "whole)") in report
    assert f"--- {path}:1: " in report


# -- a resume whose sources changed, or that switches streaming on or off (issue 43 point 1) ------------------------
def saved_position(tmp_path, cfg, tokenizer) -> str:
    """A checkpoint folder holding what a streaming run saves: rank 0's stream position."""
    ck = tmp_path / "checkpoint-2"
    ck.mkdir()
    stream = TrainStream(cfg, tokenizer, seed=0)
    (ck / POSITION_FILE.format(rank=0)).write_text(json.dumps(stream.state_after(0)))
    return str(ck)


@pytest.mark.parametrize("change, said", [
    ("append", "bytes when the run streamed it, {after} now (rows added, or rows edited)"),
    ("delete", "bytes when the run streamed it, {after} now (rows removed, or rows edited)"),
    ("edit", "its bytes changed (rows edited; the same size)"),
    ("touch", "modified since the run streamed it (the same size and first and last 64 KiB: copied or touched?)"),
])
def test_a_resume_whose_stream_changed_is_refused_naming_the_file_and_the_change(tmp_path, tokenizer, change, said):
    from hftrain.data.stream_position import stream_resume_problems

    rows = [{"text": f"row {i}"} for i in range(50)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataSection(sources=[DataSource(path=path)], streaming=True, max_length=16)
    ck = saved_position(tmp_path, cfg, tokenizer)
    assert stream_resume_problems(ck, cfg) == []  # unchanged: resumed
    before = os.path.getsize(path)
    if change == "append":
        write_jsonl(tmp_path / "d.jsonl", rows + [{"text": "new row"}])
    elif change == "delete":
        write_jsonl(tmp_path / "d.jsonl", rows[1:])
    elif change == "edit":
        write_jsonl(tmp_path / "d.jsonl", [{"text": "ROW 0"}] + rows[1:])
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    (problem,) = stream_resume_problems(ck, cfg)
    line = f"data.sources.0: {os.path.abspath(path)}: " + said.format(after=os.path.getsize(path))
    if "bytes when" in said:
        line = f"data.sources.0: {os.path.abspath(path)}: {before} " + said.format(after=os.path.getsize(path))
    assert problem.startswith(f"the sources changed since {ck} saved its stream position: {line}. Resuming at the "
                              "saved position would train other rows"), problem
    assert "Set data.on_stream_change: restart" in problem
    # the run refuses it as well (the stream's own resume, where transformers restores the RNG states)
    stream = TrainStream(cfg, tokenizer, seed=0)
    with pytest.raises(DataError, match="the sources changed since the checkpoint saved its stream position"):
        stream.resume(json.loads(open(os.path.join(ck, POSITION_FILE.format(rank=0))).read()))
    for policy in ("restart", "continue"):
        assert stream_resume_problems(ck, DataSection(sources=cfg.sources, streaming=True, max_length=16,
                                                      on_stream_change=policy)) == []


def test_the_policies_restart_the_stream_or_continue_at_the_saved_position(tmp_path, tokenizer, capsys):
    rows = [{"text": f"row {i}"} for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataSection(sources=[DataSource(path=path)], streaming=True, max_length=16, shuffle_buffer=5)
    from hftrain.data.sources import read_rows_sample

    first = TrainStream(cfg, tokenizer, seed=0)

    def examples(stream, n):
        for s in stream.sources:
            s.setup(read_rows_sample(s.src, s.key, 10))
        return [tokenizer.decode(ex["input_ids"]) for ex, _ in zip(stream, range(n))]

    uninterrupted = examples(first, 12)
    saved = first.state_after(6)
    write_jsonl(tmp_path / "d.jsonl", rows + [{"text": "appended"}])
    restarted = TrainStream(DataSection(sources=cfg.sources, streaming=True, max_length=16, shuffle_buffer=5,
                                        on_stream_change="restart"), tokenizer, seed=0)
    restarted.resume(saved)
    fresh = TrainStream(cfg, tokenizer, seed=0)  # the changed file streamed from its beginning
    assert examples(restarted, 6) == examples(fresh, 6)
    assert restarted.state_after(6 + 6)["examples"] == 12  # the count goes on: the checkpoints still line up
    write_jsonl(tmp_path / "d.jsonl", rows)  # the same rows again, a new modification time
    continued = TrainStream(DataSection(sources=cfg.sources, streaming=True, max_length=16, shuffle_buffer=5,
                                        on_stream_change="continue"), tokenizer, seed=0)
    continued.resume(saved)
    assert examples(continued, 6) == uninterrupted[6:]
    out = capsys.readouterr().out
    assert "streaming them from their beginning (data.on_stream_change: restart)" in out
    assert "resuming at the saved position anyway (data.on_stream_change: continue)" in out


def test_switching_streaming_on_or_off_at_a_resume_is_refused(tmp_path, tokenizer):
    from hftrain.data.stream_position import stream_resume_problems

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(20)])
    streaming = DataSection(sources=[DataSource(path=path)], streaming=True, max_length=16)
    prepared = DataSection(sources=[DataSource(path=path)], max_length=16)
    ck = saved_position(tmp_path, streaming, tokenizer)
    assert stream_resume_problems(ck, prepared) == [
        f"{ck} was written by a streaming run (it holds stream_position_0.json, the stream's position) and this "
        "recipe does not stream: its position would be ignored and the run would train from the prepared data's "
        "beginning; resume it with data.streaming: true, or start anew"]
    os.remove(os.path.join(ck, POSITION_FILE.format(rank=0)))
    assert stream_resume_problems(ck, streaming) == [
        f"{ck} was written by a run that did not stream (no stream_position_0.json) and this recipe streams: there "
        "is no position to continue the stream from; resume it with data.streaming: false, or start anew"]
    assert stream_resume_problems(ck, prepared) == []
