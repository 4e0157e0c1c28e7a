"""Vision-language fine-tuning, first slice (issue 58): tiny image-text-to-text models built locally, image rows read
and checked in the data phase, labels against each family's template oracle, the processor's expansion."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, Qwen2_5_VLProcessor

from hftrain.heads import Head
from hftrain.tiny import build_tiny_vision_model
from hftrain.vision.families import CHECKED, image_token_ids
from hftrain.vision.processor import load_processor
from tests.exactness import within

FAMILIES = ["qwen2_5_vl", "llava", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "llava_next", "gemma3", "idefics3"]
PROCESSORS = {f: None for f in FAMILIES} | {"qwen2_5_vl": Qwen2_5_VLProcessor}
WORDS = ["what colour is the square", "red", "blue", "green", "yellow", "a square on white", "describe the image"]


@pytest.fixture(scope="session")
def vlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {f: build_tiny_vision_model(str(root / f), WORDS * 20, f, vocab_size=320) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_vlm_saves_reloads_and_runs_on_an_image(vlm_dirs, family):
    folder = vlm_dirs[family]
    processor = load_processor(folder, PROCESSORS[family])
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert model.config.model_type == family
    with open(os.path.join(folder, "processor_config.json")) as f:  # saved as the family's own class
        assert json.load(f)["processor_class"] == CHECKED[family].processor_class
    if not family.startswith("qwen"):  # AutoProcessor loads it here (Qwen-VL's needs torchvision for its videos)
        assert type(AutoProcessor.from_pretrained(folder)).__name__ == CHECKED[family].processor_class
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the square"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    text = processor.apply_chat_template(msgs, tokenize=False)
    enc = processor(text=[text], images=[Image.new("RGB", (60, 90), "red")], return_tensors="pt")
    image_id = image_token_ids(processor)[1]
    assert (enc["input_ids"] == image_id).sum() > 1  # one placeholder in the text, expanded by the processor
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()


# --- image rows: layouts, checks, labels against the family's template oracle, the processor's expansion --------

def _image(path, size, colour):
    Image.new("RGB", size, colour).save(path)
    return os.path.basename(path)


@pytest.fixture
def image_dir(tmp_path):
    for name, size, colour in [("red.png", (60, 90), "red"), ("blue.png", (120, 50), "blue"),
                               ("green.png", (90, 90), "green")]:
        _image(tmp_path / name, size, colour)
    return tmp_path


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def part_rows():  # content parts naming their images, as the Hub's processors and TRL write them
    return [{"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                       {"type": "text", "text": "what colour is the square"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "describe the image"},
                                                       {"type": "image", "image": "blue.png"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "blue"}]},
                          {"role": "user", "content": [{"type": "image", "image": "green.png"},
                                                       {"type": "text", "text": "and this"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "green"}]}]}]


def marker_rows():  # an images column and <image> markers in the text
    return [{"images": ["red.png"], "messages": [{"role": "user", "content": "<image>what colour is the square"},
                                                 {"role": "assistant", "content": "red"}]},
            {"images": ["blue.png", "green.png"],
             "messages": [{"role": "user", "content": "describe the image<image>"},
                          {"role": "assistant", "content": "blue"},
                          {"role": "user", "content": "<image>and this"}, {"role": "assistant", "content": "green"}]}]


def _data(path, **kw):
    from hftrain.config import DataSection, DataSource

    return DataSection(sources=[DataSource(path=path)], **kw)


def _examples(folder, family, path, **kw):
    from hftrain.vision.image_datasets import build_image_datasets

    processor = load_processor(folder, PROCESSORS[family])
    return processor, build_image_datasets(_data(path, **kw), processor, seed=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_both_layouts_give_the_same_examples(vlm_dirs, image_dir, family):
    _, parts = _examples(vlm_dirs[family], family, _write(image_dir / "parts.jsonl", part_rows()))
    _, marked = _examples(vlm_dirs[family], family, _write(image_dir / "marked.jsonl", marker_rows()))
    assert parts.train[:] == marked.train[:]
    assert parts.train[1]["images"] == [str(image_dir / "blue.png"), str(image_dir / "green.png")]


def test_a_saved_qwen_vl_processor_names_the_family_class_and_loads_without_torchvision(vlm_dirs, tmp_path):
    """On this CPU stack (no torchvision) hftrain builds Qwen-VL's processor without its video processor; saved, its
    tokenizer_config.json named that class of hftrain's own (Qwen2_5_VLProcessorImagesOnly), which nothing could
    load. It names the family's class now, and `hftrain.vision.processor.load_processor(folder)` reads it back."""
    import json

    from hftrain.vision.processor import load_processor

    import shutil

    processor = load_processor(vlm_dirs["qwen2_5_vl"])
    processor.save_pretrained(tmp_path / "saved")  # as a run saves it beside the model and its config.json
    shutil.copy(os.path.join(vlm_dirs["qwen2_5_vl"], "config.json"), tmp_path / "saved")
    for name in ("tokenizer_config.json", "processor_config.json"):
        config = json.load(open(tmp_path / "saved" / name))
        assert config.get("processor_class") == "Qwen2_5_VLProcessor", (name, config.get("processor_class"))
    again = load_processor(str(tmp_path / "saved"))
    assert type(again).__name__ == "Qwen2_5_VLProcessor" and again.image_token == processor.image_token


