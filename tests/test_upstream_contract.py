"""The private surface of the libraries hftrain builds on, listed once and checked against the installed versions.

hftrain overrides or reads members of transformers, TRL, accelerate, DeepSpeed, torch and datasets that are not part
of their public API. A release may rename or re-sign them without notice; this file is where that shows, as a failing
test naming the member, instead of as a silent fallback at run time. Three checks:

- every member in CONTRACT exists on the installed library with the parameters hftrain calls it with;
- the call order hftrain relies on still holds (ORDER: e.g. the step guard judges the gradient norm before the
  optimizer steps);
- the list is complete: every private name hftrain's code overrides (a method of an hftrain class shadowing a
  library base's private member) or reads on a library object is in CONTRACT (a new one fails here until listed).

A test renames a member on a copy of its class and shows that the check then fails.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hftrain"

# (owner as "module:qualname", member, the parameters hftrain relies on (None: an attribute, not called), where)
CONTRACT = [
    # transformers.Trainer: overridden by hftrain's trainer mixins (hftrain/trainer/)
    ("transformers:Trainer", "_get_num_items_in_batch", ["batch_samples", "device"], "exact_loss, preference"),
    ("transformers:Trainer", "_prepare_for_training", ["max_steps", "train_dataloader", "resume_from_checkpoint"],
     "step_guard: the engine check once the model is wrapped"),
    ("transformers:Trainer", "_get_grad_norm", ["model", "grad_norm"], "step_guard: judge the step; moe.mixin"),
    ("transformers:Trainer", "_clip_grad_norm", ["model"], "moe.mixin: the norm over every rank's experts"),
    ("transformers:Trainer", "_save_optimizer_and_scheduler", ["output_dir"],
     "moe.mixin: each rank's experts' optimizer state, in the folder being written"),
    ("transformers:Trainer", "_load_optimizer_and_scheduler", ["checkpoint"], "checkpointing: weights-only resume"),
    ("transformers:Trainer", "_load_rng_state", ["checkpoint"], "checkpointing: name a damaged RNG file"),
    ("transformers:Trainer", "_load_from_checkpoint", ["resume_from_checkpoint", "model"],
     "checkpointing: weights saved in a family's original format, converted on resume"),
    ("transformers:Trainer", "_load_best_model", [], "checkpointing: the best model's weights, converted likewise"),
    ("transformers:Trainer", "_save_checkpoint", ["model", "trial"], "checkpointing: staged saves"),
    ("transformers:Trainer", "_save", ["output_dir", "state_dict"],
     "checkpointing: a gathered state dict's tied copies left out; a tensor-parallel model's gathered"),
    ("transformers:Trainer", "_save_rng_state", ["output_dir"],
     "stream_position: each rank's stream position beside its RNG state, in the folder being written"),
    # transformers.Trainer: read or replaced
    ("transformers:Trainer", "_get_output_dir", ["trial"], "patches.transformers: the staging folder"),
    ("transformers:PreTrainedModel", "_can_set_experts_implementation", [],
     "launch.model_libraries.experts_problems: model.experts_implementation refused for a model without experts"),
    ("transformers:Trainer", "_prepare_inputs", ["inputs"], "exact_loss.prediction_step"),
    ("transformers:Trainer", "_tr_loss", None, "step_guard: a skipped step's loss (set in _inner_training_loop)"),
    ("transformers:PretrainedConfig", "_attn_implementation", None, "modeling, moe.upcycle"),
    ("transformers:PreTrainedModel", "_no_split_modules", None,
     "modeling.wrap_classes_and_renamings: FSDP2's wrap classes (accelerate reads them) kept to those the model "
     "holds"),
    ("transformers:PreTrainedModel", "_weight_conversions", None,
     "modeling.wrap_classes_and_renamings: the renamings a save reverts kept to those the load applied (ZeRO-3 "
     "kept all)"),
    ("transformers:PreTrainedTokenizerBase", "_set_model_specific_special_tokens", ["special_tokens"],
     "vision.tiny_models: Gemma 3's named image tokens (boi_token, ...) on a tokenizer trained here, saved as the "
     "Hub's tokenizer_config.json names them"),
    # TRL
    ("trl:DPOTrainer", "_precompute_ref_logps", ["dataset", "name", "batch_size"], "preference: SimPO's constant"),
    ("trl:DPOTrainer", "_get_num_items_in_batch", ["batch_samples", "device"], "preference: the pair count"),
    ("trl:DPOTrainer", "_prepare_dataset", ["dataset", "processing_class", "args", "dataset_name"],
     "methods.pairs.trl_prepared: pairs measured as TRL truncates them (self: only its _tokenizer)"),
    ("trl:DPOTrainer", "_save_checkpoint", ["model", "trial"], "checkpointing under DPOTrainer's model card"),
    ("trl:DPOTrainer", "_prepare_for_training", ["max_steps", "train_dataloader", "resume_from_checkpoint"],
     "step_guard under DPOTrainer"),
    ("trl:DPOTrainer", "_get_grad_norm", ["model", "grad_norm"], "step_guard under DPOTrainer"),
    ("trl:DPOTrainer", "_load_optimizer_and_scheduler", ["checkpoint"], "checkpointing under DPOTrainer"),
    ("trl:DPOTrainer", "_load_rng_state", ["checkpoint"], "checkpointing under DPOTrainer"),
    ("trl.experimental.orpo:ORPOTrainer", "_get_num_items_in_batch", ["batch_samples", "device"],
     "orpo: the step's pairs and chosen tokens"),
    ("trl:RewardTrainer", "_prepare_dataset", ["dataset", "processing_class", "args", "dataset_name"],
     "methods.reward.reward_pairs.trl_tokenised: pairs tokenised and dropped as TRL does (self: None, unused)"),
    ("trl:KTOTrainer", "_get_num_items_in_batch", ["batch_samples", "device"], "kto: the step's examples"),
    ("trl:KTOTrainer", "_compute_kl_logps", ["model", "batch"], "kto: the step's KL reference point"),
    ("trl:KTOTrainer", "_prepare_dataset", ["dataset", "processing_class", "args", "dataset_name"],
     "methods.unpaired.check_example_lengths: examples measured as TRL truncates them (self: its _tokenizer and "
     "calculate_KL)"),
    *[(owner, name, params, f"{where} under {owner.split(':')[1]}")
      for owner in ("trl.experimental.orpo:ORPOTrainer", "trl:KTOTrainer")
      for name, params, where in (("_save_checkpoint", ["model", "trial"], "checkpointing"),
                                  ("_prepare_for_training", ["max_steps", "train_dataloader", "resume_from_checkpoint"],
                                   "step_guard"),
                                  ("_get_grad_norm", ["model", "grad_norm"], "step_guard"),
                                  ("_load_optimizer_and_scheduler", ["checkpoint"], "checkpointing"),
                                  ("_load_rng_state", ["checkpoint"], "checkpointing"))],
    ("trl:GRPOTrainer", "_calculate_rewards", ["inputs", "prompts", "completions", "completion_ids_list"],
     "grpo: reward errors raised on every rank after the all-gather"),
    ("trl:GRPOTrainer", "_generate_and_score_completions", ["inputs"], "grpo: the advantages' spread logged"),
    ("trl:GRPOTrainer", "_metrics", None, "grpo: metrics TRL averages and logs (instance attribute)"),
    ("trl:GRPOTrainer", "_tokenizer", None, "grpo: the tokenizer of its processing class (instance attribute)"),
    ("trl:GRPOTrainer", "_save_checkpoint", ["model", "trial"], "checkpointing under GRPOTrainer's model card"),
    ("trl:GRPOTrainer", "_load_optimizer_and_scheduler", ["checkpoint"], "checkpointing under GRPOTrainer"),
    ("trl:GRPOTrainer", "_prepare_for_training", ["max_steps", "train_dataloader", "resume_from_checkpoint"],
     "step_guard and grpo (generation in lockstep under FSDP2) under GRPOTrainer"),
    ("trl:GRPOTrainer", "_get_grad_norm", ["model", "grad_norm"], "step_guard under GRPOTrainer"),
    ("trl:GRPOTrainer", "_generate", ["prompts"], "grpo tools: the tool mask (its third result) for the rewards"),
    ("trl:GRPOTrainer", "_get_tool_suffix_ids", ["tool_messages"],
     "grpo tools: the suffix less the generated stop token, and tool_suffix_problem's check before the model loads"),
    ("trl:GRPOTrainer", "_tool_call_loop", ["prompts", "prompt_ids", "completion_ids", "completions", "logprobs",
                                            "images", "multimodal_fields"],
     "grpo tools: overridden to count the rollouts it leaves on a call it did not run; the mask tests per family"),
    ("trl:GRPOTrainer", "_load_rng_state", ["checkpoint"], "checkpointing under GRPOTrainer"),
    # bitsandbytes (quantization/load.py)
    ("bitsandbytes.nn:Linear4bit", "support_avx512bf16_for_cpu", None,
     "quantization.keep_training_kernels: off, so eval never repacks a layer for the inference kernel"),
    ("transformers.distributed.fsdp:is_fsdp_managed_module", "_is_fsdp_managed_module", None,
     "patches.transformers.mark_fsdp_managed: generate() in lockstep under FSDP2"),
    # accelerate (patches/accelerate.py)
    ("accelerate.state:AcceleratorState", "__init__", ["fsdp_plugin"], "apply_fsdp_on_cpu"),
    ("accelerate.state:AcceleratorState", "_mixed_precision", None, "apply_fsdp_on_cpu (instance attribute)"),
    ("accelerate.state:PartialState", "_shared_state", None, "apply_fsdp_on_cpu"),
    ("accelerate.utils:DistributedDataParallelKwargs", "register_comm_hook", ["model"], "HookedDDPKwargs"),
    ("accelerate.parallelism_config:ParallelismConfig", "_validate_accelerator", ["accelerator"],
     "apply_tensor_parallel_on_cpu"),
    # DeepSpeed (patches/deepspeed.py)
    ("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3", "_create_fp32_partitions", [],
     "share_fp32_master_with_fp32_weights"),
    ("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3",
     "load_hp_checkpoint_state_from_checkpoint_dir_stage3", ["checkpoint_dir"], "untie_zero3_universal_steps"),
    ("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "sequence_parallel_size", None,
     "average_gradients_over_sequence_ranks (set to 1 after __init__)"),
    ("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3", "sequence_parallel_size", None,
     "average_gradients_over_sequence_ranks (set to 1 after __init__)"),
    # DeepSpeed's Ulysses loader adapter, subclassed by sequence_parallel.ShardedBatches
    ("deepspeed.runtime.sequence_parallel.ulysses_sp:UlyssesSPDataLoaderAdapter", "refill", [],
     "ShardedBatches: the group's batches widened before its gather, micro-batches skipped on resume"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp:UlyssesSPDataLoaderAdapter", "iter", None,
     "ShardedBatches: the inner loader's iterator, replaced to skip and to hand refill one batch"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp:UlyssesSPDataLoaderAdapter", "micro_batches", None,
     "ShardedBatches: the slices not yet handed out"),
    ("transformers.trainer", "skip_first_batches", ["dataloader", "num_batches"],
     "patches.transformers.skip_batches_of_sequence_shards (the Trainer's name for accelerate's function)"),
    # torch
    ("torch.distributed.distributed_c10d", "_get_default_store", [], "lifetime: the heartbeat's store"),
    ("torch.distributed.fsdp:FSDPModule", "_get_fsdp_state", [], "artifacts.describe: FSDP2's reduce dtype"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState", "_mp_policy", None, "artifacts.describe"),
    ("torch.nn:Module", "_register_state_dict_hook", ["hook"], "moe.expert_parallel: full expert state dicts"),
    ("torch.nn:Module", "_register_load_state_dict_pre_hook", ["hook"], "moe.expert_parallel"),
    ("torch:Tensor", "_version", None, "moe.expert_parallel: a parameter changed since its gather"),
    ("torch.nn.parallel:DistributedDataParallel", "_ddp_params_and_buffers_to_ignore", None,
     "moe.expert_parallel: per-rank experts left out of DDP (read by DDP from the module)"),
    # datasets
    ("datasets:Dataset", "_fingerprint", None, "data.build: the tokenised cache's name"),
    # the test suite's own harness (not the package): a changed member would break the harness silently
    ("accelerate.state:AcceleratorState", "_reset_state", ["reset_partial_state"],
     "tests/matrix_worker.py: a fresh per-run accelerate state between the variants of one launch"),
    ("accelerate.state:GradientState", "_reset_state", [], "tests/matrix_worker.py"),
]
# Attributes that exist only on instances (set in __init__ or by the library at run time): checked by source.
INSTANCE_ATTRIBUTES = {
    ("transformers:Trainer", "_tr_loss"): ("transformers.trainer", "self._tr_loss = "),
    ("transformers:PretrainedConfig", "_attn_implementation"): ("transformers.configuration_utils",
                                                                "def _attn_implementation("),
    ("accelerate.state:AcceleratorState", "_mixed_precision"): ("accelerate.state", "self._mixed_precision = "),
    ("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState", "_mp_policy"): (
        "torch.distributed.fsdp._fully_shard._fsdp_state", "self._mp_policy = "),
    ("torch.nn.parallel:DistributedDataParallel", "_ddp_params_and_buffers_to_ignore"): (
        "torch.nn.parallel.distributed", "_ddp_params_and_buffers_to_ignore"),
    ("datasets:Dataset", "_fingerprint"): ("datasets.arrow_dataset", "self._fingerprint = "),
    ("transformers:PreTrainedModel", "_no_split_modules"): ("transformers.modeling_utils",
                                                            "self._no_split_modules = set(self._no_split_modules"),
    ("transformers:PreTrainedModel", "_weight_conversions"): ("transformers.core_model_loading",
                                                              "model._weight_conversions = model_specific_conversions"),
    ("trl:GRPOTrainer", "_metrics"): ("trl.trainer.grpo_trainer", "self._metrics = {"),
    ("bitsandbytes.nn:Linear4bit", "support_avx512bf16_for_cpu"): (
        "bitsandbytes.nn.modules", "self.support_avx512bf16_for_cpu = "),
    ("trl:GRPOTrainer", "_tokenizer"): ("trl.trainer.grpo_trainer", "self._tokenizer = processing_class"),
    ("transformers.distributed.fsdp:is_fsdp_managed_module", "_is_fsdp_managed_module"): (
        "transformers.distributed.fsdp", 'getattr(module, "_is_fsdp_managed_module", False)'),
    ("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "sequence_parallel_size"): (
        "deepspeed.runtime.zero.stage_1_and_2", "self.sequence_parallel_size = "),
    ("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3", "sequence_parallel_size"): (
        "deepspeed.runtime.zero.stage3", "self.sequence_parallel_size = "),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp:UlyssesSPDataLoaderAdapter", "iter"): (
        "deepspeed.runtime.sequence_parallel.ulysses_sp", "self.iter = iter(dl)"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp:UlyssesSPDataLoaderAdapter", "micro_batches"): (
        "deepspeed.runtime.sequence_parallel.ulysses_sp", "self.micro_batches: deque"),
}
# The order of calls hftrain relies on: (owner, method, the fragments that must appear in this order in its source).
ORDER = [
    ("transformers:Trainer", "_run_epoch", ["self.training_step(", "self._get_grad_norm(", "self.optimizer.step()"],
     "the step guard sees every micro-batch's loss, then judges the norm before the optimizer steps"),
    ("transformers:Trainer", "_run_epoch",
     ["self.get_batch_samples(", "self.training_step(model, inputs, num_items_in_batch)"],
     "the global count of the step is known before its micro-batches' losses"),
    ("transformers:Trainer", "get_batch_samples", ["self._get_num_items_in_batch("],
     "the exact losses count through _get_num_items_in_batch"),
    ("transformers:Trainer", "_save_checkpoint", ["self._get_output_dir(", "self.save_model("],
     "the staging folder replaces the run folder for the whole save"),
    ("transformers:Trainer", "_run_epoch", ["self._load_rng_state(", "self.training_step("],
     "an RNG file is judged before training resumes"),
    ("transformers:Trainer", "_inner_training_loop", ["self._tr_loss = ", "self._run_epoch("],
     "the step guard may zero the logged loss of a skipped step"),
    ("trl.experimental.orpo:ORPOTrainer", "concatenated_forward",
     ["labels = torch.where(attention_mask == 1, labels, -100)",
      "chosen_nll_loss = cross_entropy_loss(all_logits[:len_chosen], labels[:len_chosen])",
      "return (chosen_logps, rejected_logps, chosen_logits, rejected_logits, chosen_nll_loss, outputs.aux_loss)"],
     "orpo: the NLL is the mean over the chosen rows' attended positions after the first; it is returned 5th"),
    ("trl.experimental.orpo:ORPOTrainer", "get_batch_loss_metrics",
     ["self.concatenated_forward(model, batch)", "self.odds_ratio_loss(", "loss = policy_nll_loss - losses.mean()",
      "loss += self.aux_loss_coef * aux_loss"], "orpo: the loss is the NLL minus the mean of the odds-ratio terms"),
    ("trl:KTOTrainer", "_compute_loss",
     ["KL_logps = self._compute_kl_logps(model, batch)", 'ref_KL_logps = batch["ref_KL_logps"]',
      "ref_KL_logps = self._compute_kl_logps(", "kl = (KL_logps - ref_KL_logps).mean().detach()",
      "kl = self.accelerator.gather_for_metrics(kl).mean().clamp(min=0)", "loss = losses.nanmean()"],
     "kto: the policy's KL forward comes first, then the reference's (or the batch's), and KTO's KL is their mean "
     "difference; the loss the mean over the micro-batch"),
    ("trl:GRPOConfig", "__post_init__", ["self.steps_per_generation = self.gradient_accumulation_steps"],
     "grpo: the generation batch is one optimizer step, which makes TRL's grpo/dr_grpo/dapo exact"),
    ("trl:GRPOTrainer", "_generate_and_score_completions", ["self._calculate_rewards(", "advantages = ",
                                                            '"advantages": advantages'],
     "grpo: reward errors are raised before any advantage is used; the advantages returned are logged"),
    ("trl:GRPOTrainer", "_compute_loss", ['normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / '
                                          "self.accelerator.num_processes"],
     "grpo: dapo divides by the generation batch's token count, all-reduced over the ranks"),
    ("transformers:Trainer", "_prepare_for_training", ["self.accelerator.prepare(", "deepspeed_ulysses_dl_adapter("],
     "sequence parallelism: Ulysses is registered (prepare) around the kernel installed before, then the loader "
     "wrapped, which hftrain rewraps"),
    ("transformers:Trainer", "_run_epoch", ["skip_first_batches(train_dataloader", "train_dataloader.set_epoch(",
                                            "iter(train_dataloader)"],
     "ShardedBatches: a resume's skip comes before set_epoch, the inner iteration (lazy) after both"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp:UlyssesSPDataLoaderAdapter", "refill",
     ["next(self.iter)", "dist.all_gather(tensor_list", "batch.pop(\"labels\")", "self.micro_batches.append("],
     "ShardedBatches hands refill one widened batch; the slices carry shift_labels, not labels"),
    ("trl:GRPOTrainer", "_tool_call_loop", ["return tool_mask, completions, "],
     "GroupTrainer._tool_call_loop reads the completions as the loop's second result"),
    ("bitsandbytes.nn:Linear4bit", "forward", ["and self.support_avx512bf16_for_cpu",
                                               "_convert_weight_packed_for_cpu("],
     "keep_training_kernels: the flag is what guards the repacking for the inference kernel"),
    ("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "average_tensor",
     ["/ float(self.sequence_parallel_size)"], "average_gradients_over_sequence_ranks: the division it undoes"),
]


def resolve(owner: str):
    module, _, qualname = owner.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def contract_problems(resolve=resolve) -> list[str]:
    """What of CONTRACT and ORDER the installed libraries break (`resolve` maps an owner to its object)."""
    problems = []
    for owner, name, params, where in CONTRACT:
        try:
            obj = resolve(owner)
        except (ImportError, AttributeError) as e:
            problems.append(f"{owner}: cannot be imported ({e}); hftrain uses it in {where}")
            continue
        if (owner, name) in INSTANCE_ATTRIBUTES and getattr(obj, name, None) is None:  # set on instances only
            module, fragment = INSTANCE_ATTRIBUTES[(owner, name)]
            if fragment not in inspect.getsource(importlib.import_module(module)):
                problems.append(f"{owner}.{name}: no longer set by {module} ('{fragment}'); hftrain uses it in "
                                f"{where}")
            continue
        member = getattr(obj, name, None)
        if member is None:
            problems.append(f"{owner}.{name}: missing; hftrain uses it in {where}")
            continue
        if params is not None:
            got = [p for p in inspect.signature(member).parameters if p != "self"]
            lost = [p for p in params if p not in got]
            if lost:
                problems.append(f"{owner}.{name}: parameters {got}, hftrain passes {params} in {where}")
    for owner, method, fragments, why in ORDER:
        try:
            src = inspect.getsource(getattr(resolve(owner), method))
        except (ImportError, AttributeError, TypeError, OSError) as e:
            problems.append(f"{owner}.{method}: cannot be read ({e}); hftrain relies on it: {why}")
            continue
        at = 0
        for fragment in fragments:
            found = src.find(fragment, at)
            if found < 0:
                problems.append(f"{owner}.{method}: '{fragment}' no longer follows "
                                f"{fragments[:fragments.index(fragment)]}"
                                f"; hftrain relies on: {why}")
                break
            at = found + len(fragment)
    return problems


def test_the_installed_libraries_keep_the_contract():
    assert contract_problems() == []


def test_a_renamed_member_breaks_the_contract():
    """A copy of transformers' Trainer with `_get_grad_norm` renamed (and its training loop calling the new name)."""
    from transformers import Trainer

    body = {k: v for k, v in vars(Trainer).items() if k not in ("_get_grad_norm", "__dict__", "__weakref__")}
    body["_get_grad_norm_v2"] = Trainer._get_grad_norm
    Renamed = type("Trainer", Trainer.__bases__, body)

    def resolve_renamed(owner):
        return Renamed if owner == "transformers:Trainer" else resolve(owner)

    problems = contract_problems(resolve_renamed)
    assert any(p.startswith("transformers:Trainer._get_grad_norm: missing") for p in problems), problems


