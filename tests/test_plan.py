"""Memory plan: hand-computed ZeRO formulas, DeepSpeed's own estimators, and the command."""

import pytest

from hftrain.launch.plan import ModelFacts, format_plan, model_facts, plan, recommend

PSI = 1_000_000_000
FACTS = ModelFacts(params=PSI, trainable=PSI, largest_layer=10_000_000, hidden=4096, layers=32, vocab=32000,
                   weight_bytes=2)


def by_name(rows):
    return {r.strategy: r for r in rows}


def test_hand_computed_zero_formulas():
    rows = by_name(plan(FACTS, gpus_per_node=8, nodes=1, micro_batch=1, seq=512, checkpointing=True, mixed=True))
    assert rows["ddp"].gpu_model_states == 2 * PSI + 2 * PSI + 4 * PSI  # bf16 weights, bf16 Adam moments
    # DeepSpeed, bf16: 2 (16-bit params) + 2 (16-bit grads) + 16 (fp32 grads, master, two moments) bytes each
    assert rows["zero1"].gpu_model_states == 2 * PSI + 2 * PSI + 16 * PSI / 8
    assert rows["zero2"].gpu_model_states == 2 * PSI + 18 * PSI / 8
    assert rows["zero3"].gpu_model_states == 20 * PSI / 8 + 4 * FACTS.largest_layer
    assert rows["zero3_offload"].cpu_per_node == 20 * PSI and rows["zero3_offload"].gpu_params == 4e7
    assert rows["zero_infinity"].nvme_per_node == 18 * PSI and rows["zero_infinity"].cpu_per_node == 2 * PSI
    two_nodes = by_name(plan(FACTS, 8, 2, 1, 512, True, True))
    assert two_nodes["zero3"].gpu_optimizer == 16 * PSI / 16 and two_nodes["zero3_offload"].cpu_per_node == 10 * PSI


def test_fp32_deepspeed_counts_its_redundant_master_copy():
    """fp32 weights: PyTorch engines hold 4 + 4 + 8 bytes per parameter; DeepSpeed adds an fp32 master partition
    (ZeRO-1/2 and offloaded optimizers clone even fp32 weights), except plain ZeRO-3 once hftrain.patches.deepspeed
    lets it reuse them (bench/memory.py: 16 bytes / N per ZeRO-3 rank, 20 / N without the fix)."""
    fp32 = ModelFacts(params=PSI, trainable=PSI, largest_layer=10_000_000, hidden=4096, layers=32, vocab=32000,
                      weight_bytes=4, largest_tensor=4_000_000)
    rows = by_name(plan(fp32, gpus_per_node=2, nodes=1, micro_batch=1, seq=512, checkpointing=True, mixed=False))
    assert rows["ddp"].gpu_model_states == 16 * PSI and rows["fsdp"].gpu_model_states == 16 * PSI / 2 + 4e7
    assert rows["zero2"].gpu_model_states == 4 * PSI + 16 * PSI / 2
    assert rows["zero3"].gpu_model_states == 16 * PSI / 2 + 4e7
    # Offloaded: + the CPU Adam's fp32 gradient copy (4 + 4 + 4 + 4 + 8).
    assert rows["zero3_offload"].cpu_per_node == 24 * PSI
    # NVMe: params + optimizer (grad copy, master, moments); CPU: the gradients + 11 swap buffers per rank, each
    # the largest partition (2M elements) rounded up to 256K elements.
    assert rows["zero_infinity"].nvme_per_node == 20 * PSI
    assert rows["zero_infinity"].cpu_per_node == 4 * PSI + 2 * 4 * 8 * 2**18 * 11


