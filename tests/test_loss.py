"""Exact loss averaging: unit maths, and invariance across world size and accumulation on real 2-rank runs."""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hftrain import losses
from hftrain.constants import IGNORE_INDEX
from hftrain.data import make_collator, tokenize_example

from tests.exactness import beyond, within

from .conftest import launch_prefix, run_matrix, uneven_data


def rand_batch(b=3, t=9, v=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g)
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :6] = IGNORE_INDEX  # uneven target counts per row
    labels[1, -2:] = IGNORE_INDEX
    return logits, labels


def test_token_loss_matches_transformers_causal_lm_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits, labels = rand_batch()
    n = losses.count_targets(labels)[0]
    ours = losses.normalise(losses.loss_sum(logits, labels), n, dp_size=1)
    theirs = ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1], num_items_in_batch=torch.tensor(n))
    within("loss.token_loss_vs_transformers.loss", ours, theirs)


def test_sequence_loss_is_sum_of_row_means():
    logits, labels = rand_batch()
    expected = 0.0
    for i in range(labels.shape[0]):
        tgt = labels[i, 1:]
        m = tgt != IGNORE_INDEX
        expected += torch.nn.functional.cross_entropy(logits[i, :-1][m], tgt[m])
    within("loss.sequence_loss_vs_row_means.loss", losses.loss_sum(logits, labels, "sequence"), expected)
    assert losses.count_targets(labels) == (int((labels[:, 1:] != IGNORE_INDEX).sum()), 3)


@pytest.mark.parametrize("mode", losses.MODES)
def test_packed_and_padded_batches_give_the_same_loss(tiny_model_dir, tokenizer, mode):
    from hftrain.modeling import load_model
    from hftrain.config import ModelSection

    model = load_model(ModelSection(name_or_path=tiny_model_dir), packing=True).eval()
    exs = [tokenize_example({"prompt": f"reverse: {'a ' * k}", "completion": "b " * (k + 2)}, tokenizer, False)
           for k in (1, 8, 2)]
    padded = make_collator(tokenizer, packing=False)(exs)
    packed = make_collator(tokenizer, packing=True)(exs)
    # two rows: the longest example alone; the two others and padding (a run of position_ids without targets)
    assert packed["input_ids"].shape == (2, len(exs[1]["input_ids"]))
    assert int((packed["position_ids"] == 0).sum()) == 4
    with torch.no_grad():
        lp = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
        lk = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
    a = losses.loss_sum(lp, padded["labels"], mode)
    b = losses.loss_sum(lk, packed["labels"], mode, packed["position_ids"])
    assert losses.count_targets(padded["labels"]) == losses.count_targets(packed["labels"], packed["position_ids"])
    within("loss.packed_vs_padded.loss", b, a, label=mode)


def test_aux_loss_term_gradient_is_mean_over_all_micro_batches():
    """Simulate W ranks x GA micro-batches: summing each rank's terms and averaging over ranks (DDP) gives
    coef * grad(mean aux), for any (W, GA) with the same micro-batches."""
    w = torch.tensor([1.5, -0.5], requires_grad=True)
    xs = [torch.tensor([float(i), 1.0 + i * i]) for i in range(8)]
    aux = lambda x: (w * x).pow(2).sum()  # noqa: E731 - nonlinear in w

    def grad(world, ga):
        w.grad = None
        total = 0.0
        for r in range(world):
            for k in range(ga):
                total = total + losses.aux_loss_term(aux(xs[r * ga + k]), 0.1, ga)
        (total / world).backward()  # DDP's mean over ranks
        return w.grad.clone()

    w.grad = None
    (0.1 * torch.stack([aux(x) for x in xs]).mean()).backward()
    ref = w.grad.clone()
    for world, ga in ((1, 8), (2, 4), (4, 2), (8, 1)):
        within("loss.aux_term_ranks_x_accumulation_vs_mean.grad", grad(world, ga), ref, label=f"{world} x GA{ga}")


# ---------------------------------------------------------------------------------------------------------------
# Real runs: 1 rank x GA4, 2 ranks x GA2, 2 ranks x GA1 (double micro-batch), same global batch of 8.

