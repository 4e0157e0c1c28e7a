"""check == run (issue 33, points 3-5): every case the issue found, where `hftrain check` passed and the run then died
with a traceback after the model loaded, is now refused by check, and by the run (hftrain.recipes.sft or .dpo in
this process, or `hftrain launch`) with the very same message, exit 2, no traceback, nothing written. The values are
refused by the libraries' own validation (hftrain/launch/libraries.py); resume compares the checkpoint with the
model the recipe builds (hftrain/launch/resume.py); preference pairs are measured as TRL will truncate them."""

import json
import os
import shutil

import pytest

from hftrain.cli import main as cli_main
from hftrain.errors import exit_on_user_error
from hftrain.methods import policy
from hftrain.recipes import dpo

from .conftest import SMALL
from .support import free_port
from .test_bad_input import W, both, run_check, run_main, set_, snapshot

PAIR = {"prompt": [{"role": "user", "content": "reverse: a b c"}],
        "chosen": [{"role": "assistant", "content": "c b a"}],
        "rejected": [{"role": "assistant", "content": "a b c"}]}


def one(w: W, **fields) -> str:
    return w.recipe(lambda t: [t[s].update(v) if isinstance(v, dict) else t.__setitem__(s, v)
                               for s, v in fields.items()])


def two_rows(w: W) -> str:
    rows = [json.dumps({"prompt": f"reverse: {c} ->", "completion": f" {c}"}) for c in "ab"]
    return w.data("two.jsonl", "\n".join(rows) + "\n")


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory, tiny_model_dir):
    """checkpoint-1 of a one-step run of another model (hidden 48, not 32) and the same tokenizer."""
    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    from .conftest import DEMO_TRAIN
    from .test_checkpoints import make_trainer

    tmp = tmp_path_factory.mktemp("other")
    other = build_tiny_model(str(tmp / "base"), texts_of_jsonl([DEMO_TRAIN]), config={**SMALL, "hidden_size": 48},
                             vocab_size=300, seed=0)
    make_trainer(other, tmp / "out", max_steps=1, save_steps=1).train()
    return str(tmp / "out" / "checkpoint-1")


def resume_from(ck: str, *edits):
    def build(w: W) -> list[str]:
        # make_trainer's checkpoints were trained 4 examples per step: the same here, so only the model differs
        return [w.recipe(both(set_("training.resume_from_checkpoint", ck),
                              set_("training.per_device_train_batch_size", 4), *edits))]
    return build


# (id, build(w) -> argv, expected substrings): the list, each a clean refusal from check and from the run.
CASES = [
    ("negative_seed", lambda w: [w.recipe(set_("training.seed", -1))],
     ["training.seed (-1): transformers' Trainer refuses it (ValueError: Seed must be between 0 and 2**32 - 1)"]),
    ("negative_dataloader_workers", lambda w: [w.recipe(set_("training.dataloader_num_workers", -1))],
     ["training.dataloader_num_workers (-1): transformers' Trainer refuses it",
      "num_workers option should be non-negative"]),
    ("negative_max_new_tokens", lambda w: [w.recipe(set_("eval.max_new_tokens", -1))],
     ["eval.max_new_tokens: transformers' generate() refuses -1", "`max_new_tokens` must be greater than 0"]),
    ("negative_num_proc", lambda w: [w.recipe(set_("data.num_proc", -1))],
     ["data.num_proc: must be at least 1 (or unset: the cores available), got -1"]),
    ("nan_source_weight", lambda w: [w.recipe(set_("data.sources", [{"path": w.file("a.jsonl", _rows(4))},
                                                                     {"path": w.file("b.jsonl", _rows(4)),
                                                                      "weight": float("nan")}]))],
     ["data.sources.1.weight: expected a finite number, got nan"]),
    ("eval_fraction_of_two_rows", lambda w: [two_rows(w), "data.eval_fraction=0.9",
                                             "training.per_device_train_batch_size=1"],
     ["data.eval_fraction: 0.9 of the 2 rows of data.sources.0", "leaves no row to train on",
      "change data.eval_fraction or add rows"]),
    ("lora_dropout_torch_refuses", lambda w: [w.recipe(set_("model.lora", {"r": 4, "dropout": 1.5}))],
     ["model.lora.dropout (1.5): peft refuses it", "dropout probability has to be between 0 and 1"]),
    ("lora_target_not_in_model", lambda w: [w.recipe(set_("model.lora", {"r": 4, "target_modules": ["qkv"]}))],
     ["model.lora.target_modules (['qkv']): peft refuses it", "Target modules {'qkv'} not found"]),
]