@pytest.mark.parametrize("gpus,nodes", [(2, 1), (8, 1), (8, 4)])
def test_within_15_percent_of_deepspeed_estimators(gpus, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    rows = by_name(plan(FACTS, gpus, nodes, 1, 512, True, True))
    _, ds_z2 = estimate_zero2_model_states_mem_needs(PSI, gpus, nodes, cpu_offload=False)
    assert rows["zero2"].gpu_model_states == pytest.approx(ds_z2, rel=0.15)
    _, ds_z3, _ = estimate_zero3_model_states_mem_needs(PSI, FACTS.largest_layer, gpus, nodes, cpu_offload=False)
    assert rows["zero3"].gpu_model_states == pytest.approx(ds_z3, rel=0.15)
    ds_cpu, _, _ = estimate_zero3_model_states_mem_needs(PSI, FACTS.largest_layer, gpus, nodes, cpu_offload=True,
                                                         cpu_offload_params=True, additional_buffer_factor=1.0)
    assert rows["zero3_offload"].cpu_per_node == pytest.approx(ds_cpu, rel=0.15)


def test_recommendation_is_the_fastest_that_fits():
    rows = plan(FACTS, 8, 1, 1, 512, True, True)
    z2 = by_name(rows)["zero2"].gpu_total
    assert recommend(rows, by_name(rows)["ddp"].gpu_total) == "ddp"
    assert recommend(rows, z2) in ("zero1", "zero2")
    assert recommend(rows, 1.0) is None and "nothing fits" in format_plan(rows, 1.0)


def test_lora_and_checkpointing_shrink_the_plan(tiny_model_dir):
    full = model_facts(tiny_model_dir)
    lora = model_facts(tiny_model_dir, lora_r=4)
    assert lora.params == full.params and 0 < lora.trainable < full.params / 4
    with_ckpt = plan(full, 1, 1, 8, 256, True, False)[0].gpu_activations
    without = plan(full, 1, 1, 8, 256, False, False)[0].gpu_activations
    assert with_ckpt < without


def test_plan_command(tiny_model_dir, capsys):
    from hftrain.cli import main

    assert main(["plan", "recipes/demo/sft.yaml", f"model.name_or_path={tiny_model_dir}", "--gpus-per-node", "2",
                 "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "recommended: ddp" in out and "zero_infinity" in out
    from hftrain.kernels import kernels_line  # the line this host gives (a GPU host with liger-kernel: liger's)

    assert kernels_line(None, "llama") + " (on this machine)" in out


def test_the_plan_never_recommends_a_strategy_check_refuses(tiny_model_dir, capsys):
    """A 4-bit base trains under ddp, fsdp and zero3 only: the plan of a GPU too small for all but the offloaded
    strategies recommended zero3_offload, which check refuses for it. Now it says refused and why; the same plan of
    an unquantised LoRA recipe is the control (it does recommend zero3_offload)."""
    from hftrain.cli import main
    from hftrain.launch.plan import recipe_plan
    from hftrain.methods import load_recipe

    lora = [f"model.name_or_path={tiny_model_dir}", "model.lora={r: 8}"]
    rows = recipe_plan(load_recipe("recipes/demo/sft.yaml", lora), 2, 1).rows
    offload = next(r for r in rows if r.strategy == "zero3_offload")
    assert all(r.gpu_total > offload.gpu_total for r in rows if r.strategy not in ("zero3_offload", "zero_infinity"))
    memory = ["--gpus-per-node", "2", "--gpu-memory", str(offload.gpu_total / 2 ** 30)]
    assert main(["plan", "recipes/demo/sft.yaml", *lora, *memory]) == 0
    assert "recommended: zero3_offload" in capsys.readouterr().out
    assert main(["plan", "recipes/demo/sft.yaml", *lora, "model.quantization={bits: 4}", *memory]) == 0
    out = capsys.readouterr().out
    assert "recommended: zero3_offload" not in out and "nothing fits" in out, out
    assert "refused: zero3_offload: model.quantization: a quantised base trains under ddp, fsdp, zero3" in out
    assert [line.split()[-1] for line in out.splitlines() if line.startswith(("zero1 ", "ddp "))] == ["no", "refused"]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_an_moe_model_is_planned_with_every_experts_state_and_the_active_experts_activations(model_type, tmp_path):
    """Every expert's parameters count for the model states (each has its optimizer state); the MLP's activations
    in a sparse layer are those of the top-k experts (and a shared one), as wide as k x the expert's width."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hftrain.launch.plan import activation_bytes

    keys = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_experts=8, num_local_experts=8,
                n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, n_group=1,
                topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    config = AutoConfig.for_model(model_type, **keys)
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    f = model_facts(str(tmp_path))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert f.params == sum(p.numel() for p in model.parameters()) and experts > f.params / 3
    assert f.active_params == f.params - experts + experts * 2 // 8
    sparse = 1 if model_type == "deepseek_v3" else 2  # its first layer stays dense
    expert_width = 16 if model_type != "gpt_oss" else config.intermediate_size  # gpt-oss's experts are this wide
    shared = 16 if model_type == "deepseek_v3" else 0
    assert (f.moe_layers, f.active_intermediate) == (sparse, 2 * expert_width + shared)
    sbh = 128 * 4 * 32
    mlp = 16 * sbh * (2 * expert_width + shared) / (4 * 32)
    expected = sparse * (18 * sbh + mlp) + (2 - sparse) * 34 * sbh + 2 * 4 * 4 * 128 * 64
    assert activation_bytes(f, 4, 128, checkpointing=False) == pytest.approx(expected)


def test_a_frozen_model_adds_its_weights_sharded_as_the_policy_s_and_no_gradients_or_optimizer_states():
    teacher = ModelFacts(params=PSI // 2, trainable=0, largest_layer=0, hidden=2048, layers=16, vocab=32000,
                         weight_bytes=2)
    alone = by_name(plan(FACTS, 8, 1, 1, 512, True, True))
    taught = by_name(plan(FACTS, 8, 1, 1, 512, True, True, frozen=[teacher]))
    assert taught["ddp"].gpu_params - alone["ddp"].gpu_params == PSI  # bf16 weights, whole on each GPU
    assert taught["zero3"].gpu_params - alone["zero3"].gpu_params == PSI / 8  # sharded over the 8 GPUs
    assert taught["zero3_offload"].cpu_per_node - alone["zero3_offload"].cpu_per_node == PSI  # offloaded with them
    for s in alone:
        assert (taught[s].gpu_grads, taught[s].gpu_optimizer) == (alone[s].gpu_grads, alone[s].gpu_optimizer)


def test_a_model_held_whole_on_every_gpu_adds_its_weights_whole_under_every_strategy():
    """GRPO's reward models are loaded whole on every rank whatever the strategy: counted whole, not sharded."""
    scorer = ModelFacts(params=PSI // 2, trainable=0, largest_layer=0, hidden=2048, layers=16, vocab=32000,
                        weight_bytes=2)
    alone = by_name(plan(FACTS, 8, 1, 1, 512, True, True))
    scored = by_name(plan(FACTS, 8, 1, 1, 512, True, True, whole=[scorer]))
    assert all(scored[s].gpu_params - alone[s].gpu_params == PSI for s in alone)


def _written(tmp_path, tree) -> str:
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_grpo_reward_models_and_the_dpo_reference_copy_are_in_the_plan(tmp_path, tiny_model_dir, capsys):
    """They were loaded but not declared: the plan and the fit check ignored them. A GRPO reward model is counted
    whole on every GPU, DPO's frozen reference copy sharded as the policy; a LoRA policy (the adapter disabled is
    the reference) or precomputed log-probs keep no copy (the controls)."""
    from hftrain.cli import main
    from hftrain.launch.plan import recipe_plan
    from hftrain.methods import load_recipe

    base = {"model": {"name_or_path": tiny_model_dir}, "data": {"sources": [{"path": "d.jsonl"}]},
            "training": {"output_dir": str(tmp_path / "o")}}
    grpo = _written(tmp_path, {**base, "grpo": {"beta": 0.0, "rewards": [{"model": tiny_model_dir}]}})
    planned = recipe_plan(load_recipe(grpo), 8, 1)
    (spec, facts), = planned.frozen
    assert spec.key == "grpo.rewards.0.model" and spec.whole and spec.num_labels == 1
    gained = {r.strategy: r.gpu_params - a.gpu_params for r, a in zip(planned.rows, planned.policy_rows)}
    assert len(set(gained.values())) == 1 and gained["zero3"] > 0  # the same whole weights under every strategy
    assert main(["plan", grpo, "--gpus-per-node", "8"]) == 0
    assert "reward (grpo.rewards.0.model)" in capsys.readouterr().out
    dpo = {**base, "preference": {"loss_type": "sigmoid"}}
    (ref, _), = recipe_plan(load_recipe(_written(tmp_path, dpo)), 8, 1).frozen
    assert ref.role.value == "reference" and not ref.whole
    for other in ({**dpo, "model": {**dpo["model"], "lora": {"r": 4}}},
                  {**dpo, "preference": {"loss_type": "sigmoid", "precompute_ref_log_probs": True}},
                  {**dpo, "preference": {"loss_type": "orpo"}}):
        assert recipe_plan(load_recipe(_written(tmp_path, other)), 8, 1).frozen == []
