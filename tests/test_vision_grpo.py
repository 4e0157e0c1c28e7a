"""GRPO on an image-text-to-text model (issue 65: images an axis any method can use): prompts with images read and
checked before the model loads (hftrain/vision/image_prompts.py), their images decoded by hftrain when TRL's
GRPOTrainer reads them, trained through the same GRPO method as text (methods/modality.py). Exact like text GRPO
(tests/test_grpo_runs.py, whose seeded worker tests/grpo_vision_worker.py extends to image fields): 2 ranks x GA2
give 1 rank x GA4's weights under DDP, FSDP2 and ZeRO-3 (a tiny Qwen2.5-VL; a tiny LLaVA under DDP), where TRL's
bnpo (each micro-batch's own token mean) does not."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hftrain.config import DataSection, DataSource
from hftrain.errors import DataError
from hftrain.tiny import build_tiny_vision_model
from hftrain.vision.families import processor_class
from hftrain.vision.image_prompts import read_image_prompts
from hftrain.vision.processor import load_processor
from tests.exactness import beyond, within

from .conftest import ACCELERATE_LAUNCH, PY, launch_prefix, run, run_matrix
from .support import free_port
from .test_vision_exact import COLOURS, _square, compared_weights

# The families GRPO on images is measured on across ranks (its bounds' figures); issue 66's other families are trained
# on 1 rank (test_issue_66s_other_families_generate_and_train): the same modality code, TRL's own generation.
FAMILIES = ["qwen2_5_vl", "llava"]
OTHER_FAMILIES = ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "llava_next", "gemma3", "idefics3"]

QUESTION = "what colour is the square"


def write_prompts(folder, n: int, name: str = "rows") -> str:
    """Image rows of one square each (SFT's layouts: a content part, or an images column with a marker), the
    square's colour the answer."""
    rows = []
    for i in range(n):
        image, colour = _square(folder, i), COLOURS[(i // 4) % 4]
        if i % 2:
            rows.append({"images": [image], "messages": [{"role": "user", "content": f"<image>{QUESTION}"},
                                                         {"role": "assistant", "content": colour}]})
        else:
            rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                                   {"type": "text", "text": QUESTION}]},
                                      {"role": "assistant", "content": colour}]})
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(folder, tiny models by family, 16 rows)."""
    root = tmp_path_factory.mktemp("vision_grpo")
    models = {f: build_tiny_vision_model(str(root / f), (COLOURS + [QUESTION]) * 20, f, vocab_size=320)
              for f in FAMILIES}
    return root, models, write_prompts(root, 16)


def _processor(models, family="qwen2_5_vl"):
    return load_processor(models[family], processor_class(family))


def test_rows_become_prompts_with_their_images_and_references(setup):
    root, models, rows = setup
    data = read_image_prompts(DataSection(sources=[DataSource(path=rows)], eval_fraction=0.25, max_length=256),
                              _processor(models), 4, seed=0, exact_match=2, needs_reference="exact_match")
    assert len(data.train) == 12 and len(data.eval_examples) == 2
    row = data.train[0]  # decoded when read: the images as TRL takes them
    assert [m["role"] for m in row["prompt"]] == ["user"] and row["reference"] in COLOURS
    assert [p["type"] for p in row["prompt"][0]["content"]] == ["image", "text"]
    assert type(row["images"][0]).__name__ == "Image" and row["images"][0].mode == "RGB"
    example = data.eval_examples[0]
    assert example["images"][0].startswith(str(root)) and example["reference"] in COLOURS


@pytest.mark.parametrize("row,said", [
    ({"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "red"}]},
     "the prompt has no image"),
    ({"images": ["square0.png"], "messages": [{"role": "user", "content": QUESTION},
                                              {"role": "assistant", "content": "<image>red"}]},
     "the answer .* holds an image"),
    ({"images": ["square0.png"], "messages": [{"role": "user", "content": f"<image>{QUESTION}"}]},
     "has no reference answer"),
])
def test_a_bad_row_is_refused_naming_the_file_and_row(setup, tmp_path, row, said):
    root, models, _ = setup
    (tmp_path / "square0.png").write_bytes((root / "square0.png").read_bytes())
    path = tmp_path / "bad.jsonl"
    good = {"images": ["square0.png"], "messages": [{"role": "user", "content": f"<image>{QUESTION}"},
                                                    {"role": "assistant", "content": "red"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=said) as e:
        read_image_prompts(DataSection(sources=[DataSource(path=str(path))], max_length=256), _processor(models), 4,
                           seed=0, needs_reference="grpo.rewards.0 (exact_match)")
    assert f"data.sources.0 ({path}:2)" in str(e.value)


def test_a_prompt_too_long_is_refused_or_left_out_and_named(setup, capsys):
    _, models, rows = setup
    processor = _processor(models, "llava")  # every prompt the same length: its image's tokens and the question
    kept = len(read_image_prompts(DataSection(sources=[DataSource(path=rows)], max_length=256), processor, 4,
                                  seed=0).train)
    assert kept == 16
    with pytest.raises(DataError, match="raise data.max_length, or set data.truncation: drop"):
        read_image_prompts(DataSection(sources=[DataSource(path=rows)], max_length=12), processor, 4, seed=0)
    with pytest.raises(DataError, match="no prompt of .* is left to train on"):
        read_image_prompts(DataSection(sources=[DataSource(path=rows)], max_length=12, truncation="drop"),
                           processor, 4, seed=0)
    assert "16 of 16 prompts" in capsys.readouterr().err


def _recipe(folder, name, models, family, rows, **training) -> str:
    tree = {"model": {"name_or_path": models[family], "dtype": "float32", "attn_implementation": "sdpa"},
            "data": {"sources": [{"path": rows}], "max_length": 256},
            "grpo": {"rewards": [{"function": "tests/grpo_vision_worker.py:token_spread"}], "num_generations": 4,
                     "max_completion_length": 6, "temperature": 1.0},
            "eval": {"exact_match": 0},
            "training": {"output_dir": str(folder / name), "report_to": "none", "disable_tqdm": True,
                         "logging_steps": 1, "save_strategy": "no", "seed": 0, **training}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def layout_runs(folder, setup, family, world, strategy, names) -> dict:
    """tests/grpo_vision_worker.py: the variants `names`, 2 optimizer steps of 8 completions (2 prompts x 4), SGD."""
    _, models, rows = setup
    rec = _recipe(folder, f"{family}_{world}x_{strategy}", models, family, rows, max_steps=2,
                  per_device_train_batch_size=2, gradient_accumulation_steps=4 // world, optim="sgd",
                  learning_rate=0.1, max_grad_norm=0.0, weight_decay=0.0, lr_scheduler_type="constant",
                  train_sampling_strategy="sequential")
    out = folder / f"{family}_{world}x_{strategy}_out"
    cmd = [PY, "tests/grpo_vision_worker.py"] if world == 1 else [
        *ACCELERATE_LAUNCH, "--config_file", f"accelerate_configs/{strategy}.yaml", "--main_process_port",
        str(free_port()), "tests/grpo_vision_worker.py"]
    done = run([*cmd, rec, str(out), *names], timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    weights = {}
    for name in names:
        info = json.load(open(out / name / "run_info.json"))
        assert info["world_size"] == world and info["strategy"] == strategy and info["global_step"] == 2
        architecture = json.load(open(out / name / "config.json"))["architectures"][0]
        assert architecture.endswith("ForConditionalGeneration"), architecture  # the image model, saved whole
        stds = [h["reward_std"] for h in json.load(open(out / name / "trainer_state.json"))["log_history"]
                if "reward_std" in h]
        assert stds and all(s > 0 for s in stds), stds  # rewards differ within groups: the advantages are not all 0
        weights[name] = load_file(str(out / name / "model.safetensors"))
    return weights


VARIANTS = ["grpo", "dapo"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, setup):
    tmp = tmp_path_factory.mktemp("vision_grpo_1x")
    return {family: layout_runs(tmp, setup, family, 1, "ddp", VARIANTS + ["bnpo"]) for family in FAMILIES}


@pytest.mark.launches
@pytest.mark.parametrize("strategy,family", [("ddp", "qwen2_5_vl"), ("ddp", "llava"), ("fsdp", "qwen2_5_vl"),
                                             ("zero3", "qwen2_5_vl")])
def test_two_ranks_ga2_equal_one_rank_ga4(tmp_path, setup, one_rank, strategy, family, request):
    """grpo (KL to a frozen copy, two updates per generation batch, clipping) and dapo (the global token count):
    2 ranks x GA2 train the weights 1 rank x GA4 does; TRL's bnpo (each micro-batch's own token mean) does not."""
    if strategy.startswith("zero"):
        request.getfixturevalue("deepspeed_ops")
    two = layout_runs(tmp_path, setup, family, 2, strategy, VARIANTS + ["bnpo"])
    ref = one_rank[family]
    for name in VARIANTS:
        within("vision_grpo.two_ranks_vs_one.weights", *compared_weights(two[name], ref[name]),
               label=f"{strategy} {family} {name}")
    beyond("vision_grpo.two_ranks_vs_one.weights", *compared_weights(two["bnpo"], ref["bnpo"]),
           label=f"{strategy} {family} bnpo")


@pytest.mark.launches
def test_issue_66s_other_families_generate_and_train(tmp_path):
    """Each of the six other families, in one launch: hftrain grpo (TRL's generation of 4 completions per prompt
    with the prompt's image, the token_spread reward), 1 step of SGD; each run logs a reward, moves the weights and
    saves the image model whole (its class, its processor)."""
    models = {f: build_tiny_vision_model(str(tmp_path / "base" / f), (COLOURS + [QUESTION]) * 20, f, vocab_size=320)
              for f in OTHER_FAMILIES}
    rows = write_prompts(tmp_path, 8)
    variants = {f: ("hftrain.recipes.grpo", [_recipe(tmp_path, f, models, f, rows, max_steps=1, optim="sgd",
                                                     learning_rate=0.5, per_device_train_batch_size=4,
                                                     gradient_accumulation_steps=1)])
                for f in OTHER_FAMILIES}
    done = run_matrix(launch_prefix(1), variants, tmp_path / "matrix", timeout=900)
    for family in OTHER_FAMILIES:
        done[family].check()
        out = tmp_path / family
        history = json.load(open(out / "trainer_state.json"))["log_history"]
        assert [h["step"] for h in history if "reward" in h] == [1], family
        architecture = json.load(open(out / "config.json"))["architectures"][0]
        assert architecture.endswith("ForConditionalGeneration"), (family, architecture)
        assert load_processor(str(out), processor_class(family)).chat_template, family
        before, after = load_file(f"{models[family]}/model.safetensors"), load_file(str(out / "model.safetensors"))
        assert any(not torch.equal(after[k], before[k]) for k in before if k in after), family


@pytest.mark.launches
def test_the_vision_grpo_demo_recipe_reports_held_out_exact_match(tmp_path):
    """The shipped demo (recipes/demo/vision_grpo.yaml on the vision demo's rows and images) runs as its header says
    on a tiny base, cut to two steps: held-out exact match before and after, the processor saved."""
    from .conftest import REPO

    base, out = str(tmp_path / "base"), str(tmp_path / "out")
    done = run([".venv/bin/hftrain", "tiny-model", "--vision", "qwen2_5_vl", "--data",
                "data/demo/vision_train.jsonl", "--output", base], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    done = run([".venv/bin/hftrain", "grpo", f"{REPO}/recipes/demo/vision_grpo.yaml", f"model.name_or_path={base}",
                f"training.output_dir={out}", "training.max_steps=2", "eval.exact_match=6"], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hftrain: exact_match: before " in done.stdout + done.stderr
    with open(f"{out}/run_info.json") as f:
        info = json.load(f)
    assert info["method"]["head"] == "image_text_to_text"
    assert {"initial_exact_match", "final_exact_match"} <= set(info["metrics"])
    assert load_processor(out, processor_class("qwen2_5_vl")).chat_template  # saved beside the model


def test_the_noisy_demonstrations_are_remade_byte_for_byte(tmp_path):
    """recipes/demo/make_vision_noisy.py remakes the committed noisy rows from the vision demo's: only red and blue
    answers changed, to orange and purple, most of them."""
    import runpy
    import shutil

    from .conftest import REPO

    shutil.copy(f"{REPO}/data/demo/vision_train.jsonl", tmp_path)
    runpy.run_path(f"{REPO}/recipes/demo/make_vision_noisy.py")["main"](str(tmp_path))
    made = (tmp_path / "vision_noisy_train.jsonl").read_bytes()
    assert made == open(f"{REPO}/data/demo/vision_noisy_train.jsonl", "rb").read()
    clean = [json.loads(line) for line in open(f"{REPO}/data/demo/vision_train.jsonl")]
    noisy = [json.loads(line) for line in made.decode().splitlines()]
    changed = [(c["messages"][1]["content"], n["messages"][1]["content"]) for c, n in zip(clean, noisy)
               if c != n]
    assert set(changed) == {("red", "orange"), ("blue", "purple")}
    reds = sum(c["messages"][1]["content"] == "red" for c in clean)
    assert sum(1 for c, _ in changed if c == "red") > reds / 2  # mostly wrong: the greedy answer is the wrong one
