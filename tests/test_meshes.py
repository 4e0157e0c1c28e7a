"""Meshes past data parallelism (issue 68): strategy fsdp's dp_replicate_size / dp_shard_size / cp_size and ddp's
tp_size rendered into accelerate's config, checked, and run exact.

- HSDP: 2 replicas x 2 shards (4 processes, micro-batch 2) and (micro-batch 1, accumulation 2) against 1 process with
  accumulation 4, the same global batch of 8: losses, saved weights, held-out logits of the saved models; the
  per-micro-batch mean (the bug a layout can hide) is the control the loss bound must see.
- Tensor parallelism: 2 ranks splitting every layer (transformers' tp_plan at load time) against the same 1 process.
The refusals themselves run through `hftrain check` and the run alike in tests/test_bad_input.py (mesh_*)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hftrain.checkpoints.world_size import layout, layout_problems
from hftrain.config import StrategySection
from hftrain.constants import IGNORE_INDEX
from hftrain.launch.mesh_plan import mesh_rows
from hftrain.launch.plan import ModelFacts
from hftrain.launch.strategies import accelerate_config, render
from hftrain.config.mesh_rules import mesh_problems
from hftrain.mesh import launcher_mesh_problem, parallelism_config
from hftrain.methods import load_recipe
from hftrain.modeling import without_tied_copies
from hftrain.data import tokenize_example
from tests.exactness import beyond, within

from .conftest import ACCELERATE_LAUNCH, DEMO_TRAIN, PY, SMALL, launch_prefix, run_matrix, uneven_data
from .support import RESUMED, assert_resume_exact, free_port

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "mesh", "fsdp_hsdp_2x2.yaml")
LR = 0.5
HSDP = StrategySection(name="fsdp", num_processes=4, dp_replicate_size=2)


# -- rendering and the launcher's mesh ---------------------------------------------------------------------------

def test_hsdp_renders_accelerates_parallelism_config_equal_to_the_golden_file(tmp_path):
    written = render(HSDP, str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["fsdp.yaml"]
    body = open(written[0]).read().split("\n", 3)[3]  # after the header's path line
    assert body == open(GOLDEN).read().split("\n", 3)[3]
    cfg = yaml.safe_load(body)
    assert cfg["parallelism_config"] == {"parallelism_config_dp_replicate_size": 2,
                                         "parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 1,
                                         "parallelism_config_cp_size": 1}


def test_plain_fsdp_and_tensor_parallel_ddp_render_no_parallelism_config():
    """Plain FSDP2 needs no mesh; tensor parallelism is transformers' at load time, its Trainer builds the mesh
    (accelerate's launcher refuses a parallelism_config without FSDP)."""
    assert "parallelism_config" not in accelerate_config(StrategySection(name="fsdp", num_processes=4))
    tp = accelerate_config(StrategySection(name="ddp", num_processes=2, tp_size=2))
    assert "parallelism_config" not in tp and tp["distributed_type"] == "MULTI_GPU"


def test_the_shard_degree_is_what_the_others_leave_of_the_world():
    assert HSDP.mesh().degrees == [2, 2, 1, 1]
    assert StrategySection(name="fsdp", num_processes=8, dp_replicate_size=2).mesh().degrees == [2, 4, 1, 1]
    assert StrategySection(name="ddp", num_processes=2, tp_size=2).mesh().degrees == [1, 1, 2, 1]
    assert not StrategySection(name="fsdp", num_processes=4).mesh().beyond_sharding


def test_a_launcher_with_another_mesh_is_refused_naming_each_degree():
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4", "PARALLELISM_CONFIG_TP_SIZE": "1",
           "PARALLELISM_CONFIG_CP_SIZE": "1"}
    problem = launcher_mesh_problem(HSDP.mesh(), env)
    assert "strategy.dp_replicate_size 2 (the launcher's 1)" in problem
    assert "strategy.dp_shard_size 2 (the launcher's 4)" in problem and "hftrain config" in problem
    env.update(PARALLELISM_CONFIG_DP_REPLICATE_SIZE="2", PARALLELISM_CONFIG_DP_SHARD_SIZE="2")
    assert launcher_mesh_problem(HSDP.mesh(), env) is None
    assert launcher_mesh_problem(HSDP.mesh(), {}) is None  # no mesh from the launcher: the recipe's is built