def test_a_reordered_loop_breaks_the_contract(monkeypatch):
    """The guard's order check reads the source: a loop that steps the optimizer before the norm is judged fails."""
    from transformers import Trainer

    real = inspect.getsource

    def swapped(obj):
        src = real(obj)
        if getattr(obj, "__name__", "") == "_run_epoch":
            src = src.replace("self.optimizer.step()", "STEP").replace("self._get_grad_norm(", "self.optimizer.step()")
            src = src.replace("STEP", "self._get_grad_norm(")
        return src

    monkeypatch.setattr(inspect, "getsource", swapped)
    assert Trainer  # the class is untouched; only what its source says changed
    assert any("_run_epoch" in p and "optimizer.step()" in p for p in contract_problems())


# -- completeness ------------------------------------------------------------------------------------------------
def _hftrain_classes():
    import hftrain.methods  # noqa: F401  (imports every method's trainer)
    import hftrain.trainer  # noqa: F401

    seen = set()
    for path in PACKAGE.rglob("*.py"):
        name = "hftrain." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        try:
            module = importlib.import_module(name)
        except ImportError:  # optional dependencies (deepspeed) missing
            continue
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == module.__name__ and cls not in seen:
                seen.add(cls)
                yield cls


def overridden_private_members() -> set[tuple[str, str]]:
    """(library, member) of every private method an hftrain class (a mixin included, through the trainers composed
    from it) defines that a library class later in the method order also has."""
    found = set()
    for composed in _hftrain_classes():
        mro = composed.__mro__
        for i, cls in enumerate(mro):
            if not cls.__module__.startswith("hftrain"):
                continue
            for name, value in vars(cls).items():
                if not name.startswith("_") or name.startswith("__") or not inspect.isfunction(value):
                    continue  # (a library's metaclass may add private attributes of its own: torch's _backward_cls)
                if not (value.__module__ or "").startswith("hftrain"):
                    continue  # put there by the standard library, not written here: enum's _generate_next_value_
                for base in mro[i + 1:]:
                    if not base.__module__.startswith("hftrain") and name in vars(base):
                        found.add((base.__module__.split(".")[0], name))
    return found


