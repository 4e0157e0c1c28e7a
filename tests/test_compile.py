"""training.torch_compile with hftrain's run (issue 42, point 2): the Trainer compiles the model (accelerate's dynamo
plugin), so what hftrain puts into the model's forward (the chunked loss's head, the packed rows' join, the MoE
loss, balance and health hooks, LoRA) is traced with it. torch._dynamo.explain counts the graph breaks of the model as
the trainer holds it, on a batch of its own dataloader, against the same model as transformers loads it (with the
router logits the aux loss needs, for MoE): hftrain may add none. And a compiled run trains as the uncompiled one
does."""

import json
import os

import pytest
import torch
import yaml

from .conftest import DEMO_TRAIN, PY, run
from .exactness import within


def recipe(tmp_path, model_dir, name, **sections) -> str:
    tree = {"model": {"name_or_path": model_dir, "dtype": "float32"},
            "data": {"sources": [{"path": DEMO_TRAIN}], "max_length": 64},
            "eval": {"exact_match": 0},
            "training": {"output_dir": str(tmp_path / name), "max_steps": 3, "per_device_train_batch_size": 4,
                         "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
                         "train_sampling_strategy": "sequential", "disable_tqdm": True, "seed": 0}}
    for key, value in sections.items():
        section, _, field = key.partition("__")
        tree.setdefault(section, {})[field] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def graph_breaks(model, batch) -> tuple[int, list[str]]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**batch)
    return explained.graph_break_count, [str(b.reason).splitlines()[0] for b in explained.break_reasons]


def trainer_of(recipe_path):
    """The run's trainer as lifecycle.run builds it, and a batch of its own dataloader as the step passes it."""
    from hftrain.launch import setup_run
    from hftrain.lifecycle import read_data
    from hftrain.methods import method_of

    run_ = setup_run([recipe_path])
    method = method_of(run_.recipe)
    tokenizer, data = read_data(run_)
    trainer = method.trainer(run_, method.model(run_), tokenizer, data, [])
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    return trainer, {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("variant", ["plain", "packing", "chunked_loss", "lora", "moe"])
def test_hftrain_adds_no_graph_break_to_the_compiled_model(variant, tmp_path, tiny_model_dir, in_process):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir
    over = {"packing": {"data__packing": True}, "chunked_loss": {"training__loss_impl": "chunked"},
            "lora": {"model__lora": {"r": 4, "alpha": 8, "dropout": 0.0}}}.get(variant, {})
    if variant == "moe":
        from .test_moe import tiny_family_moe

        model_dir = tiny_family_moe("qwen3_moe", tiny_model_dir, str(tmp_path / "qwen3_moe"))
        over = {"moe__aux_loss_coef": 0.01, "moe__router_z_loss_coef": 0.001}
    trainer, batch = trainer_of(recipe(tmp_path, model_dir, variant, **over))
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids", "labels")}
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    # MoE: the aux loss needs the router logits, and transformers' own load-balancing loss breaks the graph once then
    # (qwen3_moe: 2 graphs with output_router_logits, 1 without); compared with the same setting
    plain.config.output_router_logits = bool(getattr(trainer.model.config, "output_router_logits", False))
    theirs, _ = graph_breaks(plain, inputs)
    ours, why = graph_breaks(trainer.model.train(), batch)
    print(f"{variant}: graph breaks {ours} (transformers alone: {theirs})")
    assert ours <= theirs, (variant, ours, theirs, why)
    assert ours == (1 if variant == "moe" else 0)  # what transformers' own code costs, as measured


@pytest.mark.launches
def test_a_compiled_run_trains_as_the_uncompiled_one(tmp_path, tiny_model_dir):
    """Three steps through recipes/sft.py with training.torch_compile (inductor on this CPU) and without: the same
    losses (to inductor's reordering of float sums) and weights."""
    from safetensors.torch import load_file

    losses, weights = {}, {}
    for name, compile_ in (("eager", False), ("compiled", True)):
        rec = recipe(tmp_path, tiny_model_dir, name, training__torch_compile=compile_)
        r = run([PY, "recipes/sft.py", rec], timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        history = json.load(open(tmp_path / name / "trainer_state.json"))["log_history"]
        losses[name] = [h["loss"] for h in history if "loss" in h]
        weights[name] = load_file(os.path.join(tmp_path / name, "model.safetensors"))
    assert len(losses["eager"]) == 3
    within("compile.compiled_vs_eager.losses", losses["compiled"], losses["eager"])
    within("compile.compiled_vs_eager.weights", weights["compiled"], weights["eager"])
