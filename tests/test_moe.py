"""MoE: upcycling with native export, the aux loss's exactness over ranks and accumulation, router health, ZeRO-3."""

import json
import os

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hftrain.errors import MoeError
from hftrain.moe.aux import z_loss
from hftrain.moe.blocks import moe_blocks, routers
from hftrain.moe.upcycle import upcycle
from tests.exactness import beyond, within
from tests.support import free_port

from .conftest import ACCELERATE_LAUNCH, DEMO_TRAIN, PY, REPO, SMALL, launch_prefix, run, run_matrix

IDS = torch.tensor([[3, 17, 42, 99, 7, 250, 11, 64, 5, 128], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]])


def dense(kind: str, seed=0):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind]
    torch.manual_seed(seed)
    cfg = cls(vocab_size=300, **SMALL, initializer_range=0.3)  # large weights: logits differ a lot between tokens
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("kind,layers,target", [("llama", None, "MixtralForCausalLM"),
                                                ("mistral", None, "MixtralForCausalLM"),
                                                ("qwen2", None, "Qwen2MoeForCausalLM"),
                                                ("qwen2", [1], "Qwen2MoeForCausalLM"),
                                                ("qwen3", None, "Qwen3MoeForCausalLM"),
                                                ("qwen3", [1], "Qwen3MoeForCausalLM")])
def test_upcycled_logits_equal_dense(kind, layers, target):
    d = dense(kind)
    m = upcycle(d, num_experts=4, top_k=2, layers=layers).eval()
    assert type(m).__name__ == target
    assert len(moe_blocks(m)) == (len(layers) if layers else d.config.num_hidden_layers)
    if layers:  # the other layers keep the dense MLP (Qwen2-MoE's and Qwen3-MoE's mlp_only_layers)
        assert type(m.model.layers[0].mlp).__name__ in ("Qwen2MoeMLP", "Qwen3MoeMLP")
    with torch.no_grad():
        a, b = d(input_ids=IDS).logits, m(input_ids=IDS).logits
        # the routers really route: different tokens go to different experts
        idx = routers(m)[0](m.model.embed_tokens(IDS))[2]
    assert a.abs().max() > 1.0
    within("moe.upcycled_vs_dense.logits", b, a, label=f"{kind} layers={layers}")
    assert idx.unique().numel() == 4


def test_unsupported_families_and_partial_mixtral_are_refused():
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(MoeError, match="supported: llama -> mixtral, mistral -> mixtral, qwen2 -> qwen2_moe, "
                                       "qwen3 -> qwen3_moe"):
        upcycle(gpt2, 4, 2)
    with pytest.raises(MoeError, match="every layer must be upcycled"):
        upcycle(dense("llama"), 4, 2, layers=[0])
    with pytest.raises(MoeError, match="top_k: must be in 1..4"):
        upcycle(dense("llama"), 4, 5)


EXPORT_CHECK = r"""
import sys, torch
from transformers import AutoModelForCausalLM
from safetensors.torch import save_file
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.tensor({ids})
with torch.no_grad():
    logits = m(input_ids=ids).logits
assert 'hftrain' not in sys.modules, [k for k in sys.modules if k.startswith('hftrain')]
save_file({{"logits": logits.contiguous()}}, sys.argv[2])
print(type(m).__name__, m.config.model_type)
"""


def reload_without_hftrain(folder, tmp_path):
    out = tmp_path / "logits.safetensors"
    script = tmp_path / "check.py"
    script.write_text(EXPORT_CHECK.format(ids=IDS.tolist()))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of hftrain is importable
    import subprocess

    r = subprocess.run([PY, "-I", str(script), str(folder), str(out)], capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path), env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout.split()[:2], load_file(str(out))["logits"]