CONFIGS = {  # name: (processes, micro-batch, accumulation, packing, strategy, modes[, training.loss_impl])
    "1x_ga4": (1, 2, 4, False, "ddp", losses.MODES, "logits"),
    "2x_ga2": (2, 2, 2, False, "ddp", losses.MODES, "logits"),
    "2x_ga1_bs4": (2, 4, 1, False, "ddp", losses.MODES, "logits"),
    "1x_ga4_packed": (1, 2, 4, True, "ddp", ("token",), "logits"),
    "2x_ga2_fsdp": (2, 2, 2, False, "fsdp", ("token",)),
    "2x_ga2_zero2": (2, 2, 2, False, "zero2", ("token", "sequence"), "logits"),
    "2x_ga2_zero3": (2, 2, 2, False, "zero3", ("token",)),
    # the chunked linear cross-entropy (chunked_ce.py) must give the same losses and weights
    "1x_ga4_chunked": (1, 2, 4, False, "ddp", losses.MODES, "chunked"),
    "2x_ga2_chunked": (2, 2, 2, False, "ddp", losses.MODES, "chunked"),
    "1x_ga4_packed_chunked": (1, 2, 4, True, "ddp", ("token",), "chunked"),
    "2x_ga2_zero2_chunked": (2, 2, 2, False, "zero2", ("token",), "chunked"),
    "2x_ga2_fsdp_chunked": (2, 2, 2, False, "fsdp", ("token",), "chunked"),  # lm_head's weight gathered by FSDP2
    "2x_ga2_zero3_chunked": (2, 2, 2, False, "zero3", ("token",), "chunked"),  # lm_head gathered for the loss
}
LR = 0.5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, spiky_model_dir, deepspeed_ops):
    """Every (mode, config) run, one launch per (world size, strategy) (tests/matrix_worker.py): {(mode, name):
    losses, target counts, step-1 and final weights}, or the failed variant (its tests fail under its name)."""
    tiny_model_dir = spiky_model_dir
    tmp = tmp_path_factory.mktemp("loss")
    data = uneven_data(tmp / "uneven.jsonl")
    launches: dict[tuple[int, str], dict] = {}
    for mode in losses.MODES:
        for name, (world, bs, ga, packing, strategy, modes, *impl) in CONFIGS.items():
            if mode not in modes:
                continue
            out = tmp / f"{mode}_{name}"
            tree = {
                "model": {"name_or_path": tiny_model_dir, "dtype": "float32"},
                "data": {"sources": [{"path": data}], "max_length": 64, "packing": packing},
                "training": {"output_dir": str(out), "max_steps": 3, "per_device_train_batch_size": bs,
                             "gradient_accumulation_steps": ga, "optim": "sgd", "learning_rate": LR,
                             "lr_scheduler_type": "constant", "max_grad_norm": 0.0, "weight_decay": 0.0,
                             "logging_steps": 1, "save_steps": 1, "save_total_limit": None,
                             "train_sampling_strategy": "sequential", "seed": 0, "report_to": "none",
                             "disable_tqdm": True, "loss_averaging": mode, "loss_impl": (impl or ["auto"])[0]},
            }
            rec = tmp / f"{mode}_{name}.yaml"
            rec.write_text(yaml.safe_dump(tree))
            launches.setdefault((world, strategy), {})[f"{mode}_{name}"] = ("hftrain.recipes.sft", [str(rec)])
    results = {}
    for (world, strategy), variants in launches.items():
        for key, variant in run_matrix(launch_prefix(world, strategy), variants, tmp / f"matrix_{world}_{strategy}",
                                       ranks=world).items():
            mode, name = key.split("_", 1)
            results[(mode, name)] = outputs(tmp / key, variant, world, strategy) if variant.ok else variant
    return {"data": data, "results": results}


def outputs(out, variant, world, strategy) -> dict:
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == world, variant.name
    assert info["strategy"] == strategy, variant.name
    if world > 1 and strategy == "ddp":
        assert info["wrapper"] == "DistributedDataParallel", variant.name
    step1 = out / "checkpoint-1" / "model.safetensors"  # FSDP's sharded checkpoints hold no such file
    state = json.load(open(out / "trainer_state.json"))
    return {
        "losses": [h["loss"] for h in state["log_history"] if "loss" in h],
        "tokens": [h["target_tokens_per_step"] for h in state["log_history"] if "loss" in h],
        "step1": load_file(str(step1)) if step1.exists() else None,
        "final": load_file(str(out / "model.safetensors")),
    }


