"""DPO on an image-text-to-text model (issue 65: images an axis any method can use): pairs with images read and checked
before the model loads (hftrain/vision/image_pairs.py), batched by TRL's vision collator from images decoded as
hftrain decodes them, trained through the same DPO method as text (methods/modality.py gives it its rows, model and
arguments). Exact like every method: a tiny Qwen2.5-VL and a tiny LLaVA, 2 ranks x GA2 against 1 rank x GA4 under DDP,
FSDP2 and ZeRO-3 (losses and weights), with each row given the next row's images as the control; micro-batches of 4
and 2 pairs against one batch of 6, with TRL's mean of micro-batch means as the control."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from hftrain.config import DataSection, DataSource
from hftrain.errors import DataError
from hftrain.tiny import build_tiny_vision_model
from hftrain.vision.families import processor_class
from hftrain.methods.pairs import ImagePairs
from hftrain.vision.image_pairs import prompt_tokens, read_image_pairs
from hftrain.vision.processor import load_processor
from tests.exactness import beyond, within

from .conftest import launch_prefix, run_matrix
from .test_vision_exact import COLOURS, FAMILIES as ALL_FAMILIES, _square, compared_weights

# Every checked family trains on 1 rank and on 2 under DDP; the first two also under FSDP2 and ZeRO-3, with the
# swapped-images control (the pairs' collation is the same code for all: TRL's, given hftrain's decoding).
FAMILIES = ["qwen2_5_vl", "llava"]


def families_under(strategy: str) -> list[str]:
    return ALL_FAMILIES if strategy == "ddp" else FAMILIES

EXACT = dict(optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
             train_sampling_strategy="sequential")
QUESTION = "what colour is the square"


def write_pairs(folder, n: int, name: str = "pairs") -> str:
    """Pairs on squares of four sizes: chosen the square's colour (1 to 4 words), rejected the next colour; every
    other row in the images-column layout with an <image> marker, the others with the image in a content part."""
    rows = []
    for i in range(n):
        image, colour = _square(folder, i), COLOURS[(i // 4) % 4]
        chosen, rejected = " ".join([colour] * (1 + i % 4)), COLOURS[(i // 4 + 1) % 4]
        if i % 2:
            rows.append({"images": [image], "prompt": [{"role": "user", "content": f"<image>{QUESTION}"}],
                         "chosen": chosen, "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            rows.append({"prompt": [{"role": "user", "content": [{"type": "image", "image": image},
                                                                 {"type": "text", "text": QUESTION}]}],
                         "chosen": [{"role": "assistant", "content": chosen}], "rejected": rejected})
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(folder, tiny models by family, 16 pairs, 6 pairs)."""
    root = tmp_path_factory.mktemp("vision_dpo")
    words = COLOURS + [QUESTION]
    models = {f: build_tiny_vision_model(str(root / f), words * 20, f, vocab_size=320) for f in ALL_FAMILIES}
    return root, models, write_pairs(root, 16), write_pairs(root, 6, "six")


def _data(path: str, max_length: int = 256, **source) -> DataSection:
    return DataSection(sources=[DataSource(path=path, **source)], max_length=max_length)


def test_both_layouts_read_as_one_canonical_pair(setup):
    root, models, pairs, _ = setup
    processor = load_processor(models["qwen2_5_vl"], processor_class("qwen2_5_vl"))
    train, held_out = read_image_pairs(_data(pairs), processor, seed=0)
    assert held_out is None and len(train) == 16
    by_image = {row["images"][0]: row for row in train}
    marked, parts = by_image[str(root / "square1.png")], by_image[str(root / "square0.png")]  # <image>; a part
    for row in (marked, parts):
        assert [p["type"] for p in row["prompt"][0]["content"]] == ["image", "text"]
        assert row["prompt"][0]["content"][1]["text"] == QUESTION
        assert [m["role"] for m in row["chosen"] + row["rejected"]] == ["assistant", "assistant"]
    assert marked["chosen"][0]["content"][0]["text"] == "red red" and parts["rejected"][0]["content"][0]["text"] == (
        "blue")