def test_a_mesh_checkpoint_resumes_on_the_same_mesh_only(tmp_path):
    path = str(tmp_path)
    with open(os.path.join(path, "hftrain_checkpoint.json"), "w") as fh:
        json.dump(layout(4, 2, 1, "fsdp", mesh=[2, 2, 1, 1]), fh)
    assert layout_problems(path, layout(4, 2, 1, "fsdp", mesh=[2, 2, 1, 1])) == []
    plain = layout_problems(path, layout(4, 2, 1, "fsdp"))
    assert len(plain) == 1 and "written on the device mesh [2, 2, 1, 1]" in plain[0]
    assert "dp_replicate_size: 2, dp_shard_size: 2, tp_size: 1, cp_size: 1 on 4 processes" in plain[0]
    with open(os.path.join(path, "hftrain_checkpoint.json"), "w") as fh:
        json.dump(layout(4, 2, 1, "fsdp"), fh)
    assert "this run's is [2, 2, 1, 1]" in layout_problems(path, layout(4, 2, 1, "fsdp", mesh=[2, 2, 1, 1]))[0]


def test_tied_copies_are_left_out_of_a_gathered_state_dict_only_where_declared_and_equal():
    class Model:
        all_tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    w = torch.arange(6.0).reshape(2, 3)
    sd = {"model.embed_tokens.weight": w, "lm_head.weight": w.clone(), "x": torch.ones(1)}
    assert set(without_tied_copies(sd, Model())) == {"model.embed_tokens.weight", "x"}
    untied = {**sd, "lm_head.weight": w + 1}  # trained apart: not a copy, kept
    assert set(without_tied_copies(untied, Model())) == set(sd)
    assert set(without_tied_copies(sd, object())) == set(sd)


# -- runs --------------------------------------------------------------------------------------------------------

HSDP_STRATEGY = {"name": "fsdp", "num_processes": 4, "dp_replicate_size": 2}
VARIANTS = {  # name: (strategy, micro-batch, accumulation, steps, training options beside the common ones)
    "one": ({"name": "ddp", "num_processes": 1}, 2, 4, 3, {}),
    "hsdp": (HSDP_STRATEGY, 2, 1, 3, {}),
    "hsdp_ga2": ({**HSDP_STRATEGY, "dp_shard_size": 2}, 1, 2, 3, {}),
    "tp": ({"name": "ddp", "num_processes": 2, "tp_size": 2}, 2, 4, 3, {"save_only_model": True}),
    "tp_packed": ({"name": "ddp", "num_processes": 2, "tp_size": 2}, 2, 4, 3, {"save_only_model": True}),
}
PACKED = {"tp_packed"}  # data.packing: rows joined, attention kept to each example
# HSDP resumed on its own mesh (tests/support.py's resume check: AdamW, a checkpoint at step 2 resumed later in the
# same launch, and the weights alone resumed as the control).
RESUME_CHECKPOINT = "resume_hsdp/checkpoint-2"
for _name, _more in (("", {}), ("_after", {"resume_from_checkpoint": RESUME_CHECKPOINT}),
                     ("_weights_only", {"resume_from_checkpoint": RESUME_CHECKPOINT, "resume_weights_only": True})):
    VARIANTS[f"resume_hsdp{_name}"] = (HSDP_STRATEGY, 2, 1, 4, {**RESUMED, **_more})


def _recipe(tmp, model, data, name) -> str:
    strategy, bs, ga, steps, training = VARIANTS[name]
    if "resume_from_checkpoint" in training:
        training = {**training, "resume_from_checkpoint": str(tmp / training["resume_from_checkpoint"])}
    tree = {"model": {"name_or_path": model, "dtype": "float32"},
            "data": {"sources": [{"path": data}], "max_length": 64, "packing": name in PACKED},
            "training": {"output_dir": str(tmp / name), "max_steps": steps, "per_device_train_batch_size": bs,
                         "gradient_accumulation_steps": ga, "optim": "sgd", "learning_rate": LR,
                         "lr_scheduler_type": "constant", "max_grad_norm": 0.0, "weight_decay": 0.0,
                         "logging_steps": 1, "save_steps": 3, "train_sampling_strategy": "sequential", "seed": 0,
                         "report_to": "none", "disable_tqdm": True, **training},
            "strategy": strategy}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