def _rows(n: int) -> str:
    return "".join(json.dumps({"prompt": f"reverse: {c} ->", "completion": f" {c}"}) + "\n" for c in "abcdefgh"[:n])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_check_refuses_what_the_run_would_die_of_and_the_run_says_the_same(case, tmp_path, tiny_model_dir,
                                                                            monkeypatch, capsys):
    _, build, expected = case
    w = W(str(tmp_path), tiny_model_dir)
    argv = build(w) + ["strategy.num_processes=1"]
    code, err = run_check(argv, capsys)
    assert code == 2 and "Traceback" not in err, f"check: exit {code}\n{err[-3000:]}"
    checked = err[err.index("hftrain: error:"):]
    for s in expected:
        assert s in checked, f"{s!r} not in:\n{checked}"
    before = snapshot(w.out)
    code = run_main(argv, {}, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, f"run: exit {code}\n{err[-3000:]}"
    assert err[err.index("hftrain: error:"):] == checked
    assert snapshot(w.out) == before


@pytest.mark.parametrize("override, expected", [
    ("strategy.num_processes=0", "strategy.num_processes: must be at least 1, got 0"),
    ("strategy.main_process_port=70000", "strategy.main_process_port (70000): accelerate launch refuses it "
                                         "(ValueError: The port number of the rendezvous endpoint "
                                         "'127.0.0.1:70000' must be an integer between 0 and 65536.)"),
], ids=["no_processes", "port_above_65535"])
def test_check_and_launch_refuse_what_the_launcher_would_die_of(override, expected, tmp_path, tiny_model_dir,
                                                                capsys):
    """The launcher's own checks (accelerate launch, torch elastic) run on the recipe's launch by check and by
    `hftrain launch` before anything starts."""
    w = W(str(tmp_path), tiny_model_dir)
    argv = [w.recipe(), override]
    code, err = run_check(argv, capsys)
    assert code == 2 and expected in err and "Traceback" not in err, err[-3000:]
    checked = err[err.index("hftrain: error:"):]
    with pytest.raises(SystemExit) as e:
        cli_main(["launch", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err[err.index("hftrain: error:"):] == checked


def test_a_launch_the_launcher_accepts_passes(tmp_path, tiny_model_dir, capsys):
    """The negative control: the same path accepts a 2-process launch on a free port (and touches nothing)."""
    w = W(str(tmp_path), tiny_model_dir)
    assert cli_main(["check", w.recipe(), f"strategy.main_process_port={free_port()}", "--no-data"]) == 0
    assert not os.path.exists(w.out)


def test_options_the_trainer_reads_from_the_model_config_pass_the_probe(tmp_path, tiny_model_dir, capsys):
    """training.label_smoothing_factor (the exact and chunked losses support it) was refused by check and the run with
    an internal error: the Trainer reads the model's config for it, and the probe's stand-in model had none."""
    w = W(str(tmp_path), tiny_model_dir)
    code, err = run_check([w.recipe(), "training.label_smoothing_factor=0.1", "--no-data"], capsys)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    code, err = run_check([w.recipe(), "training.label_smoothing_factor=lots", "--no-data"], capsys)  # the control
    assert code == 2 and "training.label_smoothing_factor: expected a finite number, got 'lots'" in err, err[-3000:]


# -- resume: the checkpoint against the model the recipe builds (point 4) ---------------------------------------------
@pytest.mark.parametrize("name, edits, expected", [
    ("another_model", [], ["holds another model than this recipe builds", "model.embed_tokens.weight [",
                           "config.json: head_dim 24 there, 16 here, hidden_size 48 there, 32 here"]),
    ("lora_on_a_whole_model", [set_("model.lora", {"r": 4})],
     ["holds a whole model and this recipe trains a LoRA adapter (model.lora)"]),
])
def test_resume_from_a_checkpoint_of_another_model_is_refused_by_check_and_run(name, edits, expected, other_checkpoint,
                                                                               tmp_path, tiny_model_dir, monkeypatch,
                                                                               capsys):
    w = W(str(tmp_path), tiny_model_dir)
    argv = resume_from(other_checkpoint, *edits)(w) + ["strategy.num_processes=1"]
    code, err = run_check(argv, capsys)
    assert code == 2, err[-3000:]
    checked = err[err.index("hftrain: error:"):]
    for s in ["training.resume_from_checkpoint: " + other_checkpoint, *expected,
              "Resume with the recipe that wrote it"]:
        assert s in checked, f"{s!r} not in:\n{checked}"
    code = run_main(argv, {}, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and err[err.index("hftrain: error:"):] == checked and "Traceback" not in err


def test_a_checkpoint_of_a_run_that_did_not_stream_is_refused_to_a_streaming_recipe(tmp_path, tiny_model_dir,
                                                                                       monkeypatch, capsys):
    """Issue 43: it passed check and the run failed after loading the model (no stream position to continue)."""
    from .test_checkpoints import make_trainer

    make_trainer(tiny_model_dir, tmp_path / "out", max_steps=1, save_steps=1).train()
    ck = str(tmp_path / "out" / "checkpoint-1")
    w = W(str(tmp_path), tiny_model_dir)
    argv = resume_from(ck, set_("data.streaming", True), set_("training.max_steps", 2))(w) + [
        "strategy.num_processes=1"]
    code, err = run_check(argv, capsys)
    assert code == 2, err[-3000:]
    checked = err[err.index("hftrain: error:"):]
    assert (f"training.resume_from_checkpoint: {ck} was written by a run that did not stream (no "
            "stream_position_0.json) and this recipe streams" in checked), checked
    code = run_main(argv, {}, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and err[err.index("hftrain: error:"):] == checked and "Traceback" not in err


def test_lora_checkpoint_against_another_rank_and_a_full_recipe(tmp_path, tiny_model_dir):
    from hftrain.methods import load_recipe
    from hftrain.launch.resume import compatibility_problems
    from hftrain.modeling import load_tokenizer

    from .test_checkpoints import make_trainer

    make_trainer(tiny_model_dir, tmp_path / "out", lora={"r": 4}, max_steps=1, save_steps=1).train()
    ck = str(tmp_path / "out" / "checkpoint-1")

    def problems(**model):
        recipe = load_recipe(None, raw={"model": {"name_or_path": tiny_model_dir, **model},
                                        "data": {"sources": [{"path": "d"}]}})
        return compatibility_problems(ck, recipe, load_tokenizer=load_tokenizer)

    assert problems(lora={"r": 4}) == []  # the recipe that wrote it
    [p] = problems(lora={"r": 8})
    assert "holds another LoRA adapter than this recipe builds" in p and "lora_A.weight [4, " in p and "[8, " in p
    [p] = problems(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    assert "tensor(s) this run has no place for" in p and "mlp" in p
    [p] = problems(lora={"r": 4, "alpha": 8})
    assert "lora_alpha 32, this recipe model.lora.alpha 8" in p
    [p] = problems()
    assert "holds a LoRA adapter and this recipe trains every weight (no model.lora)" in p


def test_another_vocabulary_is_named(tmp_path, tiny_model_dir, other_checkpoint):
    """The same model shapes, another tokenizer (trained on other text, the same size): the ids mean other tokens."""
    from hftrain.methods import load_recipe
    from hftrain.launch.resume import compatibility_problems
    from hftrain.modeling import load_tokenizer
    from hftrain.tiny import build_tiny_model

    from .conftest import DEMO_EVAL

    ck = tmp_path / "checkpoint-1"
    shutil.copytree(other_checkpoint, ck)
    texts = [f"{w} {w[::-1]} zz qq xx" for w in ("alpha", "beta", "gamma", "delta", "epsilon")] * 50
    other_tok = build_tiny_model(str(tmp_path / "tok"), texts, config={**SMALL, "hidden_size": 48}, vocab_size=300)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(other_tok, f), ck / f)
    base = os.path.join(os.path.dirname(os.path.dirname(other_checkpoint)), "base")  # the model that wrote it
    recipe = load_recipe(None, raw={"model": {"name_or_path": base}, "data": {"sources": [{"path": DEMO_EVAL}]}})
    problems = compatibility_problems(str(ck), recipe, load_tokenizer=load_tokenizer)
    assert any("was trained with another vocabulary" in p and "ids mean other tokens" in p for p in problems), problems


@pytest.mark.parametrize("layout, expected", [
    (True, "it was written by hftrain (it holds hftrain_checkpoint.json) and its manifest was deleted after the save"),
    (False, "it was not written by hftrain (no hftrain_checkpoint.json): by transformers' Trainer (it holds "
            "trainer_state.json) or another tool"),
])
def test_check_reports_a_missing_manifest_and_who_wrote_the_checkpoint(layout, expected, tmp_path, tiny_model_dir,
                                                                       capsys):
    from .test_checkpoints import make_trainer

    make_trainer(tiny_model_dir, tmp_path / "ref", max_steps=1, save_steps=1).train()
    w = W(str(tmp_path), tiny_model_dir)
    ck = tmp_path / "out" / "checkpoint-1"
    shutil.copytree(tmp_path / "ref" / "checkpoint-1", ck)
    os.remove(ck / "hftrain_manifest.json")
    if not layout:
        os.remove(ck / "hftrain_checkpoint.json")
    code, err = run_check([w.recipe(both(set_("training.resume_from_checkpoint", True),
                                         set_("training.per_device_train_batch_size", 4))),
                           "strategy.num_processes=1", "--no-data"], capsys)
    assert code == 0, err[-3000:]
    assert f"hftrain: {ck} has no hftrain_manifest.json: {expected}" in err, err[-3000:]
    assert "its files cannot be verified" in err


# -- preference pairs that truncation would empty (point 5) -----------------------------------------------------------
def dpo_recipe(w: W, pairs: list[dict], max_length: int, **training) -> str:
    path = w.file("pairs.jsonl", "".join(json.dumps(p) + "\n" for p in pairs))
    return w.recipe(lambda t: (t["data"].update(sources=[{"path": path}], max_length=max_length),
                               t.update(preference={"loss_type": "sigmoid"}),
                               t["training"].update(training)))


def run_dpo(argv, monkeypatch) -> int:
    try:
        with exit_on_user_error():
            dpo.main(argv)
    except SystemExit as e:
        return e.code
    return 0


def _text_pair(i: int, prompt_words: int) -> dict:
    return {"prompt": " ".join(["reverse"] * prompt_words) + f" {i}:", "chosen": " a b", "rejected": " b a"}


def test_pairs_whose_prompts_fill_max_length_are_counted_before_the_model_loads(tmp_path, tiny_model_dir,
                                                                                 monkeypatch, capsys):
    """Text pairs whose prompt lengths are known from the tokenizer itself (the oracle): every prompt too long is an
    error naming data.max_length, from check and from the run, before the policy loads; some too long are counted,
    named by row and left out, and the rest is what trains."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    w = W(str(tmp_path), tiny_model_dir)
    pairs = [_text_pair(i, n) for i, n in enumerate([1, 12, 2, 12, 12, 1])]
    lengths = [len(tok(p["prompt"])["input_ids"]) for p in pairs]
    max_length = sorted(set(lengths))[1]  # the two shortest prompt lengths differ: the first kept, the rest dropped
    too_long = [i for i, n in enumerate(lengths) if n >= max_length]
    assert 0 < len(too_long) < len(pairs)
    loaded = []
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: loaded.append(1) or (_ for _ in ()).throw(SystemExit(9)))

    argv = [dpo_recipe(w, pairs, min(lengths), max_steps=1, per_device_train_batch_size=1), "strategy.num_processes=1"]
    code, err = run_check(argv, capsys)
    assert code == 2, err[-3000:]
    checked = err[err.index("hftrain: error:"):]
    assert (f"data.sources.0: every one of the 6 pairs of {w.tmp}/pairs.jsonl has a prompt of data.max_length="
            f"{min(lengths)} tokens or more" in checked
            and f"raise data.max_length above {min(lengths)}" in checked), checked
    code = run_dpo(argv, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and err[err.index("hftrain: error:"):] == checked and not loaded

    argv = [dpo_recipe(w, pairs, max_length, max_steps=1, per_device_train_batch_size=1), "strategy.num_processes=1"]
    assert run_dpo(argv, monkeypatch) == 9 and loaded  # the data phase passed: the policy was about to load
    captured = capsys.readouterr()
    err = captured.err
    rows = ", ".join(f"{w.tmp}/pairs.jsonl:{i + 1}" for i in too_long)
    assert (f"data.sources.0: {len(too_long)} of 6 pairs of {w.tmp}/pairs.jsonl are left out: their prompt alone "
            f"fills data.max_length={max_length} tokens" in err and rows in err), err[-3000:]
    assert f"hftrain: {6 - len(too_long)} training pairs" in captured.out + err  # what trains: the pairs kept


def test_kto_examples_whose_prompts_fill_max_length_are_counted_before_the_model_loads(tmp_path, tiny_model_dir,
                                                                                        monkeypatch, capsys):
    """KTO as the pairs above (issue 43: every prompt too long passed check and the run ended with exit 0 after TRL
    dropped them all): measured by TRL's own KTOTrainer._prepare_dataset, before the policy loads."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    w = W(str(tmp_path), tiny_model_dir)
    rows = [{"prompt": _text_pair(i, n)["prompt"], "completion": " a b", "label": i % 2 == 0}
            for i, n in enumerate([1, 12, 2, 12, 12, 1])]
    lengths = [len(tok(r["prompt"])["input_ids"]) for r in rows]
    max_length = sorted(set(lengths))[1]
    too_long = [i for i, n in enumerate(lengths) if n >= max_length]
    loaded = []
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: loaded.append(1) or (_ for _ in ()).throw(SystemExit(9)))

    def kto_recipe(limit: int) -> str:
        path = w.file("kto.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        return w.recipe(lambda t: (t["data"].update(sources=[{"path": path}], max_length=limit),
                                   t.update(preference={"loss_type": "kto"}),
                                   t["training"].update(max_steps=1, per_device_train_batch_size=2)))

    argv = [kto_recipe(min(lengths)), "strategy.num_processes=1"]
    code, err = run_check(argv, capsys)
    assert code == 2, err[-3000:]
    checked = err[err.index("hftrain: error:"):]
    assert (f"data.sources.0: every one of the 6 examples of {w.tmp}/kto.jsonl has a prompt of data.max_length="
            f"{min(lengths)} tokens or more" in checked
            and f"raise data.max_length above {min(lengths)}" in checked), checked
    code = run_dpo(argv, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and err[err.index("hftrain: error:"):] == checked and not loaded

    argv = [kto_recipe(max_length), "strategy.num_processes=1"]
    assert run_dpo(argv, monkeypatch) == 9 and loaded
    captured = capsys.readouterr()
    named = ", ".join(f"{w.tmp}/kto.jsonl:{i + 1}" for i in too_long)
    assert (f"data.sources.0: {len(too_long)} of 6 examples of {w.tmp}/kto.jsonl are left out: their prompt alone "
            f"fills data.max_length={max_length} tokens" in captured.err and named in captured.err), captured.err
    assert f"hftrain: {6 - len(too_long)} training examples" in captured.out + captured.err


def test_the_pairs_kept_are_those_trls_trainer_keeps(tmp_path, tiny_model_dir):
    """The count is TRL's own: DPOTrainer's prepared dataset (built here the way hftrain.recipes.dpo builds the
    trainer's) holds exactly the pairs hftrain keeps."""
    import datasets
    from transformers import AutoTokenizer

    from hftrain.methods.pairs import check_lengths

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = [_text_pair(i, n) for i, n in enumerate([1, 12, 2, 12, 3, 1, 30])]
    ds = datasets.Dataset.from_list(pairs)
    kept = check_lengths(ds, [f"row {i}" for i in range(len(pairs))], tok, 12, "data.sources.0", "p.jsonl")
    oracle = [p for p in pairs if len(tok(p["prompt"])["input_ids"]) < 12]
    assert kept.to_list() == oracle
