"""Distillation (hftrain/methods/distill/): what check and the run refuse, all at once; the loss exact over the
global batch (2 ranks x GA2 = 1 rank x GA4, losses and weights, fp32, with a negative control); a teacher whose
vocabulary is the student's plus padding rows aligned and said; held-out metrics and the card; on_policy sampling."""

import json
import random
import re

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.exactness import beyond, within

from .support import RESUMED, assert_resume_exact
from .conftest import DEMO_TRAIN, PY, SMALL, launch_prefix, run, run_matrix

STEPS = 2


def write_rows(path, n, seed=0, lengths=(1, 2, 8, 12)):
    """Conversations whose answers are 1 to 12 letters long (`lengths`): very uneven completion lengths in every
    batch."""
    rng = random.Random(seed)

    def word(k):
        return " ".join(rng.choice("abcdefghij") for _ in range(k))
    rows = [{"messages": [{"role": "user", "content": f"reverse: {word(3)}"},
                          {"role": "assistant", "content": word(rng.choice(lengths))}]} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_recipe(folder, name, student, teacher, data, distill=None, evaluate=None, packing=False, **training):
    tree = {"model": {"name_or_path": str(student), "dtype": "float32"},
            "data": {"sources": [{"path": str(data)}], "max_length": 64, "packing": packing,
                     **({"eval_sources": [{"path": str(evaluate)}]} if evaluate else {})},
            "distill": {"teacher": {"name_or_path": str(teacher), "dtype": "float32"}, **(distill or {})},
            "training": {"output_dir": str(folder / name), "seed": 0, "report_to": "none", "disable_tqdm": True,
                         "logging_steps": 1, "save_strategy": "no", **training}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A spiky student, a wider teacher (another seed) with the same tokenizer, the teacher with 8 padding rows,
    and a model with another tokenizer."""
    from transformers import AutoModelForCausalLM

    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    root, texts = tmp_path_factory.mktemp("distill_models"), texts_of_jsonl([DEMO_TRAIN])
    spiky = {**SMALL, "initializer_range": 0.3}
    student = build_tiny_model(str(root / "student"), texts, config=spiky, vocab_size=300, seed=0)
    teacher = build_tiny_model(str(root / "teacher"), texts, config={**spiky, "hidden_size": 48}, vocab_size=300,
                               seed=1)
    padded = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    padded.resize_token_embeddings(padded.config.vocab_size + 8)
    padded.save_pretrained(root / "padded")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / "padded" / name).write_bytes((root / "teacher" / name).read_bytes())
    other = build_tiny_model(str(root / "other"), texts[:40], config=SMALL, vocab_size=200, seed=0)
    return {"student": student, "teacher": teacher, "padded": str(root / "padded"), "other": other,
            "stops": stopping_student(student, root / "stops")}


def stopping_student(student, folder):
    """The student whose generation config ends a turn at every third token id as well (as Llama 3's names several
    end-of-turn tokens): its samples end after 1, 2 or 3 tokens, so on_policy micro-batches hold uneven token counts
    (with the student's own 300 ids almost every sample runs to max_new_tokens, every micro-batch has the same count
    and the per-micro-batch mean would equal the global one)."""
    import shutil

    from transformers import GenerationConfig

    shutil.copytree(student, folder)
    config = GenerationConfig.from_pretrained(folder)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    config.eos_token_id = sorted({*[e for e in eos if e is not None], *range(3, 300, 3)})
    config._from_model_config = False  # generate would otherwise rebuild it from config.json's single eos
    config.save_pretrained(folder)
    return str(folder)


def test_check_and_the_run_refuse_every_problem_at_once(tmp_path, models):
    data = write_rows(tmp_path / "rows.jsonl", 8)
    rec = write_recipe(tmp_path, "bad", models["student"], models["other"], data,
                       {"lmbda": 0.5, "beta": 0.3, "temperature": 0}, loss_averaging="sequence")
    for cmd in ([PY, "-m", "hftrain.cli", "check", str(rec)], [PY, "recipes/distill.py", str(rec)]):
        r = run(cmd)
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
        assert "Traceback" not in r.stderr
        for needed in ("distill.lmbda: applies to distill.mode: on_policy, not logits",
                       "distill.beta: applies to distill.divergence: jsd, not forward_kl",
                       "distill.temperature: must be a finite number > 0", "training.loss_averaging",
                       f"the teacher's tokenizer ({models['other']}) differs from the student's "
                       f"({models['student']})"):
            assert needed in r.stderr, (needed, cmd, r.stderr[-3000:])


def test_the_students_own_model_as_its_teacher_is_refused_unless_the_loss_has_its_cross_entropy(tmp_path, models):
    """The student's folder (or a copy of its weights) as its teacher trained with divergence 0 throughout, not a
    word: check refuses it by key; with distill.ce_weight > 0 the divergence holds the student near its start while
    the cross-entropy trains it (a use of its own), and another teacher is the control."""
    import shutil

    from hftrain.config import RecipeError
    from hftrain.launch.preflight import check_recipe

    data = write_rows(tmp_path / "rows.jsonl", 8)
    copy = shutil.copytree(models["student"], tmp_path / "copy")
    for teacher, distill in ((models["student"], {}), (copy, {}), (copy, {"mode": "on_policy", "max_new_tokens": 2})):
        rec = write_recipe(tmp_path, "itself", models["student"], teacher, data, distill,
                           per_device_train_batch_size=2)
        with pytest.raises(RecipeError, match=r"distill.teacher: .* is the student's own model .* the divergence to "
                                              r"it is 0"):
            check_recipe(str(rec))
    for teacher, distill in ((copy, {"ce_weight": 0.5}), (models["teacher"], {})):
        check_recipe(str(write_recipe(tmp_path, "fine", models["student"], teacher, data, distill,
                                      per_device_train_batch_size=2)))


def test_untested_strategies_a_missing_teacher_and_the_other_modes_options_are_refused(tmp_path, models):
    from hftrain.launch.preflight import check_recipe
    from hftrain.config import RecipeError

    data = write_rows(tmp_path / "rows.jsonl", 8)
    rec = write_recipe(tmp_path, "zero2", models["student"], models["teacher"], data,
                       {"mode": "on_policy", "ce_weight": 0.5}, per_device_train_batch_size=2)
    with pytest.raises(RecipeError) as e:
        check_recipe(str(rec), ["strategy.name=zero2"])
    text = str(e.value)
    assert "distillation runs under ddp, fsdp, zero3" in text and "not 'zero2'" in text, text
    assert "the teacher would be whole on each rank" in text and "distill.ce_weight: applies to" in text
    for strategy, why in (("zero3_offload", "keeps offload_param"), ("zero_infinity", "keeps offload_param")):
        with pytest.raises(RecipeError, match=why):
            check_recipe(str(rec), [f"strategy.name={strategy}"])
    with pytest.raises(RecipeError, match="strategy.fsdp_offload_params: distillation under fsdp"):
        check_recipe(str(rec), ["strategy.name=fsdp", "strategy.fsdp_offload_params=true"])
    missing = write_recipe(tmp_path, "missing", models["student"], tmp_path / "no_teacher", data)
    with pytest.raises(RecipeError, match="distill.teacher.name_or_path"):
        check_recipe(str(missing))
    ok = write_recipe(tmp_path, "ok", models["student"], models["padded"], data, per_device_train_batch_size=2)
    check_recipe(str(ok))  # a teacher whose vocabulary is the student's plus padding rows is accepted


def resized_teacher(teacher, folder, **config):
    """The teacher's folder with its config changed (`config`): a model of that size to the memory plan, which reads
    the config only (nothing here loads its weights)."""
    import shutil

    shutil.copytree(teacher, folder)
    tree = json.load(open(folder / "config.json"))
    (folder / "config.json").write_text(json.dumps({**tree, **config}))
    return str(folder)


def test_check_and_the_run_refuse_a_teacher_too_large_for_the_plan(tmp_path, models):
    """A 327B-parameter fp32 teacher (its config; 1.2 TiB whole on each process: check's 2, the run's 1) beside the
    tiny student: check and the run refuse it under distill.teacher, naming the fixes, exit 2, no traceback (the
    memory plan on this machine: its GPU, or without one its RAM per process)."""
    huge = resized_teacher(models["teacher"], tmp_path / "huge_teacher", hidden_size=16384, intermediate_size=53248,
                           num_hidden_layers=120, num_attention_heads=128, num_key_value_heads=8)
    rec = write_recipe(tmp_path, "huge", models["student"], huge, write_rows(tmp_path / "rows.jsonl", 8))
    for cmd in ([PY, "-m", "hftrain.cli", "check", str(rec)], [PY, "recipes/distill.py", str(rec)]):
        r = run(cmd)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
        assert re.search(rf"distill.teacher: {huge} \(326.91B parameters, frozen\) does not fit the memory plan: "
                         r"under ddp on [12] process\(es\) the frozen weights add 1217.84 GiB per device", r.stderr), (
            cmd, r.stderr[-3000:])
        for fix in ("strategy.name: fsdp or zero3", "distill.teacher.dtype: bfloat16", "distill.teacher.quantization"):
            assert fix in r.stderr, (fix, cmd)


def test_the_fit_check_counts_the_teacher_as_the_plan_does(tmp_path, models, monkeypatch):
    """With a 1 GiB device, a 0.33B fp32 teacher (1.22 GiB whole) is refused under ddp, and accepted in bfloat16 or
    sharded over 2 processes by fsdp or zero3 (the plan's P / N); the tiny student alone fits."""
    from hftrain.config import RecipeError
    from hftrain.launch import memory_checks
    from hftrain.launch.preflight import check_recipe

    monkeypatch.setattr(memory_checks, "device_memory", lambda here: (2**30, "a 1 GiB test device"))
    medium = resized_teacher(models["teacher"], tmp_path / "medium_teacher", hidden_size=1024, intermediate_size=2816,
                             num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=16)
    rec = write_recipe(tmp_path, "medium", models["student"], medium, write_rows(tmp_path / "rows.jsonl", 8),
                       per_device_train_batch_size=2)
    with pytest.raises(RecipeError, match=r"distill.teacher: .* does not fit the memory plan: under ddp on 2 "):
        check_recipe(str(rec))
    check_recipe(str(rec), ["distill.teacher.dtype=bfloat16"])
    for strategy in ("fsdp", "zero3"):
        check_recipe(str(rec), [f"strategy.name={strategy}", "strategy.num_processes=2"])
    with pytest.raises(RecipeError, match="does not fit the memory plan: under fsdp on 1 process"):
        check_recipe(str(rec), ["strategy.name=fsdp", "strategy.num_processes=1"])


EXACT = dict(optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
             train_sampling_strategy="sequential", max_steps=STEPS)
JSD = {"divergence": "jsd", "beta": 0.3, "temperature": 2.0, "ce_weight": 0.5}
ON_POLICY = {"mode": "on_policy", "max_new_tokens": 3, "temperature": 2.0}
LMBDA = {**ON_POLICY, "lmbda": 0.5}
# (losses, weights) bounds of each claim: 2 ranks x GA2 against 1 rank x GA4 (logits mode, jsd; on_policy at lmbda 1
# and 0.5), one batch of 8 against 1 rank x GA4.
TWO_RANKS = ("distill.two_ranks_vs_one.losses", "distill.two_ranks_vs_one.weights")
ONE_BATCH = ("distill.one_batch_vs_accumulated.losses", "distill.one_batch_vs_accumulated.weights")
SAMPLED = {"on_policy": ("distill.on_policy.two_ranks_vs_one.losses", "distill.on_policy.two_ranks_vs_one.weights"),
           "lmbda": ("distill.lmbda.two_ranks_vs_one.losses", "distill.lmbda.two_ranks_vs_one.weights")}


def variant(folder, name, models, data, bs, ga, module="hftrain.recipes.distill", teacher="teacher", distill=JSD,
            packing=False, **training):
    student = models["stops" if distill.get("mode") == "on_policy" else "student"]
    rec = write_recipe(folder, name, student, models[teacher], data, distill, packing=packing,
                       **{**EXACT, "per_device_train_batch_size": bs, "gradient_accumulation_steps": ga, **training})
    return module, [str(rec)]


def outcome(variants, folder, name, world=1, strategy="ddp"):
    """(losses per step, final weights) of a variant, after checking it ran with `world` processes under `strategy`."""
    variants[name].check()
    out = folder / name
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == world and info["strategy"] == strategy
    history = json.load(open(out / "trainer_state.json"))["log_history"]
    return [h["loss"] for h in history if "loss" in h], load_file(str(out / "model.safetensors"))


def saved_alike(final: dict, ref: dict) -> tuple[dict, dict]:
    """Both saves' weights, to compare: savers differ only in whether they also write the tied lm_head.weight (equal
    to the embedding), so it is compared only where both hold it."""
    both = set(final) & set(ref)
    return tuple({k: v for k, v in d.items() if k != "lm_head.weight" or k in both} for d in (final, ref))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, models):
    """Every one-process run of this module in one launch: (folder, {name: variant}, data)."""
    tmp = tmp_path_factory.mktemp("distill_one_rank")
    data, held = write_rows(tmp / "rows.jsonl", 16), write_rows(tmp / "held.jsonl", 6, seed=1)
    # rows are packed up to the batch's longest example: short answers beside long ones, so most rows hold two or three
    packable = write_rows(tmp / "packable.jsonl", 16, seed=2, lengths=(1, 1, 2, 20))
    variants = {
        "1x_ga4": variant(tmp, "1x_ga4", models, data, 2, 4),
        "1x_bs8": variant(tmp, "1x_bs8", models, data, 8, 1),
        "naive_1x_ga4": variant(tmp, "naive_1x_ga4", models, data, 2, 4, module="tests.distill_naive"),
        "padded": variant(tmp, "padded", models, data, 4, 1, teacher="padded", distill={},
                          max_steps=1),
        "held_out": ("hftrain.recipes.distill",
                     [str(write_recipe(tmp, "held_out", models["student"], models["teacher"], data, {}, held,
                                       **{**EXACT, "learning_rate": 0.05, "max_steps": 4,
                                          "eval_strategy": "steps", "eval_steps": 2},
                                       per_device_train_batch_size=4))]),
        "on_policy": variant(tmp, "on_policy", models, data, 2, 4, distill=ON_POLICY),
        "lmbda": variant(tmp, "lmbda", models, data, 2, 4, distill=LMBDA),
        "padded_1x_bs8": variant(tmp, "padded_1x_bs8", models, packable, 8, 1),
        "packed_1x_bs8": variant(tmp, "packed_1x_bs8", models, packable, 8, 1, packing=True),
        "packed_unpacked_teacher": variant(tmp, "packed_unpacked_teacher", models, packable, 8, 1, packing=True,
                                           module="tests.distill_unpacked_teacher"),
        **on_policy_resume_variants(tmp, models, data),
    }
    return tmp, run_matrix(launch_prefix(1), variants, tmp / "matrix", timeout=600), data


def on_policy_resume_variants(tmp, models, data) -> dict:
    """on_policy (its samples seeded by the step: a resume must draw what the uninterrupted run drew), 4 steps with
    AdamW and a checkpoint at step 2; resumed from it, and resumed with the weights only (the control)."""
    ck = str(tmp / "resume_whole" / "checkpoint-2")
    training = {**RESUMED, "max_steps": 4}
    return {f"resume_whole{name}": variant(tmp, f"resume_whole{name}", models, data, 2, 2, distill=ON_POLICY,
                                           **training, **more)
            for name, more in (("", {}), ("_after", {"resume_from_checkpoint": ck}),
                               ("_weights_only", {"resume_from_checkpoint": ck, "resume_weights_only": True}))}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, models, one_rank):
    tmp = tmp_path_factory.mktemp("distill_two_ranks")
    variants = {"2x_ga2": variant(tmp, "2x_ga2", models, one_rank[2], 2, 2),
                "on_policy_2x_ga2": variant(tmp, "on_policy_2x_ga2", models, one_rank[2], 2, 2, distill=ON_POLICY),
                **lmbda_variants(tmp, models, one_rank[2])}
    return tmp, run_matrix(launch_prefix(2), variants, tmp / "matrix", ranks=2, timeout=600)


def lmbda_variants(tmp, models, data):
    """lmbda 0.5 on 2 ranks x GA2 and its per-micro-batch control."""
    return {"lmbda_2x_ga2": variant(tmp, "lmbda_2x_ga2", models, data, 2, 2, distill=LMBDA),
            "naive_lmbda_2x_ga2": variant(tmp, "naive_lmbda_2x_ga2", models, data, 2, 2, module="tests.distill_naive",
                                          distill=LMBDA)}


@pytest.fixture(scope="module")
def sharded(request, tmp_path_factory, models, one_rank):
    """2 ranks x GA2 and its per-micro-batch control under a sharding strategy: one launch per strategy."""
    launches = {}

    def get(strategy):
        if strategy not in launches:
            if strategy.startswith("zero"):
                request.getfixturevalue("deepspeed_ops")
            tmp = tmp_path_factory.mktemp(f"distill_{strategy}")
            data = one_rank[2]
            variants = {"2x_ga2": variant(tmp, "2x_ga2", models, data, 2, 2),
                        "naive_2x_ga2": variant(tmp, "naive_2x_ga2", models, data, 2, 2, module="tests.distill_naive"),
                        "on_policy_2x_ga2": variant(tmp, "on_policy_2x_ga2", models, data, 2, 2, distill=ON_POLICY),
                        "naive_on_policy_2x_ga2": variant(tmp, "naive_on_policy_2x_ga2", models, data, 2, 2,
                                                          module="tests.distill_naive", distill=ON_POLICY),
                        **lmbda_variants(tmp, models, data)}
            launches[strategy] = tmp, run_matrix(launch_prefix(2, strategy), variants, tmp / "matrix", ranks=2,
                                                 timeout=900)
        return launches[strategy]

    return get


@pytest.mark.launches
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sharded_teacher_two_ranks_ga2_equal_one_rank_ga4(one_rank, sharded, strategy):
    """Under FSDP2 and ZeRO-3 the teacher is sharded over the ranks as the student (rank 0 holds about half of its
    parameters: trl's prepare_fsdp / prepare_deepspeed), and 2 ranks x GA2 give 1 rank x GA4's losses and weights
    (fp32, within their bounds); the per-micro-batch mean does not."""
    tmp1, variants1, _ = one_rank
    ref_loss, ref = outcome(variants1, tmp1, "1x_ga4")
    tmp, variants = sharded(strategy)
    losses, final = outcome(variants, tmp, "2x_ga2", 2, strategy)
    within("distill.two_ranks_vs_one.losses", losses, ref_loss)
    within("distill.two_ranks_vs_one.weights", *saved_alike(final, ref))
    placed = re.search(r"distill.teacher: placed by .*: rank 0 holds ([\d,]+) of its ([\d,]+) parameters",
                       variants["2x_ga2"].stdout + variants["2x_ga2"].stderr)
    held, total = (int(g.replace(",", "")) for g in placed.groups())
    assert held <= 0.6 * total, (held, total)
    if strategy == "fsdp":  # per layer, as the student: TRL's prepare_fsdp gathered the whole teacher for a forward
        unit = int(re.search(r"at most ([\d,]+) gathered at once", placed.string).group(1).replace(",", ""))
        assert unit <= 0.6 * total, (unit, total)
    naive_loss, naive = outcome(variants, tmp, "naive_2x_ga2", 2, strategy)
    beyond("distill.two_ranks_vs_one.losses", naive_loss, ref_loss)
    beyond("distill.two_ranks_vs_one.weights", *saved_alike(naive, ref))


@pytest.mark.launches
def test_two_ranks_ga2_equal_one_rank_ga4_and_one_batch(one_rank, two_ranks):
    """The loss is the sum over the step's completion tokens / their global count: 2 ranks x GA2 (micro-batch 2),
    1 rank x GA4 and one batch of 8 give the same losses and weights (jsd, temperature 2, ce_weight 0.5); each
    micro-batch's own mean averaged over the accumulation steps does not (answers of 1 to 12 letters)."""
    tmp, variants, _ = one_rank
    ref_loss, ref = outcome(variants, tmp, "1x_ga4")
    for folder, found, name, world, bounds in ((tmp, variants, "1x_bs8", 1, ONE_BATCH),
                                               (*two_ranks, "2x_ga2", 2, TWO_RANKS)):
        losses, final = outcome(found, folder, name, world)
        within(bounds[0], losses, ref_loss, label=name)
        within(bounds[1], *saved_alike(final, ref), label=name)
    naive_loss, naive = outcome(variants, tmp, "naive_1x_ga4")
    for bounds in (ONE_BATCH, TWO_RANKS):
        beyond(bounds[0], naive_loss, ref_loss)
        beyond(bounds[1], *saved_alike(naive, ref))


@pytest.mark.launches
def test_a_teacher_with_padding_rows_is_aligned_and_said(one_rank, models):
    tmp, variants, _ = one_rank
    outcome(variants, tmp, "padded")
    size = json.load(open(f"{models['student']}/config.json"))["vocab_size"]
    said = f"vocabulary sizes differ only by padding (student {size}, teacher {size + 8})"
    assert said in variants["padded"].stdout + variants["padded"].stderr


@pytest.mark.launches
def test_held_out_loss_and_divergence_before_and_after_and_the_card(one_rank):
    tmp, variants, _ = one_rank
    variants["held_out"].check()
    info = json.load(open(tmp / "held_out" / "run_info.json"))
    metrics = info["metrics"]
    # eval_loss is the divergence to the teacher it trains on, at every evaluation (as TRL's GKD reports it): it was
    # the student's cross-entropy, so metric_for_best_model, early stopping and the curves followed another number
    assert metrics["final_eval_loss"] < metrics["initial_eval_loss"], metrics
    assert metrics["final_eval_ce"] != metrics["final_eval_loss"] and "final_eval_divergence" not in metrics
    evals = [h for h in json.load(open(tmp / "held_out" / "trainer_state.json"))["log_history"] if "eval_loss" in h]
    # the evaluations before and after (steps 0 and 4) beside the scheduled ones (steps 2 and 4)
    assert [h["step"] for h in evals] == [0, 2, 4, 4] and all("eval_ce" in h for h in evals)
    assert evals[-1]["eval_loss"] == pytest.approx(metrics["final_eval_loss"], rel=1e-6)
    assert "distillation from" in info["method"]["description"] and "logits mode" in info["method"]["description"]
    assert info["method"]["tag"] == "knowledge-distillation"


@pytest.mark.launches
def test_on_policy_trains_on_the_students_samples(one_rank):
    """on_policy (lambda 1): every micro-batch is the student's samples of at most 3 tokens, so a step counts at most
    8 x 3 completion tokens (the dataset's answers of the same rows are up to 12 letters: far more)."""
    tmp, variants, _ = one_rank
    variants["on_policy"].check()
    history = json.load(open(tmp / "on_policy" / "trainer_state.json"))["log_history"]
    counted = [h["target_tokens_per_step"] for h in history if "loss" in h]
    assert len(counted) == STEPS and all(0 < c <= 8 * 3 for c in counted), history


@pytest.mark.launches
def test_packed_rows_distill_as_padded_ones(one_rank):
    """data.packing: the teacher is fed the student's packed rows and loaded as the student is for them (no KV cache:
    transformers masks packed examples apart from position_ids only without one). The packed run equals the padded
    batch of the same 8 rows; the teacher loaded without the packing options (each example after the first in a row
    distilled against a teacher that saw the examples before it) is the control."""
    tmp, variants, _ = one_rank
    ref_loss, ref = outcome(variants, tmp, "padded_1x_bs8")
    losses, final = outcome(variants, tmp, "packed_1x_bs8")
    within("distill.packed_vs_padded.losses", losses, ref_loss)
    within("distill.packed_vs_padded.weights", *saved_alike(final, ref))
    wrong_loss, wrong = outcome(variants, tmp, "packed_unpacked_teacher")
    beyond("distill.packed_vs_padded.losses", wrong_loss, ref_loss)
    beyond("distill.packed_vs_padded.weights", *saved_alike(wrong, ref))


@pytest.mark.launches
def test_a_resumed_on_policy_run_samples_and_ends_as_the_uninterrupted_one(one_rank):
    tmp, variants, _ = one_rank
    assert_resume_exact(tmp, variants, "whole", "distill.on_policy")


@pytest.mark.launches
def test_on_policy_two_ranks_ga2_equal_one_rank_ga4(one_rank, two_ranks):
    """Each row samples from a generator seeded by the run's seed, the step and its prompt: 2 ranks x GA2 sample what
    1 rank x GA4 samples, so the step's token counts, losses and weights agree (reverse KL, lambda 1, fp32,
    SAMPLED's bounds); with the ranks' own generators (before) the samples, and so the losses, differ."""
    tmp, variants, _ = one_rank
    ref_loss, ref = outcome(variants, tmp, "on_policy")
    losses, final = outcome(two_ranks[1], two_ranks[0], "on_policy_2x_ga2", 2)
    assert counted_tokens(tmp, "on_policy") == counted_tokens(two_ranks[0], "on_policy_2x_ga2")
    within("distill.on_policy.two_ranks_vs_one.losses", losses, ref_loss)
    within("distill.on_policy.two_ranks_vs_one.weights", *saved_alike(final, ref))


def counted_tokens(folder, name):
    """The step's completion-token count over every rank and micro-batch, per logged step."""
    history = json.load(open(folder / name / "trainer_state.json"))["log_history"]
    return [h["target_tokens_per_step"] for h in history if "loss" in h]


def assert_exact_with_control(one_rank, reference, found, folder, name, world=2, strategy="ddp"):
    """`name` (2 ranks x GA2) has 1 rank x GA4's token counts, losses and weights (within SAMPLED's bounds); its
    per-micro-batch control (`naive_` + name) does not. `reference`: the 1-rank variant, on_policy or lmbda."""
    tmp, variants, _ = one_rank
    bounds = SAMPLED[reference]
    ref_loss, ref = outcome(variants, tmp, reference)
    losses, final = outcome(found, folder, name, world, strategy)
    assert counted_tokens(folder, name) == counted_tokens(tmp, reference)
    within(bounds[0], losses, ref_loss)
    within(bounds[1], *saved_alike(final, ref))
    naive_loss, naive = outcome(found, folder, f"naive_{name}", world, strategy)
    beyond(bounds[0], naive_loss, ref_loss)
    beyond(bounds[1], *saved_alike(naive, ref))


@pytest.mark.launches
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
@pytest.mark.parametrize("mode", ["on_policy", "lmbda"])
def test_on_policy_sharded_two_ranks_ga2_equal_one_rank_ga4(one_rank, sharded, strategy, mode):
    """on_policy under FSDP2 (the student sharded: every rank runs as many generate forwards) and ZeRO-3 (the student
    gathered whole for the step's sampling): 2 ranks x GA2 sample what 1 rank x GA4 samples and train to its losses
    and weights (fp32, within SAMPLED's bounds), at lmbda 1 and 0.5 (where the ranks sample different numbers of
    rows); samples end after 1 to 3 tokens (stopping_student), so the per-micro-batch mean differs."""
    tmp, variants = sharded(strategy)
    assert_exact_with_control(one_rank, mode, variants, tmp, f"{mode}_2x_ga2", strategy=strategy)


@pytest.mark.launches
def test_lmbda_is_decided_per_row_so_two_ranks_ga2_equal_one_rank_ga4(one_rank, two_ranks):
    """lmbda 0.5: each row trains on the student's sample or on its dataset completion by a draw from the seed, the
    step and its tokens (on_policy.picked), so 2 ranks x GA2 pick the rows 1 rank x GA4 picks: token counts, losses
    and weights agree (SAMPLED's bounds; a coin per micro-batch, as TRL's GKDTrainer draws, picks other rows), and the
    per-micro-batch mean differs. The steps mix both: their counts are neither all-sampled nor all-dataset ones."""
    tmp, variants, _ = one_rank
    assert_exact_with_control(one_rank, "lmbda", two_ranks[1], two_ranks[0], "lmbda_2x_ga2")
    mixed = counted_tokens(tmp, "lmbda")
    outcome(variants, tmp, "1x_ga4")
    assert all(m not in (s, d) for m, s, d in zip(mixed, counted_tokens(tmp, "on_policy"),
                                                 counted_tokens(tmp, "1x_ga4"))), mixed
