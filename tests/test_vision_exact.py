"""Image rows exact across ranks, accumulation and packing (issue 58, items 4 and 5; issue 66's families): SFT of a
tiny model of each family checked (Qwen2.5-VL, Qwen2-VL, Qwen3-VL, Qwen3-VL-MoE, LLaVA, LLaVA-NeXT, Gemma 3,
Idefics3) on images of four sizes (each micro-batch mixes sizes) and answers of one to four words; 2 ranks x GA2,
1 rank x GA4 and packed batches give the same losses per step and the same weights (fp32, within the bounds of
BOUNDS_OF) under DDP, FSDP2 and ZeRO-3, and each 2-rank save loads with the card's Auto class and gives the 1-rank
save's logits; each micro-batch's own mean averaged (tests/vision_mean_of_means.py) does not. One launch per
strategy, every family in each, against one 1-rank reference launch. Gemma 3 is not packed (refused: not exact);
Qwen3-VL-MoE also with the MoE section's router losses."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from PIL import Image, ImageDraw
from safetensors.torch import load_file
from transformers import Qwen2_5_VLProcessor

from hftrain.config import DataSection, DataSource
from hftrain.heads import Head
from hftrain.tiny import build_tiny_vision_model
from hftrain.vision.families import CHECKED
from hftrain.vision.image_datasets import build_image_datasets
from hftrain.vision.processor import load_processor
from tests.exactness import beyond, within

from .conftest import launch_prefix, run_matrix
from .support import RESUMED, assert_resume_exact

FAMILIES = ["qwen2_5_vl", "llava", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "llava_next", "gemma3", "idefics3"]
PACKED = [f for f in FAMILIES if not CHECKED[f].packing_refused]  # Gemma 3's packing is refused (not exact)


def runs_under(family: str, strategy: str) -> bool:
    """Whether the family is run under the strategy (Qwen3-VL-MoE is refused under ZeRO-3: families.py)."""
    return strategy not in dict(CHECKED[family].refused_strategies)


def controlled_under(family: str, strategy: str) -> bool:
    """Whether the family's per-micro-batch control runs on 2 ranks under the strategy: every family's under DDP, the
    first two's under FSDP2 and ZeRO-3 (a control shows a bound catches the fault; every family's 2-rank runs are
    still compared under every strategy)."""
    return strategy == "ddp" or family in FAMILIES[:2]


def packed_under(family: str, strategy: str) -> bool:
    """Whether the family's packed 2-rank variant is run: the first two families' under every strategy. Packing is
    rank-local, the same code under every strategy, and each packing family's packed run is checked against its
    accumulated one on 1 rank (test_packed_and_accumulated_equal_one_rank_ga4); the launches carry every family's
    unpacked 2-rank runs, which keeps the suite within its time."""
    return family in PACKED and family in FAMILIES[:2]
COLOURS = ["red", "blue", "green", "yellow"]
SIZES = [(56, 56), (84, 56), (60, 100), (112, 84)]
EXACT = dict(optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
             train_sampling_strategy="sequential", max_steps=2)
# (losses, weights, held-out loss) bounds of each variant against 1 rank x GA4.
BOUNDS_OF = {
    "1x_bs8_packed": ("vision.packed_vs_accumulated.losses", "vision.packed_vs_accumulated.weights",
                      "vision.packed_vs_accumulated.eval_loss"),
    "2x_ga2": ("vision.two_ranks_vs_one.losses", "vision.two_ranks_vs_one.weights",
               "vision.two_ranks_vs_one.eval_loss"),
    "2x_bs4_packed": ("vision.two_ranks_packed_vs_one.losses", "vision.two_ranks_packed_vs_one.weights",
                      "vision.two_ranks_packed_vs_one.eval_loss"),
}


def _square(folder, i: int) -> str:
    (w, h), colour = SIZES[i % 4], COLOURS[(i // 4) % 4]
    image = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(image).rectangle([w // 4, h // 4, 3 * w // 4, 3 * h // 4], fill=colour)
    image.save(folder / f"square{i}.png")
    return f"square{i}.png"


def write_rows(folder, n: int, first: int = 0) -> str:
    """Rows of one square (answers of 1 to 4 words), every third row two turns with two images (twice as long)."""
    rows = []
    for i in range(first, first + n):
        colour = COLOURS[(i // 4) % 4]
        turns = [{"role": "user", "content": [{"type": "image", "image": _square(folder, i)},
                                              {"type": "text", "text": "what colour is the square"}]},
                 {"role": "assistant", "content": " ".join([colour] * (1 + i % 4))}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": [{"type": "image", "image": _square(folder, i + 1)},
                                                   {"type": "text", "text": "and this"}]},
                      {"role": "assistant", "content": COLOURS[((i + 1) // 4) % 4]}]
        rows.append({"messages": turns})
    path = folder / f"rows{first}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tiny models by family, training rows, held-out rows)."""
    root = tmp_path_factory.mktemp("vision_exact")
    words = COLOURS + ["what colour is the square", "and this"]
    models = {f: build_tiny_vision_model(str(root / f), words * 20, f, vocab_size=320) for f in FAMILIES}
    return root, models, write_rows(root, 16), write_rows(root, 4, first=16)


LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "vision_parts": ["projector"]}  # no dropout: masks differ by rank


# model.part_learning_rates against training.learning_rate 0.5 (vision/part_rates.py): tower and projector slower
PART_RATES = {"part_learning_rates": {"vision_tower": 0.1, "projector": 0.25}}
MOE = {"aux_loss_coef": 0.01, "router_z_loss_coef": 0.001}  # Qwen3-VL-MoE's routers balanced (the MoE section)


def variant(folder, name, setup, family, bs, ga, module="hftrain.recipes.sft", packing=False, lora=None, moe=None,
            data=None, model=None, **training):
    _, models, rows, held = setup
    tree = {"model": {"name_or_path": models[family], "dtype": "float32", "attn_implementation": "sdpa",
                      **({"lora": lora} if lora else {}), **(model or {})},
            "data": {"sources": [{"path": rows}], "eval_sources": [{"path": held}], "max_length": 256,
                     "packing": packing, **(data or {})},
            "training": {"output_dir": str(folder / name), "seed": 0, "report_to": "none", "disable_tqdm": True,
                         "logging_steps": 1, "save_strategy": "no", "per_device_train_batch_size": bs,
                         "per_device_eval_batch_size": 2, "gradient_accumulation_steps": ga, **EXACT, **training},
            **({"moe": moe} if moe else {})}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return module, [str(path)]