def test_image_rows_left_out_for_length_are_counted_and_named(vlm_dirs, image_dir, capsys):
    """Text, pair and step rows left out for length were counted and named, image rows silently dropped."""
    path = _write(image_dir / "parts.jsonl", part_rows())
    _, everything = _examples(vlm_dirs["llava"], "llava", path)
    lengths = sorted(len(ids) for ids in everything.train["input_ids"])
    capsys.readouterr()
    _, kept = _examples(vlm_dirs["llava"], "llava", path, max_length=lengths[-1] - 1, truncation="drop")
    err = capsys.readouterr().err
    assert len(kept.train) == len(lengths) - 1
    assert f"data.sources.0: 1 of {len(lengths)} image rows of {path} are left out: longer than data.max_length=" \
           f"{lengths[-1] - 1} tokens" in err and f"{path}:" in err, err


@pytest.mark.parametrize("spoil, said", [
    (lambda d: os.remove(d / "blue.png"), "image 0: image {d}/blue.png does not exist"),
    (lambda d: (d / "blue.png").write_text("not an image"), "is not an image PIL can read"),
    (lambda d: (d / "blue.png").write_bytes((d / "blue.png").read_bytes()[:-30]), "is damaged or truncated"),
])
def test_a_bad_image_is_a_data_error_naming_file_row_and_image(vlm_dirs, image_dir, spoil, said):
    from hftrain.errors import DataError

    path = _write(image_dir / "parts.jsonl", part_rows())
    spoil(image_dir)
    with pytest.raises(DataError) as e:
        _examples(vlm_dirs["llava"], "llava", path)
    assert str(e.value).startswith(f"data.sources.0 ({path}:2), image 0")
    assert said.format(d=image_dir) in str(e.value)


def test_an_over_large_image_is_a_data_error(vlm_dirs, image_dir, monkeypatch):
    from hftrain.errors import DataError
    from hftrain.vision import images

    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 5500)  # red.png: 60 x 90 passes, blue.png 120 x 50 not
    said = r"parts.jsonl:2\), image 0: image .*blue.png is 120 x 50 pixels, more than the 5500"
    with pytest.raises(DataError, match=said):
        _examples(vlm_dirs["llava"], "llava", _write(image_dir / "parts.jsonl", part_rows()))


