"""Memory plan: per-GPU, per-node CPU and per-node NVMe bytes of every strategy for one recipe.

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020), with Ψ parameters of which Ψt are
trained, N GPUs in all:

    engine / precision                  params   grads    optimizer (Adam)
    PyTorch (ddp, fsdp), weights dtype p   pΨ      pΨt      2pΨt  (moments in the weights' dtype)
    DeepSpeed, bf16/fp16 training          2Ψ      2Ψt      16Ψt  (fp32 grads + fp32 master + 2 moments)
    DeepSpeed, fp32 training               4Ψ      4Ψt      12Ψt  (fp32 master copy + 2 moments, see below;
                                                                    zero3: 8Ψt)

    ddp: P + G + O     zero1: P + G + O/N     zero2: P + (G + O)/N     zero3, fsdp: (P + G + O)/N
    zero3_offload: P, G, O in CPU memory (per node: /nodes); the GPU holds the largest layer gathered
    zero_infinity: P and O on NVMe (per node: /nodes), G and the swap buffers in CPU memory; the GPU holds the
                   largest layer

In fp32, DeepSpeed still keeps its own fp32 master copy (ZeRO-1/2, and ZeRO-3 with an offloaded optimizer, which
also keeps an fp32 gradient copy for its CPU Adam); plain ZeRO-3 reuses the weights once hftrain.patches.deepspeed
repairs its device check.

Activations are an estimate (Korthikanti et al. 2022: ~34·s·b·h bytes per layer in 16-bit without
recomputation, 2·s·b·h with full checkpointing plus one layer's worth), plus the fp32 logits and their gradient.
With strategy.sequence_parallel N (zero2, zero3) a rank holds s/N tokens of each sequence: its activations are
those of s/N (Ulysses' all-to-all turns s/N tokens x all heads into s tokens x heads/N, the same bytes); the
model states are partitioned over all ranks as without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig

from ..config import ModelSection
from ..config.strategy import STRATEGY_DEFAULTS
from ..config.strategy_rules import strategy_problems
from ..constants import OFFLOADED, SEQUENCE_PARALLEL_STRATEGIES, STRATEGIES
from ..heads import Head
from ..kernels import kernels_line
from ..methods import ModelSpec, Recipe, method_of
from ..moe.blocks import moe_blocks, router_of
from ..quantization import quantized_linear_bytes
from .strategies import optimizer_swap_buffers

GiB = 2**30
SWAP_ALIGN = 2**18  # elements


def swap_buffer_elems(largest_tensor: int, world: int) -> int:
    """ZeRO-Infinity's swap buffer size as hftrain sets it when the recipe does not: a rank swaps only its
    partition of each parameter, so a buffer holds the largest partition, ceil(largest / world), rounded up to
    256K elements (DeepSpeed's default 1e8 elements pins GBs per rank whatever the model)."""
    part = -(-largest_tensor // world)
    return -(-part // SWAP_ALIGN) * SWAP_ALIGN


def swap_buffer_bytes(largest_tensor: int, world: int, buffer_count: int = STRATEGY_DEFAULTS["buffer_count"]) -> int:
    """CPU bytes per rank of ZeRO-Infinity's fp32 buffers, sized as above: buffer_count parameter swap buffers,
    the optimizer's swap buffers (strategies.optimizer_swap_buffers) and one sub-group's fp32 gradient."""
    return 4 * swap_buffer_elems(largest_tensor, world) * (buffer_count + optimizer_swap_buffers(buffer_count) + 1)


@dataclass
class ModelFacts:
    params: int
    trainable: int
    largest_layer: int
    hidden: int
    layers: int
    vocab: int
    weight_bytes: int  # bytes per parameter of the loaded weights (of the adapter's, over a quantised base)
    largest_tensor: int = 0  # elements of the largest single parameter
    param_bytes: float | None = None  # all parameters' bytes where they are not weight_bytes each (a quantised base)
    # MoE models: the intermediate width each token's activations run through in the sparse layers (top-k experts'
    # plus a shared expert's), the number of sparse layers and the parameters one token uses (the others' experts
    # idle); 0 / params for a dense model.
    active_intermediate: int = 0
    moe_layers: int = 0
    active_params: int = 0
    model_type: str | None = None  # config.model_type: which fused kernels the family has (kernels.py)


@dataclass
class Row:
    strategy: str
    gpu_params: float
    gpu_grads: float
    gpu_optimizer: float
    gpu_activations: float
    cpu_per_node: float
    nvme_per_node: float

    @property
    def gpu_model_states(self) -> float:
        return self.gpu_params + self.gpu_grads + self.gpu_optimizer

    @property
    def gpu_total(self) -> float:
        return self.gpu_model_states + self.gpu_activations


def state_bytes(strategy: str, f: ModelFacts, mixed: bool) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of the whole model before partitioning."""
    if strategy in ("ddp", "fsdp"):
        p = f.weight_bytes
        params = p * f.params if f.param_bytes is None else f.param_bytes
        return params, p * f.trainable, 2 * p * f.trainable
    if mixed:  # DeepSpeed keeps an fp32 copy of the gradient partition beside the optimizer states
        return 2 * f.params, 2 * f.trainable, 16 * f.trainable
    master = 0 if strategy == "zero3" else 4  # a redundant fp32 master copy (module docstring)
    cpu_grads = 4 if strategy in OFFLOADED else 0  # the CPU Adam's fp32 gradient copy
    return 4 * f.params, 4 * f.trainable, (8 + master + cpu_grads) * f.trainable


def activation_bytes(f: ModelFacts, micro_batch: int, seq: int, checkpointing: bool, act_bytes: int = 2) -> float:
    """Korthikanti et al.'s 34 s b h per layer (2 bytes each), 16 of which are the MLP's 4h-wide activations: in an
    MoE layer those scale with the width a token runs through (its top-k experts' and a shared expert's), not with
    the number of experts."""
    sbh = seq * micro_batch * f.hidden * act_bytes / 2
    sparse = (34 - 16 + 16 * f.active_intermediate / (4 * f.hidden)) * sbh
    per_layer = [sparse] * f.moe_layers + [34 * sbh] * (f.layers - f.moe_layers)
    layers = 2 * sbh * f.layers + max(per_layer) if checkpointing else sum(per_layer)
    logits = 2 * 4 * micro_batch * seq * f.vocab
    return layers + logits


def frozen_bytes(frozen: list[ModelFacts]) -> float:
    """The weights of the models a method holds but does not train (a teacher, a reward model): no gradients, no
    optimizer states; they are sharded and offloaded as the policy's parameters are."""
    return sum(f.params * f.weight_bytes if f.param_bytes is None else f.param_bytes for f in frozen)


def plan(f: ModelFacts, gpus_per_node: int, nodes: int, micro_batch: int, seq: int, checkpointing: bool,
         mixed: bool, sequence_parallel: int = 1, frozen: list[ModelFacts] = (),
         whole: list[ModelFacts] = ()) -> list[Row]:
    """One row per strategy; with `sequence_parallel` N the strategies that run it hold s/N tokens' activations;
    `frozen`: the facts of the models beside the policy, placed as the policy (frozen_bytes); `whole`: those held
    whole on every device whatever the strategy (GRPO's reward models)."""
    n = gpus_per_node * nodes
    full = activation_bytes(f, micro_batch, seq, checkpointing)
    split = activation_bytes(f, micro_batch, -(-seq // sequence_parallel), checkpointing)
    layer = 4 * f.largest_layer
    rows = []
    for s in STRATEGIES:
        act = split if s in SEQUENCE_PARALLEL_STRATEGIES else full
        P, G, Opt = state_bytes(s, f, mixed)  # the docstring's P, G, O
        P += frozen_bytes(frozen)
        cpu = nvme = 0.0
        if s == "ddp":
            gpu = (P, G, Opt)
        elif s == "zero1":
            gpu = (P, G, Opt / n)
        elif s == "zero2":
            gpu = (P, G / n, Opt / n)
        elif s in ("zero3", "fsdp"):
            gpu = (P / n + layer, G / n, Opt / n)
        elif s == "zero3_offload":
            gpu, cpu = (layer, 0.0, 0.0), (P + G + Opt) / nodes
        else:  # zero_infinity
            swap = swap_buffer_bytes(f.largest_tensor, n) * gpus_per_node
            gpu, cpu, nvme = (layer, 0.0, 0.0), G / nodes + swap, (P + Opt) / nodes
        gpu = (gpu[0] + frozen_bytes(whole), *gpu[1:])
        rows.append(Row(s, *gpu, act, cpu, nvme))
    return rows


def model_facts(name_or_path: str, lora_r: int | None = None, trust_remote_code: bool = False,
                dtype: str = "auto", quantization=None, head: Head = Head.CAUSAL_LM,
                num_labels: int | None = None) -> ModelFacts:
    """Parameter counts from the model's config, built with its `head` (the method's policy: methods.policy_head) on
    the meta device (no weights are read), a classifier with the `num_labels` its method fixes. `quantization`
    (model.quantization, QLoRA): bitsandbytes' packed linear weights (all but the output head, as transformers
    quantises them), the other weights in float32 (peft's preparation), the adapter in float32."""
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if num_labels:
        config.num_labels = num_labels
    with torch.device("meta"):
        model = head.auto_class.from_config(config, trust_remote_code=trust_remote_code)
    params = sum(p.numel() for p in model.parameters())
    trainable = params
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()]
    if lora_r:
        # LoRA on every linear layer: r * (in + out) parameters each.
        trainable = sum(lora_r * (m.in_features + m.out_features) for m in linears)
    layers = [m for m in model.modules() if type(m).__name__ in set(getattr(model, "_no_split_modules", []) or [])]
    largest = max((sum(p.numel() for p in m.parameters()) for m in layers), default=params)
    largest = max(largest, model.get_input_embeddings().weight.numel())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    wdtype = getattr(config, "dtype", None) if dtype == "auto" else dtype
    weight_bytes = 2 if str(wdtype).replace("torch.", "") in ("bfloat16", "float16") else 4
    param_bytes = None
    if quantization is not None:
        packed = sum(m.weight.numel() for m in linears)
        weight_bytes = 4
        param_bytes = (quantized_linear_bytes(packed, quantization.bits, quantization.double_quant is not False)
                       + 4 * (params - packed) + 4 * trainable)
    return ModelFacts(params, trainable, largest, text.hidden_size, text.num_hidden_layers, text.vocab_size,
                      weight_bytes, max(p.numel() for p in model.parameters()), param_bytes, **moe_facts(model),
                      model_type=getattr(config, "model_type", None))


@dataclass
class RecipePlan:
    """A recipe's memory plan: the policy's facts, the facts of the models its method holds beside it (each with its
    ModelSpec: key, section), and the rows of every strategy with and without those (frozen) models."""
    facts: ModelFacts
    frozen: list[tuple[ModelSpec, ModelFacts]]
    rows: list[Row]
    policy_rows: list[Row]


def recipe_plan(recipe: Recipe, gpus_per_node: int, nodes: int) -> RecipePlan:
    """`plan` of the recipe's models (their configs read here), micro-batch, sequence length, checkpointing,
    precision and sequence parallelism: what `hftrain plan` prints and the frozen-model fit check judges."""
    m, method = recipe.model, method_of(recipe)
    policy = method.policy(recipe)
    facts = model_facts(m.name_or_path, m.lora.r if m.lora else None, m.trust_remote_code, m.dtype,
                        quantization=m.quantization, head=policy.head, num_labels=policy.num_labels)
    frozen = [(spec, model_facts(spec.section.name_or_path, None, spec.section.trust_remote_code, spec.section.dtype,
                                 quantization=spec.section.quantization, head=spec.head, num_labels=spec.num_labels))
              for spec in method.others(recipe)]
    t = recipe.typed_training
    shape = (gpus_per_node, nodes, t.per_device_train_batch_size, recipe.data.max_length, m.gradient_checkpointing,
             bool(t.bf16 or t.fp16), recipe.strategy.resolved_sequence_parallel())
    sharded, whole = ([f for spec, f in frozen if spec.whole is w] for w in (False, True))
    return RecipePlan(facts, frozen, plan(facts, *shape, sharded, whole), plan(facts, *shape))


def kernels_here(model: ModelSection, facts: ModelFacts) -> str:
    """Which layers a run of this model would take on this machine (kernels.kernels_line)."""
    line = kernels_line(model.kernels, facts.model_type, quantized=model.quantization is not None)
    return line + " (on this machine)"


def moe_facts(model) -> dict:
    """active_intermediate, moe_layers, active_params of ModelFacts for a model built on the meta device: each sparse
    block's experts (fused [E, hidden, I] down projections), its router's top-k, a shared expert's width."""
    blocks = moe_blocks(model)
    params = sum(p.numel() for p in model.parameters())
    if not blocks:
        return {"active_params": params}
    idle, width = 0, 0
    for b in blocks:
        experts, top_k = b.experts.down_proj.shape[0], router_of(b).top_k
        per_expert = b.experts.down_proj[0].numel() // model.config.get_text_config().hidden_size  # [H, I] or [I, H]
        expert_params = sum(p.numel() for p in b.experts.parameters())
        idle += expert_params - expert_params * top_k // experts
        shared = getattr(b, "shared_expert", None) or getattr(b, "shared_experts", None)
        width = max(width, top_k * per_expert + (shared.down_proj.in_features if shared is not None else 0))
    return {"active_intermediate": width, "moe_layers": len(blocks), "active_params": params - idle}


def refused_strategies(recipe: Recipe) -> dict[str, tuple[str, str]]:
    """{strategy: (key, why)} for the strategies `hftrain check` refuses for this recipe whatever the strategy's own
    options (a quantised base, experts, a method that holds its policy whole, ...): the plan neither counts them as
    fitting nor recommends them. The options of the strategy the recipe names are left out: switching strategy is
    switching them too."""
    refused = {}
    for name in STRATEGIES:
        problems = [(k, m) for k, m in strategy_problems(recipe, name) if not k.startswith("strategy.")]
        if problems:
            refused[name] = problems[0]
    return refused


def recommend(rows: list[Row], gpu_memory: float | None, refused: dict | None = None) -> str | None:
    """The first strategy that fits and is not refused, in order of speed: ddp, zero1, zero2, fsdp, zero3,
    zero3_offload, zero_infinity."""
    if gpu_memory is None:
        return None
    order = ["ddp", "zero1", "zero2", "fsdp", "zero3", "zero3_offload", "zero_infinity"]
    by = {r.strategy: r for r in rows}
    return next((s for s in order if by[s].gpu_total <= gpu_memory and s not in (refused or {})), None)


def _fits(r: Row, gpu_memory: float | None, refused: dict) -> str:
    if r.strategy in refused:
        return "refused"
    return "-" if gpu_memory is None else ("yes" if r.gpu_total <= gpu_memory else "no")


def format_plan(rows: list[Row], gpu_memory: float | None, sequence_parallel: int = 1,
                refused: dict[str, tuple[str, str]] | None = None) -> str:
    head = (f"{'strategy':<14}{'params':>9}{'grads':>9}{'optim':>9}{'activ.':>9}{'GPU total':>11}{'CPU/node':>10}"
            f"{'NVMe/node':>11}  fits")
    lines = [head, "-" * len(head)]
    refused = refused or {}
    for r in rows:
        fits = _fits(r, gpu_memory, refused)
        lines.append(f"{r.strategy:<14}" + "".join(f"{v / GiB:>9.2f}" for v in (r.gpu_params, r.gpu_grads,
                     r.gpu_optimizer, r.gpu_activations)) + f"{r.gpu_total / GiB:>11.2f}{r.cpu_per_node / GiB:>10.2f}"
                     f"{r.nvme_per_node / GiB:>11.2f}  {fits}")
    lines.append("GiB per GPU (params..GPU total) and per node (CPU, NVMe); activations are an estimate.")
    if sequence_parallel > 1:
        lines.append(f"strategy.sequence_parallel {sequence_parallel}: {' and '.join(SEQUENCE_PARALLEL_STRATEGIES)} "
                     f"hold 1/{sequence_parallel} of each sequence's activations per GPU; the others cannot split "
                     "sequences and hold them whole.")
    for name, (key, why) in refused.items():
        lines.append(f"refused: {name}: {key}: {why}")
    best = recommend(rows, gpu_memory, refused)
    if gpu_memory is not None:
        lines.append(f"recommended: {best}" if best else "nothing fits: lower the micro-batch, turn on "
                     "model.gradient_checkpointing, or use LoRA")
    return "\n".join(lines)