@pytest.mark.parametrize("row,said", [
    ({"prompt": [{"role": "user", "content": QUESTION}], "chosen": "red", "rejected": "blue"}, "the pair has no image"),
    ({"images": ["square0.png"], "prompt": "<image>" + QUESTION, "chosen": "red", "rejected": "red"},
     "chosen equals rejected"),
    ({"images": ["square0.png"], "prompt": "<image>" + QUESTION, "chosen": " ", "rejected": "red"}, "chosen is empty"),
    ({"images": ["missing.png"], "prompt": "<image>" + QUESTION, "chosen": "red", "rejected": "blue"},
     "does not exist"),
    ({"images": ["square0.png"], "chosen": "red", "rejected": "blue"}, "needs a 'prompt' column"),
])
def test_a_bad_pair_is_refused_naming_the_file_and_row(setup, tmp_path, row, said):
    root, models, _, _ = setup
    (tmp_path / "square0.png").write_bytes((root / "square0.png").read_bytes())
    path = tmp_path / "bad.jsonl"
    good = {"images": ["square0.png"], "prompt": "<image>" + QUESTION, "chosen": "red", "rejected": "blue"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    processor = load_processor(models["llava"], processor_class("llava"))
    with pytest.raises(DataError, match=said) as e:
        read_image_pairs(_data(str(path)), processor, seed=0)
    assert f"data.sources.0 ({path}:2)" in str(e.value)


def test_pairs_whose_prompt_fills_max_length_are_left_out_and_named(setup, capsys):
    """Qwen2.5-VL's image tokens grow with the image: at a max_length the largest squares' prompts fill, those pairs
    are left out and named; at one no prompt fits, the run stops naming data.max_length."""
    _, models, pairs, _ = setup
    processor = load_processor(models["qwen2_5_vl"], processor_class("qwen2_5_vl"))
    train, _ = read_image_pairs(_data(pairs), processor, seed=0)
    lengths = sorted({prompt_tokens(processor, row) for row in train})
    assert len(lengths) > 1, lengths
    kept, _ = read_image_pairs(_data(pairs, max_length=lengths[-1]), processor, seed=0)
    longest = sum(prompt_tokens(processor, row) == lengths[-1] for row in train)
    assert len(kept) == 16 - longest
    said = capsys.readouterr().err
    assert f"{longest} of 16 pairs" in said and f"fills data.max_length={lengths[-1]} tokens" in said, said
    with pytest.raises(DataError, match=f"raise data.max_length above {lengths[0]}"):
        read_image_pairs(_data(pairs, max_length=lengths[0]), processor, seed=0)


def test_a_16_bit_image_is_batched_as_its_8_bit_twin(setup, tmp_path):
    """TRL's collator is given images decoded by hftrain (images.open_rgb): a 16-bit grey image at 40% is batched as
    the 8-bit grey image at 40%, not clipped to white."""
    _, models, _, _ = setup
    Image.fromarray(np.full((56, 56), 26214, dtype=np.uint16)).save(tmp_path / "grey16.png")
    Image.fromarray(np.full((56, 56), 102, dtype=np.uint8)).save(tmp_path / "grey8.png")
    rows = [{"images": [name], "prompt": "<image>" + QUESTION, "chosen": "grey", "rejected": "white"}
            for name in ("grey16.png", "grey8.png")]
    (tmp_path / "grey.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = load_processor(models["qwen2_5_vl"], processor_class("qwen2_5_vl"))
    train, _ = read_image_pairs(_data(str(tmp_path / "grey.jsonl")), processor, seed=0)
    collate = ImagePairs(processor, 256)
    sixteen, eight = (collate([train[i]])["pixel_values"] for i in range(2))
    assert torch.equal(sixteen, eight)


def _variant(folder, name, setup, family, bs, ga, steps, data=None, control=None):
    root, models, pairs, _ = setup
    tree = {"model": {"name_or_path": models[family], "dtype": "float32", "attn_implementation": "sdpa"},
            "data": {"sources": [{"path": data or pairs}], "max_length": 256},
            "preference": {"loss_type": "sigmoid", "beta": 0.5},
            "training": {"output_dir": str(folder / name), "seed": 0, "report_to": "none", "disable_tqdm": True,
                         "logging_steps": 1, "save_strategy": "no", "per_device_train_batch_size": bs,
                         "gradient_accumulation_steps": ga, "max_steps": steps, **EXACT}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    if control:
        return "tests.vision_dpo_controls", [control, str(path)]
    return "hftrain.recipes.dpo", [str(path)]


def _outcome(variants, folder, name, world=1, strategy="ddp"):
    variants[name].check()
    out = folder / name
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == world and info["strategy"] == strategy and info["method"]["head"] == (
        "image_text_to_text")
    history = json.load(open(out / "trainer_state.json"))["log_history"]
    return [h["loss"] for h in history if "loss" in h], load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, setup):
    tmp = tmp_path_factory.mktemp("vision_dpo_one_rank")
    six = setup[3]
    variants = {f"{f}_1x_ga4": _variant(tmp, f"{f}_1x_ga4", setup, f, 2, 4, 2) for f in ALL_FAMILIES}
    variants["bs6"] = _variant(tmp, "bs6", setup, FAMILIES[0], 6, 1, 1, data=six)
    variants["bs4_ga2"] = _variant(tmp, "bs4_ga2", setup, FAMILIES[0], 4, 2, 1, data=six)
    variants["naive_bs4_ga2"] = _variant(tmp, "naive_bs4_ga2", setup, FAMILIES[0], 4, 2, 1, data=six,
                                         control="mean_of_means")
    return tmp, run_matrix(launch_prefix(1), variants, tmp / "matrix", timeout=900)


@pytest.mark.launches
def test_unequal_micro_batches_give_the_global_pair_mean(one_rank):
    """6 image pairs in one step: micro-batches of 4 and 2 train as one batch of 6; TRL's mean of the two
    micro-batch means (the short one's pairs weigh double) does not."""
    tmp, variants = one_rank
    ref_loss, ref = _outcome(variants, tmp, "bs6")
    losses, final = _outcome(variants, tmp, "bs4_ga2")
    within("vision_dpo.unequal_micro_batches_vs_one_batch.losses", losses, ref_loss)
    within("vision_dpo.unequal_micro_batches_vs_one_batch.weights", *compared_weights(final, ref))
    naive_loss, naive = _outcome(variants, tmp, "naive_bs4_ga2")
    beyond("vision_dpo.unequal_micro_batches_vs_one_batch.losses", naive_loss, ref_loss)
    beyond("vision_dpo.unequal_micro_batches_vs_one_batch.weights", *compared_weights(naive, ref))


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory, setup):
    """2 ranks x GA2 of both families and the swapped-images control, one launch per strategy."""
    launches = {}

    def get(strategy):
        if strategy not in launches:
            if strategy.startswith("zero"):
                request.getfixturevalue("deepspeed_ops")
            tmp = tmp_path_factory.mktemp(f"vision_dpo_{strategy}")
            variants = {}
            for f in families_under(strategy):
                variants[f"{f}_2x_ga2"] = _variant(tmp, f"{f}_2x_ga2", setup, f, 2, 2, 2)
            for f in FAMILIES:
                variants[f"{f}_swapped_2x_ga2"] = _variant(tmp, f"{f}_swapped_2x_ga2", setup, f, 2, 2, 2,
                                                           control="images_swapped")
            launches[strategy] = tmp, run_matrix(launch_prefix(2, strategy), variants, tmp / "matrix", ranks=2,
                                                 timeout=900)
        return launches[strategy]

    return get


@pytest.mark.launches
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_two_ranks_ga2_equal_one_rank_ga4(one_rank, two_ranks, strategy):
    """Every micro-batch holds 2 pairs, so TRL's mean of micro-batch means is the global pair mean here (the unequal
    test above holds the pair mean's control); the control is each pair given the next pair's image."""
    tmp1, variants1 = one_rank
    tmp, variants = two_ranks(strategy)
    for family in families_under(strategy):
        ref_loss, ref = _outcome(variants1, tmp1, f"{family}_1x_ga4")
        losses, final = _outcome(variants, tmp, f"{family}_2x_ga2", 2, strategy)
        within("vision_dpo.two_ranks_vs_one.losses", losses, ref_loss, label=f"{strategy} {family}")
        within("vision_dpo.two_ranks_vs_one.weights", *compared_weights(final, ref), label=f"{strategy} {family}")
        if family not in FAMILIES:
            continue
        swapped_loss, swapped = _outcome(variants, tmp, f"{family}_swapped_2x_ga2", 2, strategy)
        beyond("vision_dpo.two_ranks_vs_one.losses", swapped_loss, ref_loss, label=f"{strategy} {family}")
        beyond("vision_dpo.two_ranks_vs_one.weights", *compared_weights(swapped, ref), label=f"{strategy} {family}")


def test_the_demo_pairs_are_remade_byte_for_byte(tmp_path):
    """recipes/demo/make_vision_pairs.py remakes the committed pairs from the vision demo's rows."""
    import runpy
    import shutil

    from .conftest import REPO

    for split in ("train", "eval"):
        shutil.copy(f"{REPO}/data/demo/vision_{split}.jsonl", tmp_path)
    runpy.run_path(f"{REPO}/recipes/demo/make_vision_pairs.py")["main"](str(tmp_path))
    for split in ("train", "eval"):
        name = f"vision_pairs_{split}.jsonl"
        assert (tmp_path / name).read_bytes() == open(f"{REPO}/data/demo/{name}", "rb").read(), name


@pytest.mark.launches
def test_the_vision_dpo_demo_recipe_reports_held_out_preference_accuracy(tmp_path):
    """The shipped demo (recipes/demo/vision_dpo.yaml, its pairs and the vision demo's images) runs as its header
    says on a tiny base, cut to two steps: held-out preference accuracy before and after, the processor saved."""
    from .conftest import REPO, run

    base, out = str(tmp_path / "base"), str(tmp_path / "out")
    done = run([".venv/bin/hftrain", "tiny-model", "--vision", "qwen2_5_vl", "--data",
                "data/demo/vision_train.jsonl", "--output", base], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    done = run([".venv/bin/hftrain", "dpo", f"{REPO}/recipes/demo/vision_dpo.yaml", f"model.name_or_path={base}",
                f"training.output_dir={out}", "training.max_steps=2"], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hftrain: eval_rewards/accuracies: before 0.0000 -> after " in done.stdout + done.stderr
    with open(f"{out}/run_info.json") as f:
        info = json.load(f)
    assert info["method"]["head"] == "image_text_to_text"
    assert {"initial_eval_rewards/accuracies", "final_eval_rewards/accuracies"} <= set(info["metrics"])
    assert load_processor(out, processor_class("qwen2_5_vl")).chat_template  # saved beside the model