def test_markers_and_images_must_agree(vlm_dirs, image_dir):
    from hftrain.errors import DataError

    rows = marker_rows()
    rows[1]["images"].append("red.png")
    with pytest.raises(DataError, match=r"marked.jsonl:2\): the row has 3 images and 2 <image> markers"):
        _examples(vlm_dirs["llava"], "llava", _write(image_dir / "marked.jsonl", rows))


ORACLES = {"qwen2_5_vl": "trl:qwen2_5_vl_training", "qwen2_vl": "trl:qwen2_5_vl_training",
           "qwen3_vl": "trl:qwen3_vl_training", "qwen3_vl_moe": "trl:qwen3_vl_training",
           "llava": "trl:llava_next_training",
           "llava_next": "trl:llava_next_training", "gemma3": "trl:gemma3_training",
           "idefics3": "trl:idefics3_training"}


# families whose expansion of an image holds tokens of its own around the image tokens (Gemma 3: start and end of image,
# blank lines; Idefics3: each tile's tokens and the whole view's)
AROUND_IMAGES = ("gemma3", "idefics3")


def _trained_runs(tokens: list[int], trained: list[bool]) -> list[tuple[int, ...]]:
    """The runs of consecutive trained tokens, as token tuples."""
    runs, run = [], []
    for tok, on in zip([*tokens, None], [*trained, False]):
        if on:
            run.append(tok)
        elif run:
            runs, run = runs + [tuple(run)], []
    return runs


def oracle_differences(example: dict, processor, family: str, messages: list[dict]) -> list[str]:
    """hftrain's trained tokens against the family's template oracle (TRL's training template, transformers'
    assistant mask) on the template's text with one placeholder per image: no token of an image's expansion trained
    (its image tokens, Gemma 3's start and end of image), and the runs of trained tokens, turn by turn, the oracle's,
    but whitespace the oracle trains after the stop token (the model never writes it: generation has ended). Where
    an expansion is a run of image tokens alone (all but AROUND_IMAGES), the ids are also the oracle's token for
    token with each run collapsed to its placeholder. Returns the differences, named."""
    from hftrain.constants import IGNORE_INDEX
    from hftrain.modeling import chat_template_text

    tok = processor.tokenizer
    placeholder_id, image_id = image_token_ids(processor)
    around = ("<start_of_image>", "<end_of_image>", "<fake_token_around_image>", "<global-img>", "<row_1_col_1>")
    expansion = {image_id, placeholder_id} | {tok.convert_tokens_to_ids(t) for t in around if t in tok.get_vocab()}
    oracle = tok.apply_chat_template(messages, chat_template=chat_template_text(ORACLES[family]), tokenize=True,
                                     return_dict=True, return_assistant_tokens_mask=True)
    plain, mask = oracle["input_ids"], oracle["assistant_masks"]
    ids, labels = example["input_ids"], example["labels"]
    ours = [lab != IGNORE_INDEX for lab in labels]
    out = [f"image token {k} trained" for k, t in enumerate(ids) if t in expansion and ours[k]]
    out += [f"token {k} trained on another token" for k, t in enumerate(ids) if ours[k] and labels[k] != t]
    after_stop = [bool(m) and j > 0 and not tok.decode([plain[j]]).strip() and plain[j - 1] == tok.eos_token_id
                  for j, m in enumerate(mask)]
    theirs = [bool(m) and not after for m, after in zip(mask, after_stop)]
    if _trained_runs(ids, ours) != _trained_runs(plain, theirs):
        out.append(f"trained runs: hftrain {[tok.decode(r) for r in _trained_runs(ids, ours)]}, the oracle "
                   f"{[tok.decode(r) for r in _trained_runs(plain, theirs)]}")
    if family not in AROUND_IMAGES:
        collapsed = [t for k, t in enumerate(ids) if t != image_id or k == 0 or ids[k - 1] != image_id]
        if collapsed != list(plain):
            out.append("the processor's ids are not the oracle's text with its placeholders expanded")
    assert any(t not in expansion for t in ids)  # the row has text
    return out


