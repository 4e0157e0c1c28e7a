"""Evaluation: eval_loss is the mean CE over every target token of the eval set and exact match counts every
held-out example once, whatever the eval batch size, the number of processes or the strategy."""

import json

import pytest
import torch
import yaml

from hftrain import losses
from hftrain.config import DataSection, DataSource, ModelSection
from hftrain.constants import IGNORE_INDEX
from hftrain.data import build_datasets
from tests.exactness import beyond, within
from tests.support import free_port
from hftrain.evaluate import greedy_answer, shard

from .conftest import ACCELERATE_LAUNCH, PY, eval_token_mean_and_old, run, uneven_data

N_EVAL = 7  # odd: no eval batch size > 1 and no world size > 1 divides it


@pytest.fixture(scope="module")
def eval_set(tmp_path_factory, spiky_model_dir):
    path = uneven_data(tmp_path_factory.mktemp("eval") / "eval.jsonl", n=N_EVAL, seed=1)
    return path, *eval_token_mean_and_old(spiky_model_dir, path)


def test_example_sums_one_row_per_example_padded_or_packed(spiky_model_dir, tokenizer):
    from hftrain.data import make_collator, tokenize_example
    from hftrain.modeling import load_model

    model = load_model(ModelSection(name_or_path=spiky_model_dir), packing=True).eval()
    exs = [tokenize_example({"prompt": f"reverse: {'a ' * k}", "completion": "b " * (k + 2)}, tokenizer, False)
           for k in (1, 5, 2)]
    padded = make_collator(tokenizer, packing=False)(exs)
    packed = make_collator(tokenizer, packing=True)(exs)
    with torch.no_grad():
        a = losses.example_sums(model(**{k: v for k, v in padded.items() if k != "labels"}).logits, padded["labels"])
        b = losses.example_sums(model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits,
                                packed["labels"], packed["position_ids"])
    assert a.shape == (3, 2) and b.shape == (3, 2)  # a packed row's trailing padding is no example
    # Packing places the examples longest first: the same rows, in another order.
    within("eval.packed_vs_padded.example_sums", b[b[:, 1].argsort()], a[a[:, 1].argsort()])
    assert a[:, 1].tolist() == [sum(x != IGNORE_INDEX for x in ex["labels"][1:]) for ex in exs]
    within("eval.example_sums_vs_loss_sum.loss", a[:, 0].sum(), losses.loss_sum(
        model(**{k: v for k, v in padded.items() if k != "labels"}).logits.detach(), padded["labels"]).double())


@pytest.mark.parametrize("packing", [False, True])
def test_eval_loss_is_the_token_mean_over_the_eval_set_for_any_batch_size(eval_set, spiky_model_dir, tmp_path,
                                                                          packing):
    from transformers import AutoTokenizer

    from hftrain.config import HFTrainingArguments
    from hftrain.modeling import load_model
    from hftrain.methods.sft import SFTTrainer

    path, ref, old = eval_set
    tok = AutoTokenizer.from_pretrained(spiky_model_dir)
    data = build_datasets(DataSection(sources=[DataSource(path=path)], eval_sources=[DataSource(path=path)],
                                      max_length=64, packing=packing), tok)
    model = load_model(ModelSection(name_or_path=spiky_model_dir, dtype="float32"), packing=packing)
    assert len(data.eval) == N_EVAL
    for bs in (1, 3, 8):
        args = HFTrainingArguments(output_dir=str(tmp_path / str(bs)), per_device_eval_batch_size=bs, use_cpu=True,
                                   report_to="none")
        trainer = SFTTrainer(model=model, args=args, eval_dataset=data.eval, data_collator=data.collator,
                             processing_class=tok)
        within("eval.eval_loss_vs_token_mean.loss", trainer.evaluate()["eval_loss"], ref, label=f"batch size {bs}")
        if bs < N_EVAL:  # negative control: the old number (a mean of per-batch means) is visibly off on this data
            beyond("eval.eval_loss_vs_token_mean.loss", old(bs), ref, label=f"batch size {bs}")


def test_exact_match_shards_count_each_example_once():
    for n in (0, 1, 2, 7, 8):
        for world in (1, 2, 3):
            for lockstep in (False, True):
                shards = [shard(n, r, world, lockstep) for r in range(world)]
                counted = sorted(i for s in shards for i, c in s if c)
                assert counted == list(range(n)), (n, world, lockstep)
                if lockstep:  # every rank calls generate() equally often
                    assert len({len(s) for s in shards}) == 1, (n, world)