@pytest.fixture(scope="module")
def mesh_model(tmp_path_factory):
    """A tiny Llama tensor parallelism can split (4 heads, 2 key/value heads), with large initial weights so that
    examples' per-token losses differ and a per-micro-batch mean is told from the global one."""
    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    out = str(tmp_path_factory.mktemp("mesh_model") / "base")
    return build_tiny_model(out, texts_of_jsonl([DEMO_TRAIN]), vocab_size=300, seed=0,
                            config={**SMALL, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "initializer_range": 0.3})


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory, mesh_model):
    """Each variant once: 1 process, HSDP's two layouts in one 4-process launch (its config rendered from the
    recipe), tensor parallelism in a 2-process launch. {name: output folder, or the failed VariantResult}."""
    tmp = tmp_path_factory.mktemp("mesh_runs")
    data = uneven_data(tmp / "uneven.jsonl")
    recipes = {name: _recipe(tmp, mesh_model, data, name) for name in VARIANTS}
    (tmp / "hsdp_config").mkdir()
    hsdp_config = render(HSDP, str(tmp / "hsdp_config"))[0]
    launches = [
        ([PY], ["one"], 1),
        ([*ACCELERATE_LAUNCH, "--config_file", hsdp_config, "--main_process_port", str(free_port())],
         ["hsdp", "hsdp_ga2", "resume_hsdp", "resume_hsdp_after", "resume_hsdp_weights_only"], 4),
        (launch_prefix(2, "ddp"), ["tp", "tp_packed"], 2),
    ]
    results = {"data": data, "model": mesh_model, "tmp": tmp, "variants": {}}
    for prefix, names, ranks in launches:
        variants = {n: ("hftrain.recipes.sft", [recipes[n]]) for n in names}
        for name, variant in run_matrix(prefix, variants, tmp / f"matrix_{names[0]}", ranks=ranks).items():
            results[name] = str(tmp / name) if variant.ok else variant
            results["variants"][name] = variant
    return results


def _run(mesh_runs, name) -> dict:
    out = mesh_runs[name]
    if not isinstance(out, str):
        out.check()
    state = json.load(open(os.path.join(out, "trainer_state.json")))
    return {"losses": [h["loss"] for h in state["log_history"] if "loss" in h],
            "tokens": [h["target_tokens_per_step"] for h in state["log_history"] if "loss" in h],
            "weights": load_file(os.path.join(out, "model.safetensors")),
            "info": json.load(open(os.path.join(out, "run_info.json"))), "folder": out}


def _heldout_logits(folder: str) -> torch.Tensor:
    """The saved model, loaded by from_pretrained, on held-out rows (the demo's last rows, not trained on)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(line) for line in open(DEMO_TRAIN)][-3:]
    text = [" ".join(m["content"] for m in r["messages"]) for r in rows]
    ids = [tok(t)["input_ids"][:24] for t in text]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([i])).logits[0] for i in ids])


def _micro_batch_mean_of_first_step(model_dir: str, data: str) -> float:
    """The naive loss of step 1: the mean of its four micro-batches' token means (plain PyTorch), for the control."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sums = []
    for row in [json.loads(line) for line in open(data)][:8]:
        ex = tokenize_example(row, tok, train_on_prompt=False)
        logits = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0, :-1]
        target = torch.tensor(ex["labels"][1:])
        kept = target != IGNORE_INDEX
        ce = torch.nn.functional.cross_entropy(logits[kept], target[kept], reduction="sum")
        sums.append((float(ce.detach()), int(kept.sum())))
    return sum(sum(s for s, _ in sums[i:i + 2]) / sum(n for _, n in sums[i:i + 2]) for i in range(0, 8, 2)) / 4


def _untied(a: dict, b: dict) -> tuple[dict, dict]:
    assert set(a) == set(b), "the saves hold other names (a tied copy written by one of them?)"
    return a, b


@pytest.mark.launches
@pytest.mark.parametrize("name", ["hsdp", "hsdp_ga2"])
def test_hsdp_equals_one_process_with_the_same_global_batch(mesh_runs, name):
    one, run = _run(mesh_runs, "one"), _run(mesh_runs, name)
    assert run["info"]["world_size"] == 4 and run["info"]["strategy"] == "fsdp"
    assert run["info"]["mesh"] == [2, 2, 1, 1] and run["info"]["fsdp2_modules"] >= 3
    naive = _micro_batch_mean_of_first_step(mesh_runs["model"], mesh_runs["data"])
    beyond("mesh.hsdp_vs_one_rank.losses", naive, one["losses"][0], label="the per-micro-batch mean")
    within("mesh.hsdp_vs_one_rank.losses", run["losses"], one["losses"], label=name)
    assert run["tokens"] == one["tokens"]
    within("mesh.hsdp_vs_one_rank.weights", *_untied(run["weights"], one["weights"]), label=name)
    within("mesh.hsdp_vs_one_rank.heldout_logits", _heldout_logits(run["folder"]), _heldout_logits(one["folder"]),
           label=name)