def outcome(variants, folder, name, world=1, strategy="ddp"):
    """(losses per step, final weights, final eval loss) of a variant, checked to have run as said."""
    variants[name].check()
    out = folder / name
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == world and info["strategy"] == strategy
    history = json.load(open(out / "trainer_state.json"))["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == EXACT["max_steps"]
    return losses, load_file(str(out / "model.safetensors")), info["metrics"]["final_eval_loss"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, setup):
    tmp = tmp_path_factory.mktemp("vision_one_rank")
    variants = {}
    for f in FAMILIES:
        variants[f"{f}_1x_ga4"] = variant(tmp, f"{f}_1x_ga4", setup, f, 2, 4)
        if f in PACKED:
            variants[f"{f}_1x_bs8_packed"] = variant(tmp, f"{f}_1x_bs8_packed", setup, f, 8, 1, packing=True)
        variants[f"{f}_naive_1x_ga4"] = variant(tmp, f"{f}_naive_1x_ga4", setup, f, 2, 4,
                                                module="tests.vision_mean_of_means")
    # a packed image run resumed from its checkpoint at step 2 (and, the control, with its weights only)
    ck = str(tmp / "resume_whole" / "checkpoint-2")
    for name, more in (("", {}), ("_after", {"resume_from_checkpoint": ck}),
                       ("_weights_only", {"resume_from_checkpoint": ck, "resume_weights_only": True})):
        variants[f"resume_whole{name}"] = variant(tmp, f"resume_whole{name}", setup, FAMILIES[0], 4, 1, packing=True,
                                                  **RESUMED, max_steps=4, **more)
    variants.update(resumed_stream(tmp, setup, "llava", 2, 2))
    variants["lora_1x_ga4"] = variant(tmp, "lora_1x_ga4", setup, FAMILIES[0], 2, 4, lora=LORA)
    variants["rates_1x_ga4"] = variant(tmp, "rates_1x_ga4", setup, FAMILIES[0], 2, 4, model=PART_RATES)
    variants["moe_1x_ga4"] = variant(tmp, "moe_1x_ga4", setup, "qwen3_vl_moe", 2, 4, moe=MOE)
    return tmp, run_matrix(launch_prefix(1), variants, tmp / "matrix", timeout=900)


@pytest.mark.launches
def test_a_resumed_image_run_ends_where_the_uninterrupted_run_ends(one_rank):
    """Packed image rows, AdamW, a checkpoint at step 2: steps 3-4 resumed from it equal the uninterrupted run."""
    tmp, variants = one_rank
    assert_resume_exact(tmp, variants, "whole", "vision")


STREAM = {"streaming": True, "shuffle_buffer": 3}  # windows of 3 rows: a resume at step 2 starts inside one


def resumed_stream(tmp, setup, family, bs, ga, packing=False) -> dict:
    """Streamed image rows (data.streaming), AdamW, 4 steps with a checkpoint at step 2; resumed from it; resumed
    with the weights only (the control)."""
    ck = str(tmp / "resume_stream" / "checkpoint-2")
    return {f"resume_stream{name}": variant(tmp, f"resume_stream{name}", setup, family, bs, ga, packing=packing,
                                            data=STREAM, **RESUMED, max_steps=4, **more)
            for name, more in (("", {}), ("_after", {"resume_from_checkpoint": ck}),
                               ("_weights_only", {"resume_from_checkpoint": ck, "resume_weights_only": True}))}


@pytest.mark.launches
def test_a_resumed_image_stream_ends_where_the_uninterrupted_stream_ends(one_rank):
    """Streamed image rows (LLaVA): steps 3-4 resumed from checkpoint-2 (weights, AdamW state, the stream's position
    inside a window) equal the uninterrupted run's."""
    tmp, variants = one_rank
    assert_resume_exact(tmp, variants, "stream", "vision")


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory, setup):
    """2 ranks x GA2, packed batches of 4 and the per-micro-batch control per strategy: one launch per strategy, every
    family."""
    launches = {}

    def get(strategy):
        if strategy not in launches:
            if strategy.startswith("zero"):
                request.getfixturevalue("deepspeed_ops")
            tmp = tmp_path_factory.mktemp(f"vision_{strategy}")
            variants = {}
            for f in [f for f in FAMILIES if runs_under(f, strategy)]:
                variants[f"{f}_2x_ga2"] = variant(tmp, f"{f}_2x_ga2", setup, f, 2, 2)
                if controlled_under(f, strategy):
                    variants[f"{f}_naive_2x_ga2"] = variant(tmp, f"{f}_naive_2x_ga2", setup, f, 2, 2,
                                                            module="tests.vision_mean_of_means")
                if packed_under(f, strategy):
                    variants[f"{f}_2x_bs4_packed"] = variant(tmp, f"{f}_2x_bs4_packed", setup, f, 4, 1,
                                                             packing=True)
            if strategy == "ddp":
                variants.update(resumed_stream(tmp, setup, "qwen2_5_vl", 4, 1, packing=True))
            variants["lora_2x_ga2"] = variant(tmp, "lora_2x_ga2", setup, FAMILIES[0], 2, 2, lora=LORA)
            variants["rates_2x_ga2"] = variant(tmp, "rates_2x_ga2", setup, FAMILIES[0], 2, 2, model=PART_RATES)
            variants["lora_naive_2x_ga2"] = variant(tmp, "lora_naive_2x_ga2", setup, FAMILIES[0], 2, 2, lora=LORA,
                                                    module="tests.vision_mean_of_means")
            if runs_under("qwen3_vl_moe", strategy):
                variants["moe_2x_ga2"] = variant(tmp, "moe_2x_ga2", setup, "qwen3_vl_moe", 2, 2, moe=MOE)
                variants["moe_naive_2x_ga2"] = variant(tmp, "moe_naive_2x_ga2", setup, "qwen3_vl_moe", 2, 2,
                                                       moe=MOE, module="tests.vision_mean_of_means")
            launches[strategy] = tmp, run_matrix(launch_prefix(2, strategy), variants, tmp / "matrix", ranks=2,
                                                 timeout=900)
        return launches[strategy]

    return get


def compared_weights(final: dict, ref: dict) -> tuple[dict, dict]:
    """Both saves' weights to compare relatively, but for the key biases of a vision tower without rotary positions
    (CLIP, SigLIP: LLaVA, LLaVA-NeXT, Idefics3): their gradient is zero (softmax does not change when all of a query's
    scores move by q.b), so they stay at 0 up to rounding (~1e-11) and are compared absolutely here. Savers differ
    only in whether they also write the tied lm_head.weight (equal to the embedding): it is compared only where both
    hold it."""
    keys = [k for k in ref if "vision_" in k and k.endswith("self_attn.k_proj.bias")]
    for k in keys:
        assert (final[k] - ref[k]).abs().max() < 1e-9 and ref[k].abs().max() < 1e-9, k
    both = set(final) & set(ref)
    return tuple({k: v for k, v in d.items() if k not in keys and (k != "lm_head.weight" or k in both)}
                 for d in (final, ref))