def _hub_messages(rows_of_parts: dict, folder) -> list[dict]:
    """A content-parts row as the processor's own apply_chat_template takes it (images as PIL images)."""
    return [{"role": m["role"], "content": [dict(p, image=Image.open(folder / p["image"]).convert("RGB"))
                                            if p["type"] == "image" else p for p in m["content"]]}
            for m in rows_of_parts["messages"]]


@pytest.mark.parametrize("family", FAMILIES)
def test_labels_match_the_oracle_and_the_expansion_is_the_processors(vlm_dirs, image_dir, family):
    processor, data = _examples(vlm_dirs[family], family, _write(image_dir / "parts.jsonl", part_rows()))
    placeholder_id, image_id = image_token_ids(processor)
    for row, example in zip(part_rows(), data.train):
        msgs = [{"role": m["role"], "content": [{"type": p["type"], **({"text": p["text"]} if "text" in p else {})}
                                                for p in m["content"]]} for m in row["messages"]]
        assert oracle_differences(example, processor, family, msgs) == []
        # the expansion, token for token: the processor's own rendering of the Hub-style row (images inline)
        own = processor.apply_chat_template(_hub_messages(row, image_dir), tokenize=True, return_dict=True)
        assert example["input_ids"] == list(own["input_ids"][0])
        runs = [len(r) for r in "".join("x" if t == image_id else " " for t in example["input_ids"]).split()]
        sizes = [Image.open(p).size for p in example["images"]]
        # the processor's own count per image (what vLLM asks it), and per family how it comes about
        if family == "idefics3":  # each tile a run of 4 between its tile tokens, then the whole view's run of 4
            tiles = [processor.image_processor.get_number_of_image_patches(h, w, {})[0] or 1 for w, h in sizes]
            assert runs == [4] * sum(tiles) and sum(tiles) > len(sizes)  # split: more runs than images
            continue
        counted = processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])["num_image_tokens"]
        assert runs == list(counted)
        if family.startswith("qwen"):  # one token per (2 x patch)^2 pixels (patches merged 2 x 2), as resized
            grid = processor.image_processor(images=[Image.open(p) for p in example["images"]])["image_grid_thw"]
            assert runs == [int(g.prod()) // 4 for g in grid] and len(set(runs)) == len(sizes)
        elif family == "llava_next":  # an overview and the tiles of the grid the image's aspect fits: by size
            assert len(set(runs)) == len(sizes) and min(runs) > 16
        else:  # every image resized to 56 x 56: 16 tokens (LLaVA), pooled to 4 (Gemma 3)
            assert runs == [4 if family == "gemma3" else 16] * len(sizes)
    spoiled = dict(data.train[0])
    k = spoiled["input_ids"].index(image_id)
    spoiled["labels"] = spoiled["labels"][:k] + [image_id] + spoiled["labels"][k + 1:]  # a placeholder trained
    msgs = [{"role": m["role"], "content": [{"type": p["type"], **({"text": p["text"]} if "text" in p else {})}
                                            for p in m["content"]]} for m in part_rows()[0]["messages"]]
    assert oracle_differences(spoiled, processor, family, msgs)[0] == f"image token {k} trained"


# --- the run: SFT of a tiny VLM, saved with its processor; families not checked refused -------------------------

def _square_rows(folder, n=16):
    """Rows of drawn squares of four colours on images of four sizes (so every batch of 4 mixes sizes)."""
    from PIL import ImageDraw

    colours, sizes = ["red", "blue", "green", "yellow"], [(56, 56), (84, 56), (60, 100), (112, 84)]
    rows = []
    for i in range(n):
        (w, h), colour = sizes[i % 4], colours[(i // 4) % 4]
        image = Image.new("RGB", (w, h), "white")
        ImageDraw.Draw(image).rectangle([w // 4, h // 4, 3 * w // 4, 3 * h // 4], fill=colour)
        image.save(folder / f"square{i}.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": f"square{i}.png"},
                                                               {"type": "text", "text": "what colour is the square"}]},
                                  {"role": "assistant", "content": colour}]})
    return _write(folder / "squares.jsonl", rows)