# ---------------------------------------------------------------------------------------------------------------
# 1 process against 2 processes (DDP, FSDP2, ZeRO-3) on the same weights: learning rate 1e-12, so the initial eval
# (eval_on_start) and the final one (eval_loss, exact match) are all of the initial model.

PROCS = {"1p": None, "ddp": "ddp", "fsdp": "fsdp", "zero3": "zero3"}


@pytest.fixture(scope="module")
def matched_eval(tmp_path_factory, spiky_model_dir):
    """An eval set of N_EVAL examples whose references are the model's own greedy answer for MATCHED of them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tmp_path_factory.mktemp("matched")
    base = [json.loads(line) for line in open(uneven_data(tmp / "base.jsonl", n=N_EVAL, seed=1))]
    tok = AutoTokenizer.from_pretrained(spiky_model_dir)
    model = AutoModelForCausalLM.from_pretrained(spiky_model_dir, dtype=torch.float32).eval()
    held = build_datasets(DataSection(sources=[DataSource(path=str(tmp / "base.jsonl"))],
                                      eval_sources=[DataSource(path=str(tmp / "base.jsonl"))], max_length=64),
                          tok, exact_match=N_EVAL).eval_examples
    matched = [0, 3, 4, 6]  # on rank 0 and rank 1, in the padded last batch, and the last example
    for i in matched:
        answer = greedy_answer(model, tok, held[i], max_new_tokens=6).strip()
        assert answer, i
        base[i]["completion"] = " " + answer
    path = tmp / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in base))
    held = build_datasets(DataSection(sources=[DataSource(path=str(path))], eval_sources=[DataSource(path=str(path))],
                                      max_length=64), tok, exact_match=N_EVAL).eval_examples
    for i, ex in enumerate(held):  # the expected share holds by construction
        assert (greedy_answer(model, tok, ex, max_new_tokens=6).strip() == ex["reference"].strip()) == (i in matched)
    return str(path), len(matched) / N_EVAL, eval_token_mean_and_old(spiky_model_dir, str(path))[0]


@pytest.fixture(scope="module")
def eval_runs(tmp_path_factory, spiky_model_dir, matched_eval, deepspeed_ops):
    tmp = tmp_path_factory.mktemp("evalruns")
    train = uneven_data(tmp / "train.jsonl", n=8)
    out = {}
    for name, strategy in PROCS.items():
        od = tmp / name
        rec = tmp / f"{name}.yaml"
        rec.write_text(yaml.safe_dump({
            "model": {"name_or_path": spiky_model_dir, "dtype": "float32"},
            "data": {"sources": [{"path": train}], "eval_sources": [{"path": matched_eval[0]}], "max_length": 64},
            "eval": {"exact_match": N_EVAL, "max_new_tokens": 6},
            # learning_rate must be > 0 (a recipe rule): 1e-12 with SGD moves no weight by more than ~1e-11.
            "training": {"output_dir": str(od), "max_steps": 1, "per_device_train_batch_size": 2,
                         "per_device_eval_batch_size": 3, "optim": "sgd", "learning_rate": 1e-12,
                         "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "seed": 0},
        }))
        if strategy is None:
            cmd = [PY, "recipes/sft.py", str(rec)]
        else:
            cmd = [*ACCELERATE_LAUNCH, "--config_file", f"accelerate_configs/{strategy}.yaml",
                   "--main_process_port", str(free_port()), "recipes/sft.py", str(rec), f"strategy.name={strategy}"]
        r = run(cmd, timeout=600)
        assert r.returncode == 0, f"{name}:\n" + r.stdout[-3000:] + r.stderr[-4000:]
        info = json.load(open(od / "run_info.json"))
        assert info["world_size"] == (1 if strategy is None else 2) and info["strategy"] == (strategy or "ddp")
        out[name] = info["metrics"]
    return out


@pytest.mark.launches
@pytest.mark.parametrize("name", list(PROCS))
def test_eval_loss_and_exact_match_equal_on_1_and_2_processes(eval_runs, matched_eval, name):
    _, share, ref = matched_eval
    m, one = eval_runs[name], eval_runs["1p"]
    for key in ("initial_eval_loss", "final_eval_loss"):
        within("eval.eval_loss_vs_token_mean.loss", m[key], ref, label=key)
        within("eval.processes_vs_one_process.loss", m[key], one[key], label=key)
    assert m["final_exact_match"] == pytest.approx(share) == one["final_exact_match"]
    if name != "zero3":  # no greedy answers before training under ZeRO-3's zero.Init (recipes/sft.py)
        assert m["initial_exact_match"] == pytest.approx(share)