def assert_same(variant_name, found, ref_loss, ref, ref_eval, label=""):
    """A variant's (losses, weights, held-out loss) equal 1 rank x GA4's within its bounds (BOUNDS_OF)."""
    losses, final, evaluated = found
    bound_losses, bound_weights, bound_eval = BOUNDS_OF[variant_name]
    within(bound_losses, losses, ref_loss, label=label)
    within(bound_weights, *compared_weights(final, ref), label=label)
    within(bound_eval, evaluated, ref_eval, label=label)


def _differs(naive, ref_loss, ref, ref_eval, *variant_names):
    """The per-micro-batch mean's losses, weights and held-out loss are beyond the bounds of each variant named."""
    naive_loss, naive_weights, naive_eval = naive
    for name in variant_names:
        bound_losses, bound_weights, bound_eval = BOUNDS_OF[name]
        beyond(bound_losses, naive_loss, ref_loss)
        beyond(bound_weights, *compared_weights(naive_weights, ref))
        beyond(bound_eval, naive_eval, ref_eval)


@pytest.mark.launches
@pytest.mark.parametrize("family", PACKED)
def test_packed_and_accumulated_equal_one_rank_ga4(one_rank, family):
    """Packed micro-batches of 8 rows (examples with their images in shared rows) give 1 rank x GA4's padded losses,
    weights and held-out loss (evaluated padded); the per-micro-batch mean differs."""
    tmp, variants = one_rank
    ref_loss, ref, ref_eval = outcome(variants, tmp, f"{family}_1x_ga4")
    assert_same("1x_bs8_packed", outcome(variants, tmp, f"{family}_1x_bs8_packed"), ref_loss, ref, ref_eval)
    _differs(outcome(variants, tmp, f"{family}_naive_1x_ga4"), ref_loss, ref, ref_eval, "1x_bs8_packed")


def saved_logits(folders, model_dir, family, held) -> list[torch.Tensor]:
    """Each saved folder loaded with the Auto class the model card names: its logits on two held-out image rows of
    different sizes (a save under other names would load with fresh weights, or not at all)."""
    processor = load_processor(model_dir, Qwen2_5_VLProcessor if family == "qwen2_5_vl" else None)
    data = build_image_datasets(DataSection(sources=[DataSource(path=held)]), processor, seed=0)
    batch = {k: v for k, v in data.collator([data.train[0], data.train[1]]).items() if k != "labels"}
    auto = Head.IMAGE_TEXT_TO_TEXT.auto_class
    with torch.no_grad():
        return [auto.from_pretrained(str(f), dtype=torch.float32).eval()(**batch).logits for f in folders]


@pytest.mark.launches
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_two_ranks_ga2_equal_one_rank_ga4(one_rank, two_ranks, setup, strategy):
    """Under FSDP2 LLaVA was refused at prepare (its wrap classes named one it lacks) and under ZeRO-3 both families
    saved keys with a doubled prefix (modeling/wrap_classes_and_renamings.py); the saved weights and their logits
    check both."""
    tmp1, variants1 = one_rank
    tmp, variants = two_ranks(strategy)
    _, models, _, held = setup
    for family in [f for f in FAMILIES if runs_under(f, strategy)]:
        ref_loss, ref, ref_eval = outcome(variants1, tmp1, f"{family}_1x_ga4")
        for kind in ["2x_ga2", "2x_bs4_packed"] if packed_under(family, strategy) else ["2x_ga2"]:
            name = f"{family}_{kind}"
            assert_same(kind, outcome(variants, tmp, name, 2, strategy), ref_loss, ref, ref_eval, label=name)
        controlled = controlled_under(family, strategy)
        folders = [tmp / f"{family}_2x_ga2", tmp1 / f"{family}_1x_ga4"]
        logits = saved_logits(folders + ([tmp / f"{family}_naive_2x_ga2"] if controlled else []), models[family],
                              family, held)
        within("vision.two_ranks_vs_one.saved_logits", logits[0], logits[1], label=family)
        if controlled:  # the per-micro-batch mean, beyond the bounds of both kinds
            beyond("vision.two_ranks_vs_one.saved_logits", logits[2], logits[1], label=family)
            _differs(outcome(variants, tmp, f"{family}_naive_2x_ga2", 2, strategy), ref_loss, ref, ref_eval,
                     "2x_ga2", "2x_bs4_packed")