@pytest.mark.launches
@pytest.mark.parametrize("name", ["tp", "tp_packed"])
def test_tensor_parallel_equals_one_process(mesh_runs, name):
    one, run = _run(mesh_runs, "one"), _run(mesh_runs, name)
    assert run["info"]["world_size"] == 2 and run["info"]["mesh"] == [1, 1, 2, 1]
    assert run["info"]["rank_weight_digests"] is None  # each rank holds its slices, not a replica
    naive = _micro_batch_mean_of_first_step(mesh_runs["model"], mesh_runs["data"])
    beyond("mesh.tp_vs_one_rank.losses", naive, one["losses"][0], label="the per-micro-batch mean")
    within("mesh.tp_vs_one_rank.losses", run["losses"], one["losses"], label=name)
    assert run["tokens"] == one["tokens"]  # the tensor-parallel copies of a micro-batch counted once
    within("mesh.tp_vs_one_rank.weights", *_untied(run["weights"], one["weights"]), label=name)
    within("mesh.tp_vs_one_rank.heldout_logits", _heldout_logits(run["folder"]), _heldout_logits(one["folder"]),
           label=name)


def test_the_plan_counts_hsdp_within_a_node_and_tensor_parallel_activations_split():
    """launch/mesh_plan.py's rows by hand: HSDP shards over a node's GPUs only, TP over all, its activations split
    but for 10·s·b·h per layer and the logits."""
    psi = 1_000_000_000
    f = ModelFacts(params=psi, trainable=psi, largest_layer=10_000_000, hidden=4096, layers=32, vocab=32000,
                   weight_bytes=2)
    hsdp, tp = mesh_rows(f, gpus_per_node=8, nodes=2, micro_batch=1, seq=4096, checkpointing=False, mixed=True)
    assert hsdp.strategy == "hsdp 2x8" and tp.strategy == "tp 16"
    assert hsdp.gpu_params == pytest.approx(2 * psi / 8 + 4 * 10_000_000)
    assert hsdp.gpu_optimizer == pytest.approx(4 * psi / 8) and tp.gpu_optimizer == pytest.approx(4 * psi / 16)
    sbh = 4096 * 1 * 4096
    logits = 2 * 4 * 4096 * 32000
    assert tp.gpu_activations == pytest.approx(32 * (10 + 24 / 16) * sbh + logits)
    assert hsdp.gpu_activations == pytest.approx(32 * 34 * sbh + logits)
    assert [r.strategy for r in mesh_rows(f, 8, 1, 1, 4096, False, True)] == ["tp 8"]  # one node: no HSDP


@pytest.mark.launches
def test_hsdp_resumes_exactly_on_its_own_mesh(mesh_runs):
    """Steps 3-4 resumed from checkpoint-2 (FSDP2's sharded weights and AdamW state, the data position) on the same
    2 x 2 mesh equal the uninterrupted run's; the weights alone resumed (a fresh AdamW) are the control."""
    assert_resume_exact(mesh_runs["tmp"], mesh_runs["variants"], "hsdp", "mesh.hsdp")


def test_replicas_beside_context_parallelism_without_shards_are_refused_as_accelerate_refuses_them():
    recipe = load_recipe(None, ["model.name_or_path=m", "data.sources.0.path=d"], raw={})
    bad = dataclasses.replace(recipe, strategy=StrategySection(name="fsdp", num_processes=4, dp_replicate_size=2,
                                                               cp_size=2))
    assert [k for k, _ in mesh_problems(bad, "fsdp")] == ["strategy.dp_replicate_size"]
    with pytest.raises(ValueError, match="cannot be used with pure data parallelism"):  # accelerate's own refusal
        parallelism_config(bad.strategy.mesh())
    good = dataclasses.replace(bad, strategy=dataclasses.replace(bad.strategy, num_processes=8))
    assert mesh_problems(good, "fsdp") == []