def result(runs, mode, name) -> dict:
    """The run's outputs; a variant that failed fails the test here, naming itself."""
    res = runs["results"][(mode, name)]
    if not isinstance(res, dict):
        res.check()
    return res


def untied(a: dict, b: dict) -> tuple[dict, dict]:
    """Both weight dicts on the keys they share: savers differ only in whether they also write the tied
    lm_head.weight (equal to the embedding)."""
    assert {k for k in a if k != "lm_head.weight"} == {k for k in b if k != "lm_head.weight"}
    return {k: v for k, v in a.items() if k in b}, {k: v for k, v in b.items() if k in a}


def reference(tiny_model_dir, tokenizer, data, mode):
    """Plain PyTorch on the concatenated global batch of step 1 (the first 8 examples)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = [json.loads(line) for line in open(data)][:8]
    exs = [tokenize_example(r, tokenizer, train_on_prompt=False) for r in rows]
    per_example = []  # (sum of CE, number of targets) for each example, computed alone
    for ex in exs:
        ids, lab = torch.tensor([ex["input_ids"]]), torch.tensor([ex["labels"]])
        logits = model(input_ids=ids).logits[0, :-1]
        tgt = lab[0, 1:]
        m = tgt != IGNORE_INDEX
        per_example.append((torch.nn.functional.cross_entropy(logits[m], tgt[m], reduction="sum"), int(m.sum())))
    if mode == "token":
        loss = sum(s for s, _ in per_example) / sum(n for _, n in per_example)
    else:
        loss = sum(s / n for s, n in per_example) / len(per_example)
    loss.backward()
    micro = [per_example[i:i + 2] for i in range(0, 8, 2)]  # the naive bug: mean of micro-batch means
    naive = sum(sum(s for s, _ in mb) / sum(n for _, n in mb) for mb in micro) / len(micro)
    return model, loss.item(), float(naive.detach()), sum(n for _, n in per_example)


@pytest.mark.launches
@pytest.mark.parametrize("mode", losses.MODES)
def test_first_step_matches_plain_pytorch_reference(runs, spiky_model_dir, tokenizer, mode):
    model, ref_loss, naive, n_tokens = reference(spiky_model_dir, tokenizer, runs["data"], mode)
    # Negative control: the mean of per-micro-batch means differs on this data by ~100x the tolerance below
    # (measured 1.1% for token, 0.65% for sequence), so these assertions can see that bug.
    beyond("loss.first_step_vs_pytorch.loss", naive, ref_loss, label=f"{mode}: mean of micro-batch means")
    expected_step1 = {k: (p - LR * p.grad).detach() for k, p in model.named_parameters()}
    for name in CONFIGS:
        if (mode, name) not in runs["results"]:
            continue
        res = result(runs, mode, name)
        within("loss.first_step_vs_pytorch.loss", res["losses"][0], ref_loss, label=f"{mode} {name}")
        beyond("loss.first_step_vs_pytorch.loss", naive, res["losses"][0], label=f"{mode} {name}: the naive mean")
        assert res["tokens"][0] == n_tokens
        if res["step1"] is not None:
            got = {k: v for k, v in res["step1"].items() if k in expected_step1}
            within("loss.first_step_vs_pytorch.weights", got, {k: expected_step1[k] for k in got},
                   label=f"{mode} {name}")
    assert result(runs, mode, "2x_ga2")["step1"] is not None


@pytest.mark.launches
@pytest.mark.parametrize("mode", losses.MODES)
def test_losses_and_weights_invariant_across_world_size_and_accumulation(runs, mode):
    base = result(runs, mode, "1x_ga4")
    assert len(base["losses"]) == 3
    for name in CONFIGS:
        if name == "1x_ga4" or (mode, name) not in runs["results"]:
            continue
        other = result(runs, mode, name)
        within("loss.layouts_vs_one_rank_ga4.losses", other["losses"], base["losses"], label=f"{mode} {name}")
        assert other["tokens"] == base["tokens"]
        within("loss.layouts_vs_one_rank_ga4.weights", *untied(other["final"], base["final"]), label=f"{mode} {name}")