def _recipe(folder, model, data, out, **training):
    import yaml

    recipe = {"model": {"name_or_path": model, "dtype": "float32", "attn_implementation": "sdpa"},
              "data": {"sources": [{"path": data}], "eval_fraction": 0.25, "max_length": 256},
              "strategy": {"num_processes": 1},
              "training": {"output_dir": out, "max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-3,
                           "logging_steps": 1, "save_strategy": "no", "seed": 0, **training}}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def refusals_of_check_and_run(tmp_path, folder, edit, capsys, monkeypatch) -> tuple[str, str]:
    """The errors `hftrain check` and the run (both must exit 2) print for _recipe's recipe on `folder`'s model with
    `edit(tree)` applied to it, each from its "hftrain: error:" line."""
    import yaml

    from .test_bad_input import run_check, run_main

    recipe = _recipe(tmp_path, folder, _square_rows(tmp_path, 4), str(tmp_path / "out"))
    with open(recipe) as f:
        tree = yaml.safe_load(f)
    edit(tree)
    with open(recipe, "w") as f:
        yaml.safe_dump(tree, f)
    code, checked = run_check([recipe], capsys)
    assert code == 2, checked
    assert run_main([recipe], {}, monkeypatch) == 2
    ran = capsys.readouterr().err
    return checked[checked.index("hftrain: error:"):], ran[ran.index("hftrain: error:"):]


def test_images_of_different_sizes_collate_into_one_batch(vlm_dirs, tmp_path):
    processor, data = _examples(vlm_dirs["qwen2_5_vl"], "qwen2_5_vl", _square_rows(tmp_path, 4), eval_fraction=0.0)
    rows = [data.train[i] for i in range(4)]
    assert len({Image.open(r["images"][0]).size for r in rows}) == 4
    batch = data.collator(rows)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dirs["qwen2_5_vl"])
    with torch.no_grad():
        together = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        for r, row in enumerate(rows):  # each row alone gives the logits it has in the padded batch
            alone = data.collator([row])
            logits = model(**{k: v for k, v in alone.items() if k != "labels"}).logits[0]
            within("vision.padded_batch_vs_alone.logits", together[r, :len(row["input_ids"])], logits,
                   label=f"row {r}")


@pytest.mark.launches
def test_sft_of_a_tiny_vlm_saves_model_and_processor(vlm_dirs, tmp_path):
    from hftrain.hub.card import build_card

    from .conftest import run

    out = str(tmp_path / "out")
    recipe = _recipe(tmp_path, vlm_dirs["qwen2_5_vl"], _square_rows(tmp_path), out)
    done = run([".venv/bin/hftrain", "sft", recipe], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "12 training examples, 4 held out" in done.stdout + done.stderr
    with open(os.path.join(out, "run_info.json")) as f:
        info = json.load(f)
    assert info["method"]["head"] == "image_text_to_text"
    assert info["metrics"]["final_eval_loss"] < info["metrics"]["initial_eval_loss"]
    model = AutoModelForImageTextToText.from_pretrained(out)
    base = AutoModelForImageTextToText.from_pretrained(vlm_dirs["qwen2_5_vl"])
    assert not torch.equal(model.lm_head.weight, base.lm_head.weight)  # trained
    processor = load_processor(out, Qwen2_5_VLProcessor)  # saved beside the model, as the family's class
    base_processor = load_processor(vlm_dirs["qwen2_5_vl"], Qwen2_5_VLProcessor)
    assert processor.chat_template == base_processor.chat_template
    assert processor.image_processor.to_dict() == base_processor.image_processor.to_dict()
    card = str(build_card(out, ["recipe.yaml", "run_info.json"]))
    assert "pipeline_tag: image-text-to-text" in card and "AutoModelForImageTextToText.from_pretrained(" in card


def test_an_image_text_to_text_family_not_checked_is_refused(vlm_dirs, tmp_path, capsys):
    from .test_bad_input import run_check

    folder = tmp_path / "mllama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mllama"}))
    (folder / "model.safetensors").write_bytes(b"")
    code, err = run_check([_recipe(tmp_path, str(folder), _square_rows(tmp_path, 4), str(tmp_path / "o"))], capsys)
    assert code == 2
    assert ("model.name_or_path: the model is an image-text-to-text model of family 'mllama', which hftrain has "
            "not checked") in err and f"the families checked: {', '.join(sorted(CHECKED))}" in err