def read_private_names() -> set[str]:
    """Private attribute names hftrain's code reads or writes on objects, that no hftrain code defines itself."""
    used, own = set(), set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in [t for tg in targets for t in (tg.elts if isinstance(tg, ast.Tuple) else [tg])]:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                            target.value.id in ("self", "cls"):
                        own.add(target.attr)
                    elif isinstance(target, ast.Name):
                        own.add(target.id)
            if isinstance(node, ast.Attribute) and re.match(r"_[a-z]", node.attr):
                used.add(node.attr)
    return used - own - {"_exit"}  # os._exit is public API despite its name


def test_every_private_member_hftrain_touches_is_in_the_contract():
    listed = {name for _, name, _, _ in CONTRACT}
    by_library = {(owner.split(":")[0].split(".")[0], name) for owner, name, _, _ in CONTRACT}
    missing_overrides = sorted(f"{lib}.{name}" for lib, name in overridden_private_members() - by_library)
    missing_reads = sorted(read_private_names() - listed)
    assert missing_overrides == [] and missing_reads == [], (
        "hftrain touches private members not listed in CONTRACT: add each with the parameters it relies on",
        missing_overrides, missing_reads)


@pytest.mark.parametrize("owner", sorted({o for o, *_ in CONTRACT}))
def test_every_owner_resolves(owner):
    assert resolve(owner) is not None