@pytest.mark.launches
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_a_lora_vision_model_on_two_ranks_equals_one_rank(one_rank, two_ranks, strategy):
    """A LoRA vision-language model (the language model and the projector adapted) was tested on one rank only: 2 ranks
    x GA2 under DDP, FSDP2 and ZeRO-3 give 1 rank x GA4's losses and adapter; each micro-batch's own token mean
    averaged (the control) does not."""
    tmp1, variants1 = one_rank
    tmp, variants = two_ranks(strategy)
    runs = {}
    for folder, found, name in ((tmp1, variants1, "lora_1x_ga4"), (tmp, variants, "lora_2x_ga2"),
                                (tmp, variants, "lora_naive_2x_ga2")):
        found[name].check()
        history = json.load(open(folder / name / "trainer_state.json"))["log_history"]
        runs[name] = ([h["loss"] for h in history if "loss" in h],
                      load_file(str(folder / name / "adapter_model.safetensors")))
    (ref_loss, ref), (losses, adapter) = runs["lora_1x_ga4"], runs["lora_2x_ga2"]
    assert any(".visual.merger." in k for k in adapter)
    within("vision.lora_two_ranks_vs_one.losses", losses, ref_loss, label=strategy)
    within("vision.lora_two_ranks_vs_one.weights", adapter, ref, label=strategy)
    control_loss, control = runs["lora_naive_2x_ga2"]
    beyond("vision.lora_two_ranks_vs_one.losses", control_loss, ref_loss, label=strategy)
    beyond("vision.lora_two_ranks_vs_one.weights", control, ref, label=strategy)


@pytest.mark.launches
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # ZeRO-3: refused (test_vision.py)
def test_an_moe_vision_model_with_its_router_losses_on_two_ranks_equals_one_rank(one_rank, two_ranks, strategy):
    """Qwen3-VL-MoE with the MoE section's load-balancing and z losses (its language model's routers, read through
    its text config): 2 ranks x GA2 give 1 rank x GA4's losses and weights; each micro-batch's own mean averaged
    (the control) does not."""
    tmp1, variants1 = one_rank
    tmp, variants = two_ranks(strategy)
    ref_loss, ref, _ = outcome(variants1, tmp1, "moe_1x_ga4")
    losses, final, _ = outcome(variants, tmp, "moe_2x_ga2", 2, strategy)
    history = json.load(open(tmp1 / "moe_1x_ga4" / "trainer_state.json"))["log_history"]
    assert all(h["moe_aux_loss"] > 0 and h["moe_z_loss"] > 0 for h in history if "loss" in h)  # both were on
    within("vision.moe_two_ranks_vs_one.losses", losses, ref_loss, label=strategy)
    within("vision.moe_two_ranks_vs_one.weights", *compared_weights(final, ref), label=strategy)
    naive_loss, naive, _ = outcome(variants, tmp, "moe_naive_2x_ga2", 2, strategy)
    beyond("vision.moe_two_ranks_vs_one.losses", naive_loss, ref_loss, label=strategy)
    beyond("vision.moe_two_ranks_vs_one.weights", *compared_weights(naive, ref), label=strategy)


@pytest.mark.launches
def test_a_resumed_packed_image_stream_on_two_ranks_ends_where_the_uninterrupted_one_ends(two_ranks):
    """Streamed image rows packed (Qwen2.5-VL) on 2 ranks under DDP, each rank its own rows and its own position:
    steps 3-4 resumed from checkpoint-2 equal the uninterrupted run's."""
    tmp, variants = two_ranks("ddp")
    assert_resume_exact(tmp, variants, "stream", "vision")


@pytest.mark.launches
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_part_learning_rates_on_two_ranks_equal_one_rank(one_rank, two_ranks, strategy):
    """model.part_learning_rates (Qwen2.5-VL's tower and projector at rates of their own) under each strategy: 2 ranks
    x GA2 give 1 rank x GA4's losses, weights and held-out loss, the optimizer that steps being the one whose groups
    part_rates.py split; the 1-rank run without the rates (the control) is beyond the bounds."""
    tmp1, variants1 = one_rank
    tmp, variants = two_ranks(strategy)
    ref_loss, ref, ref_eval = outcome(variants1, tmp1, "rates_1x_ga4")
    assert_same("2x_ga2", outcome(variants, tmp, "rates_2x_ga2", 2, strategy), ref_loss, ref, ref_eval,
                label=f"part rates, {strategy}")
    assert "vision_tower " in variants["rates_2x_ga2"].stderr and " at 0.1" in variants["rates_2x_ga2"].stderr
    plain = outcome(variants1, tmp1, f"{FAMILIES[0]}_1x_ga4")[1]
    beyond("vision.two_ranks_vs_one.weights", *compared_weights(plain, ref), label="without the rates")