@pytest.mark.parametrize("strategy", ["zero2", "zero3_offload"])
def test_a_strategy_not_proven_for_image_models_is_refused(vlm_dirs, tmp_path, capsys, strategy):
    """Image models are proven exact under ddp, fsdp and zero3 (tests/test_vision_exact.py); another strategy is
    refused by check (and the run: the same preflight) until proven, and those three are not."""
    from .test_bad_input import run_check

    recipe = _recipe(tmp_path, vlm_dirs["llava"], _square_rows(tmp_path, 4), str(tmp_path / "o"))
    code, err = run_check([recipe, f"strategy.name={strategy}"], capsys)
    assert code == 2 and f"strategy.name: strategy '{strategy}' is not proven for image-text-to-text models" in err
    assert "only ddp, fsdp, zero3 are" in err
    for proven in ("ddp", "fsdp", "zero3"):
        code, err = run_check([recipe, f"strategy.name={proven}"], capsys)
        assert "not proven" not in err, (proven, err)


def test_qwen3_vl_moe_under_zero3_is_refused_with_the_loaders_fault(vlm_dirs, tmp_path, capsys):
    """Under ZeRO-3 transformers loads Qwen3-VL-MoE's experts in another layout (tests/test_vision_exact.py found it):
    refused by check (the run's preflight is the same), naming the strategies that hold."""
    from .test_bad_input import run_check

    recipe = _recipe(tmp_path, vlm_dirs["qwen3_vl_moe"], _square_rows(tmp_path, 4), str(tmp_path / "o"))
    code, err = run_check([recipe, "strategy.name=zero3"], capsys)
    assert code == 2 and "strategy.name: qwen3_vl_moe under zero3: transformers' ZeRO-3 loader does not lay out " \
        "Qwen3-VL-MoE's expert weights" in err and "use strategy.name: ddp or fsdp" in err
    code, err = run_check([recipe, "strategy.name=fsdp"], capsys)
    assert "qwen3_vl_moe under" not in err


def test_sequence_parallelism_is_refused_for_image_models(vlm_dirs, tmp_path, capsys):
    """Under sequence parallelism an example's image tokens would be split over ranks: not proven, refused."""
    from .test_bad_input import run_check

    recipe = _recipe(tmp_path, vlm_dirs["qwen2_5_vl"], _square_rows(tmp_path, 4), str(tmp_path / "o"))
    code, err = run_check([recipe, "strategy.name=zero3", "strategy.num_processes=2", "strategy.sequence_parallel=2"],
                          capsys)
    assert code == 2 and "strategy.sequence_parallel: sequence parallelism is not proven for image-text-to-text" in err