@pytest.mark.launches
def test_cli_upcycle_exports_a_native_mixtral_that_reloads_without_hftrain(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "mixtral"
    r = run([PY, "-m", "hftrain.cli", "moe", "upcycle", "--model", tiny_model_dir, "--num-experts", "4",
             "--top-k", "2", "--output", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.load(open(out / "config.json"))["architectures"] == ["MixtralForCausalLM"]
    assert os.path.isfile(out / "tokenizer.json")
    (cls, model_type), logits = reload_without_hftrain(out, tmp_path)
    assert (cls, model_type) == ("MixtralForCausalLM", "mixtral")
    d = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        within("moe.upcycled_vs_dense.logits", logits, d(input_ids=IDS).logits, label="cli llama -> mixtral")
    # refused family / partial Mixtral: exit status 2 and the reason
    r = run([PY, "-m", "hftrain.cli", "moe", "upcycle", "--model", tiny_model_dir, "--num-experts", "4",
             "--top-k", "2", "--layers", "0", "--output", str(tmp_path / "x")])
    assert r.returncode == 2 and "every layer must be upcycled" in r.stderr


@pytest.mark.launches
def test_qwen2_moe_export_with_dense_layers_reloads_without_hftrain(tmp_path):
    d = dense("qwen2")
    m = upcycle(d, 4, 2, layers=[0])
    m.save_pretrained(tmp_path / "qmoe")
    (cls, model_type), logits = reload_without_hftrain(tmp_path / "qmoe", tmp_path)
    assert (cls, model_type) == ("Qwen2MoeForCausalLM", "qwen2_moe")
    assert json.load(open(tmp_path / "qmoe" / "config.json"))["mlp_only_layers"] == [1]
    with torch.no_grad():
        within("moe.upcycled_vs_dense.logits", logits, d(input_ids=IDS).logits, label="qwen2_moe reloaded")


def test_qwen3_moe_upcycled_with_dense_layers_saves_and_reloads_as_native(tmp_path):
    """Qwen3 -> Qwen3-MoE keeps Qwen3's own head size (not hidden_size / heads) through save and reload."""
    from transformers import AutoModelForCausalLM

    d = dense("qwen3")
    m = upcycle(d, 4, 2, layers=[1])
    m.save_pretrained(tmp_path / "q3moe")
    config = json.load(open(tmp_path / "q3moe" / "config.json"))
    assert (config["model_type"], config["mlp_only_layers"]) == ("qwen3_moe", [0])
    assert config["head_dim"] == d.config.head_dim
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q3moe").eval()
    with torch.no_grad():
        within("moe.upcycled_vs_dense.logits", again(input_ids=IDS).logits, d(input_ids=IDS).logits,
               label="qwen3_moe reloaded")


def test_moe_model_returns_aux_loss_but_no_loss_of_its_own():
    """hftrain passes no labels: the model must not fold its aux loss into a loss (which the Trainer would scale by
    the world size); hftrain adds it itself, once, through aux_losses."""
    m = upcycle(dense("llama"), 4, 2, router_init_std=1.0).train()
    m.config.output_router_logits = True
    out = m(input_ids=IDS)
    assert out.loss is None and out.aux_loss.ndim == 0 and out.aux_loss > 0
    assert len(out.router_logits) == 2
    z = z_loss(out.router_logits, None)
    mask = torch.ones(IDS.numel())
    mask[:5] = 0
    assert z_loss(out.router_logits, mask) != z  # padding rows are left out


# ---------------------------------------------------------------------------------------------------------------
# Training: a recipe run that upcycles, trains with the aux and z losses, logs router health


def recipe_tree(model_dir, out, **training):
    return {
        "model": {"name_or_path": str(model_dir), "dtype": "float32"},
        "data": {"sources": [{"path": DEMO_TRAIN}], "max_length": 64, "eval_fraction": 0.05},
        "training": {"output_dir": str(out), "max_steps": 6, "per_device_train_batch_size": 4,
                     "learning_rate": 3e-3, "lr_scheduler_type": "constant", "logging_steps": 2,
                     "save_strategy": "no", "train_sampling_strategy": "sequential", "seed": 0,
                     "report_to": "none", "disable_tqdm": True, "eval_strategy": "no", **training},
        "moe": {"upcycle": {"num_experts": 4, "top_k": 2}, "aux_loss_coef": 0.01, "router_z_loss_coef": 0.001},
    }


@pytest.mark.launches
def test_recipe_upcycles_trains_and_experts_specialise(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump(recipe_tree(tiny_model_dir, out)))
    r = run([PY, "recipes/sft.py", str(rec)], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "'aux_losses': ['moe_aux_loss', 'moe_z_loss']" in r.stdout
    cfg = json.load(open(out / "config.json"))
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == 4
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for layer in m.model.layers:
        w = layer.mlp.experts.gate_up_proj.detach()  # (E, 2I, H), identical copies at step 0
        for i in range(4):
            for j in range(i + 1, 4):
                rel = (w[i] - w[j]).abs().max() / w[i].abs().max()
                assert rel > 1e-3, f"experts {i} and {j} did not specialise ({rel:.1e})"
    logs = [h for h in json.load(open(out / "trainer_state.json"))["log_history"] if "loss" in h]
    assert len(logs) == 3
    for h in logs:
        assert h["moe_aux_loss"] > 0 and h["moe_z_loss"] > 0
        for layer in range(2):
            load = [h[f"moe/layer{layer}/load_e{e}"] for e in range(4)]
            assert sum(load) == pytest.approx(1.0) and sum(x > 0 for x in load) >= 2  # top-2: two experts at least
            assert 0 < h[f"moe/layer{layer}/entropy"] <= 1 and h[f"moe/layer{layer}/max_load"] >= 1
        assert h["moe/dropped_tokens"] == 0
    for layer in range(2):  # every expert is routed to (one may get no token in a logged window of 2 x 4 rows)
        assert all(sum(h[f"moe/layer{layer}/load_e{e}"] for h in logs) > 0 for e in range(4))
    assert os.path.getsize(out / "expert_load.png") > 1000


def test_recipe_moe_section_is_validated():
    from hftrain.config import RecipeError
    from hftrain.methods import load_recipe

    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["model.name_or_path=m", "data.sources.0.path=d", "moe.upcycle.num_experts=1",
                           "moe.aux_loss_coef=-1", "model.lora.r=8", "moe.upcycle.top_kk=2"], raw={})
    msg = str(e.value)
    assert "moe.upcycle.num_experts: must be >= 2" in msg and "moe.aux_loss_coef: must be >= 0" in msg
    assert "moe.upcycle: cannot be combined with model.lora" in msg and "top_kk" in msg


# ---------------------------------------------------------------------------------------------------------------
# Aux-loss exactness on real runs: 1 rank x GA4 and 2 ranks x GA2 (same global batch of 8), with a negative control


@pytest.fixture(scope="module")
def tiny_mixtral_dir(tmp_path_factory):
    """A tiny Mixtral (upcycled from a tiny Llama with large weights, routers with large weights so that the routing
    and hence the aux loss differ a lot between micro-batches)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    tmp = tmp_path_factory.mktemp("mixtral")
    base = build_tiny_model(str(tmp / "dense"), texts_of_jsonl([DEMO_TRAIN]),
                            config={**SMALL, "initializer_range": 0.3}, vocab_size=300, seed=0)
    m = upcycle(AutoModelForCausalLM.from_pretrained(base), 4, 2, router_init_std=1.0)
    # experts made different, as in a trained MoE (identical experts give the router no gradient from the LM loss)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(torch.linspace(0.5, 1.5, 4).view(4, 1, 1))
    m.save_pretrained(tmp / "mixtral")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp / "mixtral")
    return str(tmp / "mixtral")


def tiny_family_moe(model_type: str, tokenizer_dir: str, out: str) -> str:
    """A tiny model of an MoE family with the tokenizer of `tokenizer_dir`: 8 experts, top-2; DeepSeek-V3 and GLM-4.5
    with routers choosing by score plus a bias (two groups of 4 experts), a shared expert and the first layer dense;
    routers with large weights, so that no routing is a near tie that rounding could flip between batch layouts."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    keys = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2,
                max_position_embeddings=128, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    if model_type in BIASED:
        keys.update(n_routed_experts=8, n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1)
    else:  # each family's own name for the expert count (the others ignore it), and Qwen2-MoE's shared expert
        keys.update(num_experts=8, num_local_experts=8, shared_expert_intermediate_size=32, head_dim=16)
    if model_type == "deepseek_v3":  # the head sizes a DeepSeek-V3 config builds with (FEASIBILITY.md)
        keys.update(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                    head_dim=8, rope_interleave=True)
    elif model_type == "glm4_moe":
        keys.update(head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **keys))
    with torch.no_grad():
        for router in routers(model):
            router.weight.normal_(0.0, 1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


BIASED = ("deepseek_v3", "glm4_moe")
# Today's families with a softmax router and their own load-balancing loss, beside the tiny Mixtral.
AUX_FAMILIES = ("qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
BIAS_RATE = 0.05  # large enough to change routings within the runs' 3 steps (the default is the paper's 0.001)
EP_TRAINING = {"optim": "adamw_torch", "learning_rate": 1e-2, "max_grad_norm": 0.05, "save_strategy": "steps",
               "save_steps": 2}
AUX_RUNS = {  # name: (processes, accumulation, script, extra moe keys)
    "1x_ga4": (1, 4, "recipes/sft.py", {}),
    "2x_ga2": (2, 2, "recipes/sft.py", {}),
    # the experts split over the 2 ranks (all_to_all dispatch), under DDP: same training as 1 rank with all experts
    "2x_ga2_ep": (2, 2, "recipes/sft.py", {"expert_parallel_size": 2}),
    "2x_ga2_ep_unscaled": (2, 2, "tests/moe_ep_unscaled.py", {"expert_parallel_size": 2}),
    "1x_ga4_unscaled": (1, 4, "tests/moe_unscaled_aux.py", {}),
    # with AdamW, clipping that bites, a checkpoint at step 2 and held-out exact match; the resume continues the split
    # experts' checkpoint-2 (the same launch, after it) to step 3
    "1x_ga4_clip": (1, 4, "recipes/sft.py", {"training": EP_TRAINING, "exact_match": True}),
    "2x_ga2_ep_clip": (2, 2, "recipes/sft.py", {"expert_parallel_size": 2, "training": EP_TRAINING,
                                                "exact_match": True}),
    "2x_ga2_ep_resumed": (2, 2, "recipes/sft.py", {"expert_parallel_size": 2, "training": EP_TRAINING,
                                                   "resume": "2x_ga2_ep_clip/checkpoint-2"}),
    "1x_ga4_resumed": (1, 4, "recipes/sft.py", {"training": EP_TRAINING, "resume": "1x_ga4_clip/checkpoint-2"}),
    # the best checkpoint loaded at the end: the one with the highest held-out loss, so not the last
    "1x_ga4_best": (1, 4, "recipes/sft.py", {"exact_match": True, "training": {
        **EP_TRAINING, "save_steps": 1, "eval_strategy": "steps", "eval_steps": 1, "load_best_model_at_end": True,
        "metric_for_best_model": "eval_loss", "greater_is_better": True}}),
    "2x_ga2_ep_local_clip": (2, 2, "tests/moe_ep_local_clip.py", {"expert_parallel_size": 2, "training": EP_TRAINING}),
    # the same under FSDP2: the dense part sharded, each rank's experts its own (one launch of the fsdp config)
    "2x_ga2_ep_fsdp": (2, 2, "recipes/sft.py", {"expert_parallel_size": 2, "training": EP_TRAINING, "strategy": "fsdp",
                                                "exact_match": True}),
    "2x_ga2_ep_fsdp_resumed": (2, 2, "recipes/sft.py", {"expert_parallel_size": 2, "training": EP_TRAINING,
                                                        "strategy": "fsdp", "resume": "2x_ga2_ep_fsdp/checkpoint-2"}),
    "2x_ga2_unscaled": (2, 2, "tests/moe_unscaled_aux.py", {}),
    # aux-loss-free balancing: the biases moved from the global batch's loads (moe/balance.py)
    **{f"{world}x_ga{ga}_{family}": (world, ga, "recipes/sft.py", {"bias_update_rate": BIAS_RATE, "family": family})
       for family in BIASED for world, ga in ((1, 4), (2, 2))},
    # every family through the recipe, with its own aux loss and the z-loss
    **{f"{world}x_ga{ga}_{family}": (world, ga, "recipes/sft.py", {"family": family})
       for family in AUX_FAMILIES for world, ga in ((1, 4), (2, 2))},
    # every family under ZeRO-3 (MoE blocks as leaf modules; one launch of the zero3 config)
    **{f"2x_ga2_zero3_{family or 'mixtral'}": (2, 2, "recipes/sft.py", {
        "family": family, "strategy": "zero3", **({"bias_update_rate": BIAS_RATE} if family in BIASED else {})})
       for family in (None, *AUX_FAMILIES, *BIASED)},
}


@pytest.fixture(scope="module")
def aux_runs(tmp_path_factory, tiny_mixtral_dir, deepspeed_ops):
    """Every AUX_RUNS run: the recipe script's runs in one launch per world size (tests/matrix_worker.py), each
    negative control (it patches the whole process) in a launch of its own."""
    from .test_loss import uneven_data

    tmp = tmp_path_factory.mktemp("aux")
    data = uneven_data(tmp / "uneven.jsonl")
    models = {f: tiny_family_moe(f, tiny_mixtral_dir, str(tmp / f)) for f in BIASED + AUX_FAMILIES}
    launches: dict[tuple[int, str], dict] = {}
    for name, (world, ga, script, extra) in AUX_RUNS.items():
        out = tmp / name
        family, training = extra.get("family"), extra.get("training", {})
        resume, exact, strategy = extra.get("resume"), extra.get("exact_match"), extra.get("strategy", "ddp")
        extra = {k: v for k, v in extra.items() if k not in ("family", "training", "resume", "exact_match", "strategy")}
        moe_keys = {"aux_loss_coef": 0.1, "router_z_loss_coef": 0.01} if family not in BIASED else {}
        tree = {
            "model": {"name_or_path": models[family] if family else tiny_mixtral_dir, "dtype": "float32"},
            "data": {"sources": [{"path": data}], "max_length": 64},
            "training": {"output_dir": str(out), "max_steps": 3, "per_device_train_batch_size": 2,
                         "gradient_accumulation_steps": ga, "optim": "sgd", "learning_rate": 0.5,
                         "lr_scheduler_type": "constant", "max_grad_norm": 0.0, "weight_decay": 0.0,
                         "logging_steps": 1, "save_strategy": "no", "train_sampling_strategy": "sequential",
                         "seed": 0, "report_to": "none", "disable_tqdm": True, **training},
            "moe": {**moe_keys, **extra},
            "strategy": {"name": strategy},
        }
        if resume:
            tree["training"]["resume_from_checkpoint"] = str(tmp / resume)
        if exact:
            tree["data"]["eval_sources"] = [{"path": data}]
            tree["eval"] = {"exact_match": 6, "max_new_tokens": 4}
        rec = tmp / f"{name}.yaml"
        rec.write_text(yaml.safe_dump(tree))
        launches.setdefault((world, script, strategy), {})[name] = rec
    res = {}
    for (world, script, strategy), recipes in launches.items():
        prefix = launch_prefix(world, strategy)
        if script == "recipes/sft.py":
            variants = {name: ("hftrain.recipes.sft", [rec]) for name, rec in recipes.items()}
            ran = run_matrix(prefix, variants, tmp / f"matrix_{world}", ranks=world)
            for v in ran.values():
                v.check()
            outputs = {name: v.stdout for name, v in ran.items()}
        else:
            (name, rec), = recipes.items()
            r = run([*prefix, script, str(rec)], timeout=600)
            if script != "tests/moe_ep_local_clip.py":  # that one is expected to stop at its save (its test says)
                assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            outputs = {name: r.stdout + r.stderr}
        for name, stdout in outputs.items():
            res[name] = aux_outputs(tmp / name, world, stdout, strategy)
    return res


def aux_outputs(out, world, stdout, strategy="ddp") -> dict:
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == world
    if world > 1:
        wrapper = {"ddp": "DistributedDataParallel", "zero3": "DeepSpeedEngine"}.get(strategy, "FSDP")
        assert info["wrapper"].startswith(wrapper), info["wrapper"]
    logs = [h for h in json.load(open(out / "trainer_state.json"))["log_history"] if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "aux": [h.get("moe_aux_loss") for h in logs],
            "z": [h.get("moe_z_loss") for h in logs], "logs": logs, "folder": out,
            "final": load_file(str(out / "model.safetensors")), "stdout": stdout, "info": info}


def max_rel(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp(min=1e-12))
               for k in b)


@pytest.mark.launches
def test_aux_loss_is_invariant_to_world_size_and_accumulation(aux_runs):
    base, other = aux_runs["1x_ga4"], aux_runs["2x_ga2"]
    for name, r in aux_runs.items():
        if set(r["final"]) == set(base["final"]):  # the runs of the tiny Mixtral (not the bias-balanced families)
            print(name, "losses", r["losses"], "aux", r["aux"], "weights rel. to 1x_ga4",
                  max_rel(r["final"], base["final"]))
    assert len(base["losses"]) == 3 and min(base["aux"]) > 1.0  # the aux term is a sizeable part of the loss
    within("moe.aux_ddp_vs_one_rank.losses", other["losses"], base["losses"])
    within("moe.aux_ddp_vs_one_rank.weights", other["final"], base["final"])
    # Negative control: coef * aux on each micro-batch's loss (no / accumulation) is not invariant, and the
    # difference is far above the bounds used above (per-step loss and weights).
    bad1, bad2 = aux_runs["1x_ga4_unscaled"], aux_runs["2x_ga2_unscaled"]
    for step, (a, b) in enumerate(zip(bad1["losses"], bad2["losses"]), 1):
        beyond("moe.aux_ddp_vs_one_rank.losses", a, b, label=f"unscaled, step {step}")
    beyond("moe.aux_ddp_vs_one_rank.weights", bad1["final"], bad2["final"], label="unscaled 1x_ga4 vs 2x_ga2")
    beyond("moe.aux_ddp_vs_one_rank.weights", bad2["final"], base["final"], label="unscaled 2x_ga2 vs 1x_ga4")


@pytest.mark.launches
@pytest.mark.parametrize("family", BIASED)
def test_bias_balancing_is_invariant_to_world_size_and_accumulation(aux_runs, family):
    """DeepSeek-V3 and GLM-4.5 (no aux loss; routers with a bias): 2 ranks x GA2 move the biases as 1 rank x GA4
    does (the loads of the global batch), and train alike."""
    base, other = aux_runs[f"1x_ga4_{family}"], aux_runs[f"2x_ga2_{family}"]
    assert f"'bias_balancing': '2 routers, rate {BIAS_RATE}'" in base["stdout"]
    biases = {k: v for k, v in base["final"].items() if k.endswith("e_score_correction_bias")}
    assert len(biases) == 2 and all(v.abs().max() > 0 for v in biases.values())
    # 3 steps of +-rate (or 0) each: every bias is a multiple of the rate, at most 3 of them
    assert all(torch.allclose(v / BIAS_RATE, (v / BIAS_RATE).round(), atol=1e-4) for v in biases.values())
    assert max(v.abs().max() for v in biases.values()) <= 3 * BIAS_RATE + 1e-6
    for k, v in biases.items():
        assert torch.equal(other["final"][k], v), k
    within("moe.bias_ddp_vs_one_rank.losses", other["losses"], base["losses"], label=family)
    within("moe.bias_ddp_vs_one_rank.weights", other["final"], base["final"], label=family)


@pytest.mark.launches
@pytest.mark.parametrize("family", AUX_FAMILIES)
def test_each_family_trains_through_the_recipe_with_its_aux_loss_exact_over_ranks(aux_runs, family):
    """Qwen2-MoE, Qwen3-MoE, OLMoE and gpt-oss through recipes/sft.py: the family's own load-balancing loss and the
    z-loss enter the loss, the router health is read from its routers, 2 ranks x GA2 train as 1 rank x GA4, and the
    saved model is the family's native class."""
    from transformers import AutoConfig

    base, other = aux_runs[f"1x_ga4_{family}"], aux_runs[f"2x_ga2_{family}"]
    assert len(base["losses"]) == 3 and min(base["aux"]) > 0 and min(base["z"]) > 0
    first = base["logs"][0]
    loads = [k for k in first if k.startswith("moe/layer") and "/load_e" in k]
    assert len(loads) == 8 * 3 and sum(first[k] for k in loads if k.startswith("moe/layer0/")) == pytest.approx(1)
    within("moe.family_ddp_vs_one_rank.losses", other["losses"], base["losses"], label=family)
    within("moe.family_ddp_vs_one_rank.weights", other["final"], base["final"], label=family)
    assert AutoConfig.from_pretrained(base["folder"]).model_type == family


@pytest.mark.launches
@pytest.mark.parametrize("family", ("mixtral", *AUX_FAMILIES, *BIASED))
def test_each_family_trains_under_zero3_as_on_one_rank(aux_runs, family):
    """Every family under ZeRO-3 (2 ranks x GA2, its MoE blocks DeepSpeed leaf modules, parameters partitioned) trains
    as 1 rank x GA4: the aux and z losses where the family has them, the router biases moved where it has those."""
    base = aux_runs["1x_ga4" if family == "mixtral" else f"1x_ga4_{family}"]
    z3 = aux_runs[f"2x_ga2_zero3_{family}"]
    assert z3["info"]["zero_stage"] == 3 and "'zero3_leaf_modules'" in z3["stdout"]
    within("moe.zero3_vs_one_rank.losses", z3["losses"], base["losses"], label=family)
    assert set(z3["final"]) == set(base["final"])
    within("moe.zero3_vs_one_rank.weights", z3["final"], base["final"], label=family)
    if family in BIASED:
        biases = [k for k in base["final"] if k.endswith("e_score_correction_bias")]
        assert biases and all(base["final"][k].abs().max() > 0 for k in biases)
        within("moe.zero3_vs_one_rank.biases", {k: z3["final"][k] for k in biases},
               {k: base["final"][k] for k in biases}, label=family)
    else:
        assert min(z3["aux"]) > 0 and min(z3["z"]) > 0
    if family == "mixtral":  # the control: the aux term taken per micro-batch (no / accumulation), 2 ranks x GA2
        beyond("moe.zero3_vs_one_rank.weights", aux_runs["2x_ga2_unscaled"]["final"], base["final"],
               label="aux per micro-batch")


@pytest.mark.launches
def test_expert_parallel_training_under_ddp_equals_one_rank_with_all_experts(aux_runs):
    """Experts split over 2 ranks, excluded from DDP's all-reduce and divided by the world size; the router and the
    rest averaged by DDP: the per-step losses and the saved (gathered, native Mixtral) weights equal 1 rank's."""
    base, ep = aux_runs["1x_ga4"], aux_runs["2x_ga2_ep"]
    assert "'expert_parallel': '2 blocks over 2 rank(s), capacity_factor None'" in ep["stdout"]
    assert len(set(ep["info"]["rank_weight_digests"])) == 1  # every rank saves the same full model
    within("moe.ep_ddp_vs_one_rank.losses", ep["losses"], base["losses"])
    assert set(ep["final"]) == set(base["final"])  # all experts, native names
    within("moe.ep_ddp_vs_one_rank.weights", ep["final"], base["final"])
    # Negative control: without dividing the expert gradients by the world size, the experts move twice as far
    bad = aux_runs["2x_ga2_ep_unscaled"]
    beyond("moe.ep_ddp_vs_one_rank.weights", bad["final"], base["final"], label="expert gradients unscaled")


@pytest.mark.launches
def test_expert_parallel_clips_resumes_and_answers_as_one_rank_with_all_experts(aux_runs):
    """Split experts with gradient clipping (the norm over every rank's experts), a resume (each rank's experts'
    optimizer state put back) and held-out exact match (generated in lockstep): 2 ranks train, log and answer as 1
    rank with all experts, and a resume from step 2 gives the uninterrupted run."""
    base, ep, resumed = aux_runs["1x_ga4_clip"], aux_runs["2x_ga2_ep_clip"], aux_runs["2x_ga2_ep_resumed"]
    norms = [h["grad_norm"] for h in base["logs"]]
    assert len(norms) == 3 and min(norms) > 2 * EP_TRAINING["max_grad_norm"]  # clipping bites on every step
    within("moe.ep_clip_vs_one_rank.grad_norms", [h["grad_norm"] for h in ep["logs"]], norms)
    within("moe.ep_clip_vs_one_rank.losses", ep["losses"], base["losses"])
    within("moe.ep_clip_vs_one_rank.weights", ep["final"], base["final"])
    for key in ("initial_exact_match", "final_exact_match"):
        assert ep["info"]["metrics"][key] == base["info"]["metrics"][key], key
    # steps 1-2 from the checkpoint, then 3
    within("moe.ep_resume_vs_uninterrupted.losses", resumed["losses"], ep["losses"])
    within("moe.ep_resume_vs_uninterrupted.weights", resumed["final"], ep["final"])
    # the best model loaded at the end is the best checkpoint's, experts included (saved per expert, converted back)
    best = aux_runs["1x_ga4_best"]
    step = json.load(open(best["folder"] / "trainer_state.json"))["best_global_step"]
    assert step != 3, "the best checkpoint must not be the last one"
    assert max_rel(best["final"], load_file(str(best["folder"] / f"checkpoint-{step}" / "model.safetensors"))) == 0
    # without experts split too: transformers saves the experts per expert, the resume converts them back
    within("moe.resume_vs_uninterrupted.losses", aux_runs["1x_ga4_resumed"]["losses"], base["losses"])
    within("moe.resume_vs_uninterrupted.weights", aux_runs["1x_ga4_resumed"]["final"], base["final"])
    # each rank's experts have an optimizer state of their own; optimizer.pt (the Trainer's) holds rank 0's only
    ck = ep["folder"] / "checkpoint-2"
    mine = [torch.load(ck / f"expert_optimizer_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert set(mine[0]) == set(mine[1]) and len(mine[0]) == 4  # 2 layers x gate_up_proj, down_proj
    assert all(not torch.equal(mine[0][k]["exp_avg"], mine[1][k]["exp_avg"]) for k in mine[0])
    assert json.load(open(ck / "hftrain_checkpoint.json"))["expert_parallel"] == 2
    # Negative control: the Trainer's own clipping norm is each rank's alone (its own experts): rank 0 logs another
    # norm, the ranks clip by different factors, and the run stops at its save because their weights differ
    bad = aux_runs["2x_ga2_ep_local_clip"]
    local = [h["grad_norm"] for h in bad["logs"]]
    assert len(local) == 3, (local, norms)
    for step, (a, b) in enumerate(zip(local, norms), 1):
        beyond("moe.ep_clip_vs_one_rank.grad_norms", a, b, label=f"rank-local clipping norm, step {step}")
    assert "ranks hold different weights after training" in bad["stdout"]


@pytest.mark.launches
def test_expert_parallel_composes_with_fsdp2_sharding_the_dense_part(aux_runs):
    """Under FSDP2 the dense part is sharded and each rank's experts stay its own (FSDP's ignored parameters): with
    clipping (the norm over the sharded dense gradients and every rank's experts), held-out exact match and a resume,
    2 ranks train as 1 rank with all experts under DDP, and resuming from step 2 gives the uninterrupted run."""
    base, fsdp, resumed = aux_runs["1x_ga4_clip"], aux_runs["2x_ga2_ep_fsdp"], aux_runs["2x_ga2_ep_fsdp_resumed"]
    assert "'expert_parallel': '2 blocks over 2 rank(s), capacity_factor None'" in fsdp["stdout"]
    within("moe.ep_fsdp_vs_one_rank.grad_norms", [h["grad_norm"] for h in fsdp["logs"]],
           [h["grad_norm"] for h in base["logs"]])
    within("moe.ep_fsdp_vs_one_rank.losses", fsdp["losses"], base["losses"])
    # gathered: every expert, native names (compared on the 1-rank run's names, as before: FSDP's gather may save
    # the tied lm_head.weight too)
    within("moe.ep_fsdp_vs_one_rank.weights", {k: fsdp["final"][k] for k in base["final"]}, base["final"])
    for key in ("initial_exact_match", "final_exact_match"):
        assert fsdp["info"]["metrics"][key] == base["info"]["metrics"][key], key
    ck = fsdp["folder"] / "checkpoint-2"
    assert (ck / "pytorch_model_fsdp_0").is_dir() and (ck / "expert_optimizer_rank1.pt").is_file()
    within("moe.ep_fsdp_resume_vs_uninterrupted.losses", resumed["losses"], fsdp["losses"])
    within("moe.ep_fsdp_resume_vs_uninterrupted.weights", resumed["final"], fsdp["final"])
    # the saved folder is a native Mixtral with every expert: from_pretrained gives the run's own logits
    from transformers import AutoModelForCausalLM

    from hftrain.constants import PROBE_IDS

    model = AutoModelForCausalLM.from_pretrained(str(fsdp["folder"]), dtype=torch.float32).eval()
    assert type(model).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE_IDS) % model.config.vocab_size).logits
    within("moe.ep_fsdp_saved_vs_run.probe_logits", logits, torch.tensor(fsdp["info"]["probe_logits"]))


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-3: MoE blocks registered as leaf modules automatically; the run finishes and its saved model reloads


@pytest.mark.launches
def test_zero3_two_ranks_with_mixtral_finishes_and_reloads(tiny_mixtral_dir, tmp_path, deepspeed_ops):
    from transformers import AutoModelForCausalLM

    from hftrain.constants import PROBE_IDS

    out = tmp_path / "z3"
    cmd = [*ACCELERATE_LAUNCH, "--config_file", "accelerate_configs/zero3.yaml", "--main_process_port",
           str(free_port()), "recipes/sft.py", os.path.join(REPO, "recipes/demo/sft.yaml"),
           f"model.name_or_path={tiny_mixtral_dir}", f"data.sources.0.path={DEMO_TRAIN}", "data.eval_sources=[]",
           "training.eval_strategy=no", "eval.exact_match=0", f"training.output_dir={out}", "training.max_steps=3",
           "training.per_device_train_batch_size=4", "training.logging_steps=1", "training.report_to=none",
           "strategy.name=zero3", "moe.aux_loss_coef=0.01"]
    # a hang (the failure this guards against) ends as a timeout, not a stuck suite
    r = run(cmd, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    assert "'zero3_leaf_modules': ['MixtralSparseMoeBlock x2']" in r.stdout
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == 2 and info["wrapper"] == "DeepSpeedEngine" and info["zero_stage"] == 3
    logs = [h for h in json.load(open(out / "trainer_state.json"))["log_history"] if "loss" in h]
    assert len(logs) == 3 and all(h["moe_aux_loss"] > 0 for h in logs)
    # router health under ZeRO-3 (partitioned router weights): loads over both ranks' tokens
    assert all(sum(h[f"moe/layer1/load_e{e}"] for e in range(4)) == pytest.approx(1.0) for h in logs)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(model).__name__ == "MixtralForCausalLM"
    ids = torch.tensor(PROBE_IDS) % model.config.vocab_size
    with torch.no_grad():
        within("moe.zero3_saved_vs_run.probe_logits", model(input_ids=ids).logits,
               torch.tensor(info["probe_logits"]))


# ---------------------------------------------------------------------------------------------------------------
# Expert parallelism


@pytest.mark.launches
def test_expert_parallel_layer_equals_the_native_block_on_two_ranks(tmp_path):
    """tests/moe_ep_worker.py on 2 ranks: the layer against the native block, its gradient scaling against re-created
    Parameters, and a trainer's save of experts nobody gathered."""
    r = run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
             "tests/moe_ep_worker.py", str(tmp_path)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in range(2):
        rep = json.load(open(tmp_path / f"rank{rank}.json"))
        for cf in ("None", "1.0", "0.5"):
            e = rep[cf]
            # the worker reports max |layer - reference| and the reference's max |.|: the error against 0 at that
            # scale is max |layer - reference| / max |reference|
            case = f"rank {rank}, capacity_factor {cf}"
            assert e["out_scale"] > 1, (rank, cf, e)
            within("moe.ep_layer_vs_native.out", e["out"], 0.0, label=case, scale=e["out_scale"])
            within("moe.ep_layer_vs_native.grad_input", e["grad_input"], 0.0, label=case, scale=e["grad_input_scale"])
            # no scale reported for the router's gradient: judged as an absolute difference (scale 1)
            within("moe.ep_layer_vs_native.grad_router", e["grad_router"], 0.0, label=case, scale=1.0)
            within("moe.ep_layer_vs_native.grad_experts", max(e["grad_gate_up"], e["grad_down"]), 0.0, label=case,
                   scale=e["grad_scale"])
            assert e["dropped"] == e["ref_dropped"] and e["saved_full"] and e["loaded_slice"]
        assert (rep["None"]["dropped"] == 0 and rep["1.0"]["dropped"] > 0
                and rep["0.5"]["dropped"] > rep["1.0"]["dropped"])
        # the experts' gradients divided by the world size inside the layer's forward (ScaleGrad): still so after the
        # Parameters are re-created (new objects, to_empty + a load). Negative control: the old hook on the
        # Parameters divides while they live, and is lost with them (gradients world-size times too large)
        # (both reported already relative to the reference gradient's max |.|)
        within("moe.ep_scaled_grad_vs_reference.experts", rep["recreated_grad"], 0.0, label=f"rank {rank}, re-created",
               scale=1.0)
        within("moe.ep_scaled_grad_vs_reference.experts", rep["hook_kept_grad"], 0.0,
               label=f"rank {rank}, old hook, kept", scale=1.0)
        assert rep["hook_recreated_ratio"] == pytest.approx(2.0, rel=1e-5), rep
        # save_model gathers the experts itself: nothing gathered them before, the weights changed, all are saved
        assert rep["save_error"] is None, rep["save_error"]
    assert json.load(open(tmp_path / "rank0.json"))["saved_all_experts"]


@pytest.mark.launches
def test_capacity_factor_drops_tokens_and_still_saves_a_native_model(tiny_model_dir, tmp_path):
    out = tmp_path / "cap"
    tree = recipe_tree(tiny_model_dir, out, max_steps=2, logging_steps=1)
    tree["moe"] = {"upcycle": {"num_experts": 4, "top_k": 2, "router_init_std": 1.0}, "capacity_factor": 0.5}
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump(tree))
    r = run([PY, "recipes/sft.py", str(rec)], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logs = [h for h in json.load(open(out / "trainer_state.json"))["log_history"] if "loss" in h]
    # capacity 0.5: at most half of the assignments fit; at least that many are dropped
    assert all(h["moe/dropped_tokens"] > 0 for h in logs)
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(m).__name__ == "MixtralForCausalLM" and m.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4


def test_expert_parallel_options_are_validated():
    from hftrain.config import RecipeError
    from hftrain.methods import load_recipe

    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["model.name_or_path=m", "data.sources.0.path=d", "moe.expert_parallel_size=2",
                           "strategy.name=zero2", "training.resume_from_checkpoint=true", "data.eval_fraction=0.1",
                           "eval.exact_match=4", "moe.capacity_factor=0"], raw={})
    msg = str(e.value)
    for part in ("moe.expert_parallel_size: runs under strategy ddp or fsdp, not 'zero2'",
                 "moe.capacity_factor: must be > 0"):
        assert part in msg, msg
    # clipping, resume and held-out exact match run with split experts (tests below)
    assert "max_grad_norm" not in msg and "resume_from_checkpoint" not in msg and "exact_match" not in msg, msg
    ok = load_recipe(None, ["model.name_or_path=m", "data.sources.0.path=d", "moe.expert_parallel_size=2",
                            "data.eval_fraction=0.1", "eval.exact_match=4", "training.resume_from_checkpoint=true"],
                     raw={})
    assert ok.moe.expert_parallel_size == 2
    with pytest.raises(RecipeError, match="model.lora: cannot be combined with moe.expert_parallel_size > 1"):
        load_recipe(None, ["model.name_or_path=m", "data.sources.0.path=d", "moe.expert_parallel_size=2",
                           "model.lora.r=4"], raw={})


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"])
def test_aux_terms_of_hf_moe_models_enter_the_loss_once_scaled_by_accumulation(model_type, tmp_path):
    """What SFTTrainer.compute_loss returns = CE / targets + coef * aux / GA + z_coef * z / GA, with aux the family's
    own load-balancing loss on the same router logits and padding mask (and no model-internal loss)."""
    import importlib

    from transformers import AutoConfig, AutoModelForCausalLM

    from hftrain import losses
    from hftrain.config import HFTrainingArguments, MoeSection
    from hftrain.methods.sft import SFTTrainer

    cfg = AutoConfig.for_model(model_type, vocab_size=300, hidden_size=32, intermediate_size=64,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_local_experts=4,
                               num_experts_per_tok=2, head_dim=16, initializer_range=0.5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    args = HFTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = SFTTrainer(model=model, args=args, moe=MoeSection(aux_loss_coef=0.1, router_z_loss_coef=0.01))
    assert sorted(trainer.aux_losses) == ["moe_aux_loss", "moe_z_loss"]  # wired as the trainer is built (MoeMixin)
    mask = torch.ones_like(IDS)
    mask[1, 7:] = 0  # padding
    labels = IDS.masked_fill(mask == 0, -100)
    model.train()
    trainer.current_gradient_accumulation_steps = 2
    got = trainer.compute_loss(model, {"input_ids": IDS, "attention_mask": mask, "labels": labels})

    out = model(input_ids=IDS, attention_mask=mask, output_router_logits=True)
    assert out.loss is None
    lb = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}").load_balancing_loss_func
    aux = lb(out.router_logits, 4, 2, mask)
    flat = mask.reshape(-1).float()
    z = torch.stack([(torch.logsumexp(r, -1) ** 2 * flat).sum() / flat.sum() for r in out.router_logits]).mean()
    n = losses.count_targets(labels)[0]
    expected = losses.loss_sum(out.logits, labels) / n + 0.1 * aux / 2 + 0.01 * z / 2
    assert aux > 0.5 and z > 0
    within("moe.trainer_loss_vs_formula.loss", got, expected, label=model_type)


# ---------------------------------------------------------------------------------------------------------------
# LoRA on the fused experts (peft's target_parameters) as well as on attention


def test_lora_on_fused_experts_trains_saves_and_merges_into_a_native_checkpoint(tiny_mixtral_dir, tmp_path, in_process):
    """A tiny Qwen3-MoE through recipes/sft.py (in this process) with adapters on q/v and on every layer's fused
    experts: the expert adapters train, and output_dir/merged is a native Qwen3-MoE that loads with from_pretrained
    alone and gives the adapter model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hftrain.recipes.sft import main

    from .conftest import uneven_data

    base = tiny_family_moe("qwen3_moe", tiny_mixtral_dir, str(tmp_path / "base"))
    out = tmp_path / "out"
    main([os.path.join(REPO, "recipes", "demo", "sft.yaml"), f"model.name_or_path={base}", "model.dtype=float32",
          f"data.sources=[{{path: {uneven_data(tmp_path / 'd.jsonl')}}}]", "data.eval_sources=[]",
          "eval.exact_match=0", f"training.output_dir={out}", "training.max_steps=2", "training.learning_rate=0.05",
          "training.warmup_steps=0", "training.lr_scheduler_type=constant", "training.per_device_train_batch_size=4",
          "training.save_strategy=no", "training.eval_strategy=no", "training.report_to=none", "model.lora.r=4",
          "model.lora.dropout=0.0", "model.lora.target_modules=[q_proj, v_proj]", "model.lora.merge=true",
          "model.lora.target_parameters=[experts.gate_up_proj, experts.down_proj]", "moe.aux_loss_coef=0.01"])
    adapter = load_file(str(out / "adapter_model.safetensors"))
    expert_b = [k for k in adapter if "experts" in k and "lora_B" in k]
    assert len(expert_b) == 2 * 3 and all(adapter[k].abs().max() > 0 for k in expert_b)  # trained from zero
    ids = torch.tensor([[2, 10, 20, 30, 40, 50]])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out)).eval()(ids).logits
        merged_model = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
        merged = merged_model(ids).logits
    assert type(merged_model).__name__ == "Qwen3MoeForCausalLM"
    within("moe.lora_merged_vs_adapted.logits", merged, adapted)
    before = load_file(os.path.join(base, "model.safetensors"))
    after = load_file(str(out / "merged" / "model.safetensors"))
    key = "model.layers.0.mlp.experts.0.down_proj.weight"  # saved in the per-expert layout of the Hub's checkpoints
    assert (after[key] - before[key]).abs().max() > 1e-6  # the experts' update is in the merged weights


def test_the_recipe_chooses_the_experts_implementation(tiny_mixtral_dir, tmp_path):
    """model.experts_implementation reaches transformers (bench/moe.py impl times each); unset, transformers'
    default stays."""
    from hftrain.config import ModelSection
    from hftrain.modeling import load_model

    base = tiny_family_moe("qwen3_moe", tiny_mixtral_dir, str(tmp_path / "base"))
    chosen = load_model(ModelSection(name_or_path=base, dtype="float32", experts_implementation="batched_mm"))
    default = load_model(ModelSection(name_or_path=base, dtype="float32"))
    assert chosen.config._experts_implementation == "batched_mm"
    assert default.config._experts_implementation != "batched_mm"


def test_a_moe_checkpoint_is_recognised_as_the_model_its_recipe_builds(tiny_mixtral_dir):
    """transformers 5 keeps a Mixtral's experts fused (gate_up_proj) and saves them per expert (w1, w2, w3): a
    checkpoint of the recipe's own model was refused as "another model" before the resume compared the saved names."""
    from hftrain.launch.resume import _headers, compatibility_problems
    from hftrain.methods import load_recipe

    assert any(".experts.0.w1." in k for k in _headers(tiny_mixtral_dir, ("model.safetensors",)))  # saved per expert
    recipe = load_recipe(None, [f"model.name_or_path={tiny_mixtral_dir}", "data.sources.0.path=d"], raw={})
    assert compatibility_problems(tiny_mixtral_dir, recipe) == []
    other = load_recipe(None, [f"model.name_or_path={tiny_mixtral_dir}", "data.sources.0.path=d", "model.lora.r=4"],
                        raw={})
    assert "holds a whole model and this recipe trains a LoRA adapter" in compatibility_problems(tiny_mixtral_dir,
                                                                                                 other)[0]


EP_EXACT = ("qwen3_moe", "olmoe")  # beside Mixtral: blocks the expert-parallel layer computes as the family does


@pytest.mark.parametrize("family", ("mixtral", *AUX_FAMILIES, *BIASED))
def test_expert_parallelism_runs_a_family_exactly_or_refuses_it(family, tiny_mixtral_dir, tmp_path):
    """The expert-parallel layer (here with every expert local) gives the native model's logits, or the family is
    refused: DeepSeek-V3's and GLM-4.5's blocks were taken and computed other logits (no shared experts, another
    routing) until the check named them."""
    from transformers import AutoModelForCausalLM

    from hftrain.moe import expert_parallel as ep

    folder = (tiny_mixtral_dir if family == "mixtral"
              else tiny_family_moe(family, tiny_mixtral_dir, str(tmp_path / family)))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        native = model(input_ids=ids).logits
    if family not in ("mixtral", *EP_EXACT):
        with pytest.raises(ValueError, match=r"moe.expert_parallel_size: \w+ (has a shared expert|is not a fused)"):
            ep.parallelize(model, None, None)
        return
    assert ep.parallelize(model, None, None) == len(list(moe_blocks(model)))
    with torch.no_grad():
        within("moe.ep_layer_vs_native.logits", model(input_ids=ids).logits, native, label=family)


def test_check_refuses_an_expert_parallel_size_the_launch_or_the_model_cannot_take(tiny_mixtral_dir, tmp_path):
    """`hftrain check` (preflight) says what the run would refuse only after loading the model: a size other than
    the number of processes, one that does not divide the experts, a family the layer does not run."""
    from hftrain.config import RecipeError
    from hftrain.launch import check_recipe

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n' * 8)

    def check(model, *extra):
        return check_recipe(None, [f"model.name_or_path={model}", f"data.sources.0.path={data}",
                                   f"training.output_dir={tmp_path / 'out'}", "strategy.num_processes=2", *extra],
                            raw={}, environment=False)

    with pytest.raises(RecipeError) as e:
        check(tiny_mixtral_dir, "moe.expert_parallel_size=3")
    assert "moe.expert_parallel_size: must equal the number of processes (2), got 3" in str(e.value)
    assert "moe.expert_parallel_size: 3 does not divide the model's 4 experts per layer" in str(e.value)
    deepseek = tiny_family_moe("deepseek_v3", tiny_mixtral_dir, str(tmp_path / "deepseek"))
    with pytest.raises(RecipeError, match="moe.expert_parallel_size: DeepseekV3MoE has a shared expert"):
        check(deepseek, "moe.expert_parallel_size=2", "moe.bias_update_rate=0")
    recipe, strategy = check(tiny_mixtral_dir, "moe.expert_parallel_size=2")
    assert recipe.moe.expert_parallel_size == 2


def test_a_pushed_moe_folder_has_its_experts_shapes_checked(tiny_mixtral_dir, tmp_path):
    """The upload check compares each saved tensor's shape with the config's, named as save_pretrained writes them:
    a Mixtral's experts are saved per expert, so before the names were reverted no expert was compared (only the
    load after it failed, with transformers' conversion report instead of the tensor's name)."""
    import shutil

    from safetensors.torch import save_file

    from hftrain.hub.checks import validate_folder

    folder = tmp_path / "mixtral"
    shutil.copytree(tiny_mixtral_dir, folder)
    assert validate_folder(str(folder)) == []
    weights = load_file(str(folder / "model.safetensors"))
    name = next(k for k in weights if k.endswith("experts.0.w1.weight"))
    rows, cols = weights[name].shape
    weights[name] = torch.zeros(rows + 1, cols)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    expected = f"{name}: saved shape [{rows + 1}, {cols}], the config needs [{rows}, {cols}]"
    assert validate_folder(str(folder)) == [expected]


def test_the_gathered_experts_are_dropped_while_training(tiny_mixtral_dir):
    """The full copy of every expert (gathered for a save) is dropped when training starts and after each save:
    kept, it would put every expert back on every rank, what expert parallelism is there to avoid."""
    from transformers import AutoModelForCausalLM

    from hftrain.moe import expert_parallel as ep

    model = AutoModelForCausalLM.from_pretrained(tiny_mixtral_dir, dtype=torch.float32)
    ep.parallelize(model, None, None)
    blocks = [m for m in model.modules() if isinstance(m, ep.ExpertParallelMoE)]
    callback = ep.ExpertParallelCallback(model)
    for event in ("on_train_begin", "on_save"):
        ep.gather_for_save(model)
        assert all(b._full is not None for b in blocks)
        getattr(callback, event)(None, None, None)
        assert all(b._full is None for b in blocks), event
