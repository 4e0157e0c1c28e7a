"""data.streaming: examples made as training goes, each process its own rows, and a resume that continues from the
checkpoint's stream position exactly as the uninterrupted run went on (losses and weights equal)."""

import json
import os

import pytest
import torch

from hftrain.config import DataSection, DataSource, RecipeError, load_recipe
from hftrain.data.stream import CHECK_ROWS, Position, SourceStream, TrainStream, stream_dataset
from hftrain.trainer.stream_position import POSITION_FILE, StreamPositionMixin
from hftrain.errors import DataError

from .conftest import DEMO_TRAIN


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_trainer(model_dir, out, sources, resume_mixin=True, **training):
    from hftrain.data import build_datasets
    from hftrain.launch.setup import training_arguments
    from hftrain.modeling import load_model, load_tokenizer
    from hftrain.trainer import SFTTrainer

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
    """4 steps at once vs 2 steps, a checkpoint, and a resumed run of the last 2: the same losses (1e-6) and weights.
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
    for step in (3, 4):
        assert abs(a[step] - b[step]) <= 1e-6 * max(1.0, abs(a[step])), (step, a[step], b[step])
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)

    monkeypatch.setattr(StreamPositionMixin, "_load_rng_state", lambda self, ck: None)
    ignored = make_trainer(tiny_model_dir, tmp_path / "ignored", two_sources, save_strategy="no")
    ignored.train(resume_from_checkpoint=str(ck))
    c = losses(ignored)
    assert max(abs(a[s] - c[s]) for s in (3, 4)) > 1e-3


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
    import subprocess

    from .support import free_port

    from .conftest import ACCELERATE_LAUNCH, REPO

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(500)])
    out = tmp_path / "out"
    out.mkdir()
    cmd = [*ACCELERATE_LAUNCH, "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2",
           "--main_process_port", str(free_port()), os.path.join(REPO, "tests", "stream_worker.py"), tiny_model_dir,
           path, str(out)]
    r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                       timeout=600)
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