def test_the_cards_snippet_loads_the_processor_and_answers_about_an_image(vlm_dirs, tmp_path, monkeypatch):
    """The card's usage snippet of an image-text-to-text model (heads.Head.usage) runs as written: AutoProcessor,
    an image opened from a file, generate(). LLaVA's processor loads through AutoProcessor on this stack (Qwen's needs
    torchvision for its video processor: docs/vision.md)."""
    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (40, 30), (200, 30, 30)).save("image.png")
    printed, names = io.StringIO(), {}
    with contextlib.redirect_stdout(printed):
        exec(Head.IMAGE_TEXT_TO_TEXT.usage(vlm_dirs["llava"], adapter=False), names)
    assert type(names["model"]).__name__ == "LlavaForConditionalGeneration"
    assert type(names["processor"]).__name__ == "LlavaProcessor"
    prompt_tokens = names["inputs"]["input_ids"].shape[1]
    assert names["inputs"]["pixel_values"].shape[0] == 1 and names["out"].shape[1] > prompt_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_the_memory_plan_counts_the_vision_tower(vlm_dirs, family):
    """hftrain plan builds an image model by its head (SFT declares image-text-to-text for a checked family), so the
    vision tower and the projector are in its parameter count, not the language model alone."""
    from transformers import AutoConfig

    from hftrain.launch.plan import model_facts
    from hftrain.vision.families import head_of

    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(vlm_dirs[family]))
    whole = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for n, p in model.named_parameters() if "vision" in n or "visual" in n)
    head = head_of(type("Section", (), {"name_or_path": vlm_dirs[family]})())
    assert head is Head.IMAGE_TEXT_TO_TEXT and vision > 0
    assert model_facts(vlm_dirs[family], head=head).params == whole


@pytest.mark.parametrize("method,section", [
    ("orpo", {"preference": {"loss_type": "orpo", "beta": 0.1}}),
    ("distill", {"distill": {"teacher": {"name_or_path": "TEACHER", "dtype": "float32"}}}),
])
def test_a_method_that_does_not_train_images_refuses_an_image_model(vlm_dirs, tmp_path, capsys, monkeypatch,
                                                                    method, section):
    """A method trains the modalities it names (methods/modality.py; SFT: text and images): an image-text-to-text
    policy under another is refused under model.name_or_path by check and the run alike, before anything loads,
    rather than loaded as a text model (distillation inherited SFT's image rows and read them so)."""
    model = vlm_dirs["qwen2_5_vl"]
    section = json.loads(json.dumps(section).replace("TEACHER", model))
    checked, ran = refusals_of_check_and_run(tmp_path, model, lambda tree: tree.update(section), capsys, monkeypatch)
    said = (f"model.name_or_path: {model} reads images (an image-text-to-text model); the {method} method trains "
            "text only")
    assert said in checked and said in ran, checked


def test_a_method_outside_hftrain_trains_images_by_naming_them(vlm_dirs, tmp_path):
    """A stand-in method (a plugin's shape) gains images by naming them and asking its modality, with no code outside
    its own module: the same image model is refused while it names text only, and its rows are the image rows."""
    from types import SimpleNamespace

    from hftrain.config import DataSection, DataSource, ModelSection
    from hftrain.methods import Method, MethodEntry
    from hftrain.methods.modality import modality_of, modality_problems

    def read(recipe, tokenizer, world_size, seed):
        return modality_of(recipe.model).read(recipe, tokenizer, seed)

    entry = MethodEntry("stand_in", "sft", None, None, __name__)
    text_only, with_images = (Method(entry, read=read, modalities=m) for m in (("text",), ("text", "images")))
    recipe = SimpleNamespace(model=ModelSection(name_or_path=vlm_dirs["qwen2_5_vl"], dtype="float32"),
                             data=DataSection(sources=[DataSource(path=_square_rows(tmp_path, 4))], max_length=256),
                             eval=SimpleNamespace(exact_match=0), strategy=SimpleNamespace(name="ddp"))
    assert [key for key, _ in modality_problems(text_only, recipe)] == ["model.name_or_path"]
    assert modality_problems(with_images, recipe) == []
    data = with_images.read(recipe, None, 1, 0)
    assert type(data).__name__ == "ImageDatasets" and len(data.train) == 4 and "images" in data.train[0]
