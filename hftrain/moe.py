"""Mixture-of-experts: sparse upcycling with native export, the router aux / z losses, router health, ZeRO-3 leaves.

Upcycling (Komatsuzaki et al. 2022, "Sparse Upcycling"): each chosen dense MLP becomes E experts that are copies
of it, plus a small random router. The result is built as the *native* transformers MoE class of the family
(Llama/Mistral -> Mixtral, Qwen2 -> Qwen2-MoE), so `AutoModelForCausalLM.from_pretrained` loads the saved folder
with no hftrain code. Its outputs equal the dense model's at step 0:
- Mixtral's router renormalises the softmax over the k chosen experts (weights sum to 1), and the experts are
  identical, so the mixture is the dense MLP whatever the router picks.
- Qwen2-MoE adds a shared expert gated by sigmoid(w.x): with w = 0 the gate is exactly 0.5, the shared expert is the
  dense MLP and the routed experts' down projections are halved (norm_topk_prob on): 0.5 MLP + 0.5 MLP = MLP.
  (Scaling by 0.5 is exact in floating point.) The shared expert keeps training as a dense path.
Experts start identical; the random router sends different tokens to different experts, so their gradients, and
then their weights, differ from the first step (tested).

transformers has no upcycling; the weight mapping below is hftrain's, and everything else (the MoE classes, the
load-balancing loss, saving) is transformers'.
"""

from __future__ import annotations

import math
import os
from typing import Iterable

import torch

from .modeling import ModelError

# dense model_type -> the MoE model_type it is upcycled to
UPCYCLE_TARGETS = {"llama": "mixtral", "mistral": "mixtral", "qwen2": "qwen2_moe"}
# MoE families whose decoder layers can stay dense (Mixtral builds a sparse block in every layer)
PARTIAL_LAYERS = {"qwen2_moe"}


class MoeError(ModelError):
    """A user error (unsupported family, bad layer list, ...); the message names the option and the fix."""


# ----------------------------------------------------------------------------------------------------------------
# Upcycling


def supported() -> str:
    return ", ".join(f"{k} -> {v}" for k, v in UPCYCLE_TARGETS.items())


def _layer_list(layers: Iterable[int] | None, n: int, key: str) -> list[int]:
    if layers is None:
        return list(range(n))
    out = sorted({int(i) for i in layers})
    bad = [i for i in out if not 0 <= i < n]
    if bad or not out:
        raise MoeError(f"{key}: layers must be a non-empty list of indices in 0..{n - 1}, got {list(layers)}")
    return out


def moe_config(dense_config, num_experts: int, top_k: int, layers: list[int]):
    """The native MoE config equivalent to `dense_config` with `layers` sparse."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    c = dense_config
    target = UPCYCLE_TARGETS[c.model_type]
    common = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        hidden_act=c.hidden_act, max_position_embeddings=c.max_position_embeddings,
        initializer_range=c.initializer_range, rms_norm_eps=c.rms_norm_eps, use_cache=c.use_cache,
        pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        tie_word_embeddings=c.tie_word_embeddings, rope_parameters=dict(c.rope_parameters),
        attention_dropout=c.attention_dropout, num_experts_per_tok=top_k, output_router_logits=False,
    )
    if target == "mixtral":
        if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
            raise MoeError(f"--model: this {c.model_type} has attention/MLP biases, which Mixtral has no place for; "
                           "it cannot be upcycled exactly")
        cfg = MixtralConfig(**common, intermediate_size=c.intermediate_size, head_dim=getattr(c, "head_dim", None),
                            sliding_window=getattr(c, "sliding_window", None), num_local_experts=num_experts,
                            router_jitter_noise=0.0)
    else:
        cfg = Qwen2MoeConfig(
            **common, intermediate_size=c.intermediate_size, moe_intermediate_size=c.intermediate_size,
            shared_expert_intermediate_size=c.intermediate_size, num_experts=num_experts, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[i for i in range(c.num_hidden_layers) if i not in layers],
            qkv_bias=True, use_sliding_window=c.use_sliding_window, sliding_window=c.sliding_window,
            max_window_layers=c.max_window_layers, layer_types=list(c.layer_types),
        )
    cfg.dtype = c.dtype
    return cfg


def upcycle(model, num_experts: int, top_k: int, layers: Iterable[int] | None = None,
            router_init_std: float | None = None, seed: int = 0):
    """A new native MoE model whose chosen MLPs are `num_experts` copies of `model`'s (see the module docstring).

    `router_init_std`: std of the routers' normal init (default: the config's initializer_range); the routers are
    seeded with `seed` so every rank builds the same model.
    """
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    c = model.config
    if c.model_type not in UPCYCLE_TARGETS:
        raise MoeError(f"--model / moe.upcycle: model type {c.model_type!r} has no MoE counterpart in transformers "
                       f"that hftrain can upcycle to; supported: {supported()}")
    if is_deepspeed_zero3_enabled():
        raise MoeError("moe.upcycle: the model is sharded by ZeRO-3 as it loads, so it cannot be upcycled in the "
                       "run; run `hftrain moe upcycle` first and set model.name_or_path to its output")
    if not (isinstance(num_experts, int) and num_experts >= 2):
        raise MoeError(f"--num-experts / moe.upcycle.num_experts: must be an integer >= 2, got {num_experts!r}")
    if not (isinstance(top_k, int) and 1 <= top_k <= num_experts):
        raise MoeError(f"--top-k / moe.upcycle.top_k: must be in 1..{num_experts} (num_experts), got {top_k!r}")
    n = c.num_hidden_layers
    chosen = _layer_list(layers, n, "--layers / moe.upcycle.layers")
    target = UPCYCLE_TARGETS[c.model_type]
    if len(chosen) < n and target not in PARTIAL_LAYERS:
        raise MoeError(f"--layers / moe.upcycle.layers: {target} (the MoE class for {c.model_type}) has a sparse "
                       f"block in every layer and no per-layer dense MLP, so every layer must be upcycled; omit the "
                       f"option (families that allow a subset: {', '.join(sorted(PARTIAL_LAYERS))})")
    cfg = moe_config(c, num_experts, top_k, chosen)
    dense = model.state_dict()
    std = c.initializer_range if router_init_std is None else router_init_std
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in dense.items():
        parts = k.split(".")
        # model.layers.{i}.mlp.{gate,up,down}_proj.weight
        if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] == "mlp" and int(parts[2]) in chosen:
            continue
        state[k] = v
    for i in chosen:
        p = f"model.layers.{i}.mlp."
        gate, up, down = dense[p + "gate_proj.weight"], dense[p + "up_proj.weight"], dense[p + "down_proj.weight"]
        scale = 0.5 if target == "qwen2_moe" else 1.0  # the shared expert carries the other half
        state[p + "experts.gate_up_proj"] = torch.cat([gate, up], 0).unsqueeze(0).repeat(num_experts, 1, 1)
        state[p + "experts.down_proj"] = (down * scale).unsqueeze(0).repeat(num_experts, 1, 1)
        router = torch.randn(num_experts, c.hidden_size, generator=gen, dtype=torch.float32) * std
        state[p + "gate.weight"] = router.to(gate.dtype)
        if target == "qwen2_moe":
            state[p + "shared_expert.gate_proj.weight"] = gate.clone()
            state[p + "shared_expert.up_proj.weight"] = up.clone()
            state[p + "shared_expert.down_proj.weight"] = down.clone()
            state[p + "shared_expert_gate.weight"] = torch.zeros(1, c.hidden_size, dtype=gate.dtype)
    from transformers import initialization as init

    with init.no_init_weights():  # every weight is set below; skip the random init
        moe = AutoModelForCausalLM.from_config(cfg, dtype=next(model.parameters()).dtype,
                                               attn_implementation=c._attn_implementation)
    missing, unexpected = moe.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:  # a transformers change in parameter names: never save a half-initialised model
        raise RuntimeError(f"upcycling {c.model_type} -> {target}: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        moe.tie_weights()
    moe.generation_config = model.generation_config
    moe.train(model.training)
    return moe


def upcycle_folder(src: str, output: str, num_experts: int, top_k: int, layers: list[int] | None = None,
                   router_init_std: float | None = None, seed: int = 0) -> str:
    """`hftrain moe upcycle`: load `src` (safetensors), upcycle, save model + tokenizer to `output`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(src):
        raise MoeError(f"--model: {src} is not a folder (a local model folder, e.g. from save_pretrained)")
    model_type = AutoConfig.from_pretrained(src).model_type
    if model_type not in UPCYCLE_TARGETS:
        raise MoeError(f"--model: model type {model_type!r} has no MoE counterpart in transformers that hftrain can "
                       f"upcycle to; supported: {supported()}")
    dense = AutoModelForCausalLM.from_pretrained(src, dtype="auto", use_safetensors=True)
    moe = upcycle(dense, num_experts, top_k, layers, router_init_std, seed)
    os.makedirs(output, exist_ok=True)
    moe.save_pretrained(output, safe_serialization=True)
    try:
        AutoTokenizer.from_pretrained(src).save_pretrained(output)
    except (OSError, ValueError):  # a folder with weights only: nothing to copy
        pass
    return output


# ----------------------------------------------------------------------------------------------------------------
# Finding MoE blocks and routers in any transformers MoE model


def moe_blocks(model) -> list[torch.nn.Module]:
    """Sparse MoE blocks: modules with a router `gate` and an `experts` child (Mixtral, Qwen2/3-MoE, OLMoE, ...),
    or hftrain's expert-parallel layer."""
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")
            and isinstance(getattr(m, "experts"), torch.nn.Module)]


def routers(model) -> list[torch.nn.Module]:
    return [b.gate for b in moe_blocks(model)]


def _unwrap(model):
    while hasattr(model, "module"):  # DDP / DeepSpeed engine
        model = model.module
    return model


def register_zero3_leaf_modules(model) -> list[str]:
    """Make every MoE block one ZeRO-3 unit (DeepSpeed gathers all its parameters at once), so a rank whose tokens
    skip an expert does not wait for a gather the other ranks never issue. Same call as accelerate's
    `DeepSpeedPlugin.set_moe_leaf_modules`, with the classes found in the model instead of named in an env var."""
    from deepspeed.utils import set_z3_leaf_modules
    from deepspeed.utils.z3_leaf_module import get_z3_leaf_modules

    classes = sorted({type(b) for b in moe_blocks(model)}, key=lambda t: t.__name__)
    if classes:
        set_z3_leaf_modules(model, classes)
    return [f"{c.__name__} x{sum(type(m) is c for m in get_z3_leaf_modules(model))}" for c in classes]


# ----------------------------------------------------------------------------------------------------------------
# Aux losses


class _MaskTap:
    """Keeps the attention mask of the current forward: the z-loss and router statistics must skip padding, and
    the model output does not carry the mask. (transformers' own load-balancing loss gets it inside the forward.)"""

    def __init__(self, model):
        self.mask = None
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.mask = kwargs.get("attention_mask")

    def flat(self, rows: int):
        m = self.mask
        if m is None or m.dim() != 2 or m.numel() != rows:  # packed rows (no mask) or a 4-D mask: every row counts
            return None
        return m.reshape(-1).float()


def z_loss(router_logits: tuple[torch.Tensor, ...], flat_mask: torch.Tensor | None) -> torch.Tensor:
    """Router z-loss (Zoph et al. 2022, ST-MoE): mean over layers and real tokens of logsumexp(router logits)^2.
    Hand-written because transformers' `router_z_loss_func` (switch_transformers) takes no padding mask."""
    per_layer = []
    for logits in router_logits:
        z = torch.logsumexp(logits.float(), dim=-1).pow(2)
        per_layer.append(z.mean() if flat_mask is None else (z * flat_mask).sum() / flat_mask.sum().clamp(min=1))
    return torch.stack(per_layer).mean()


def _check_moe_model(model, key: str) -> None:
    if not routers(model) or not hasattr(model.config, "output_router_logits"):
        raise MoeError(f"{key}: {type(model).__name__} has no MoE router (no sparse block found and no "
                       "config.output_router_logits); use an MoE model or set moe.upcycle")


def attach(trainer, cfg=None) -> dict:
    """Wire MoE into an HFTrainer before train(): ZeRO-3 leaf modules for any MoE block, and with a `moe:` section
    the aux / z losses through `trainer.aux_losses` (scaled by losses.aux_loss_term, so exact over ranks and
    accumulation) and the router-health callback. Returns what was done (for the log)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    model = _unwrap(trainer.model)
    done: dict = {}
    if is_deepspeed_zero3_enabled():
        done["zero3_leaf_modules"] = register_zero3_leaf_modules(model)
    if cfg is not None:
        _attach_section(trainer, model, cfg, done)
    if done:
        from .distributed import print0

        print0(f"hftrain: moe: {done}")
    return done


def _attach_section(trainer, model, cfg, done: dict) -> None:
    from .callbacks import RouterHealthCallback

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if cfg.aux_loss_coef or cfg.router_z_loss_coef:
        _check_moe_model(base, "moe.aux_loss_coef / moe.router_z_loss_coef")
        # The model returns router logits and its load-balancing loss (computed with the attention mask) as
        # `outputs.aux_loss`; it adds nothing to a loss because hftrain passes no labels (outputs.loss is None).
        base.config.output_router_logits = True
        tap = _MaskTap(base)
        if cfg.aux_loss_coef:
            trainer.aux_losses["moe_aux_loss"] = (_model_aux_loss, float(cfg.aux_loss_coef))
        if cfg.router_z_loss_coef:
            trainer.aux_losses["moe_z_loss"] = (
                lambda out: z_loss(out.router_logits, tap.flat(out.router_logits[0].shape[0])),
                float(cfg.router_z_loss_coef))
        done["aux_losses"] = sorted(k for k in trainer.aux_losses if k.startswith("moe_"))
    if cfg.expert_parallel_size > 1 or cfg.capacity_factor:
        done["expert_parallel"] = _expert_parallel(trainer, base, cfg)
    if cfg.router_health and routers(base):
        cb = RouterHealthCallback(base)
        trainer.add_callback(cb)  # its pop_logs() joins each training log (HFTrainer.log)
        done["router_health"] = len(cb.layers)


def _expert_parallel(trainer, model, cfg) -> str:
    import torch.distributed as dist
    from transformers.integrations import is_deepspeed_zero3_enabled

    from . import expert_parallel as ep

    n = cfg.expert_parallel_size
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        if n > 1:
            raise MoeError("moe.expert_parallel_size: runs under strategy ddp only (ZeRO and FSDP would shard or "
                           "average the per-rank experts); launch with accelerate_configs/ddp.yaml, or set "
                           "expert_parallel_size: 1 and keep every expert on every rank")
        if is_deepspeed_zero3_enabled() or trainer.is_fsdp_enabled:
            raise MoeError("moe.capacity_factor: needs the whole MoE block on each rank; not with ZeRO-3 / FSDP")
    world = trainer.args.world_size
    if n > 1 and n != world:
        raise MoeError(f"moe.expert_parallel_size: must equal the number of processes ({world}), got {n} "
                       "(expert-parallel groups inside data parallelism are not supported)")
    _check_moe_model(model, "moe.expert_parallel_size / moe.capacity_factor")
    group = dist.group.WORLD if n > 1 else None
    try:
        swapped = ep.parallelize(model, group, cfg.capacity_factor)
    except ValueError as e:
        raise MoeError(str(e)) from None
    trainer.add_callback(ep.ExpertParallelCallback(model))
    return f"{swapped} blocks over {n} rank(s), capacity_factor {cfg.capacity_factor}"


def _model_aux_loss(outputs) -> torch.Tensor:
    if getattr(outputs, "loss", None) is not None:
        raise RuntimeError("the MoE model returned its own loss; hftrain's aux loss would be counted twice")
    aux = getattr(outputs, "aux_loss", None)
    if aux is None or not torch.is_tensor(aux):
        raise RuntimeError("the MoE model returned no aux_loss although config.output_router_logits is set")
    return aux


# ----------------------------------------------------------------------------------------------------------------
# Router statistics (for the health callback)


class RouterStats:
    """Per-layer top-k selection counts and router entropy, accumulated by forward hooks between two logs (on the
    routers' device: no host sync per forward)."""

    def __init__(self, model):
        self.layers = routers(model)
        # ZeRO-3 partitions weights as the model loads (weight.shape is [0]): ds_shape is the real one
        self.num_experts = [int(getattr(r.weight, "ds_shape", r.weight.shape)[0]) for r in self.layers]
        self.device = self.layers[0].weight.device
        self.tap = _MaskTap(model)
        self.reset()
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.layers)]
        self.handles += [b.register_forward_hook(self._dropped_hook) for b in moe_blocks(model)
                         if hasattr(b, "last_dropped")]  # hftrain's expert-parallel / capacity layer

    def reset(self):
        n = len(self.layers)
        self.counts = [torch.zeros(e, dtype=torch.float64, device=self.device) for e in self.num_experts]
        self.sums = torch.zeros(2 * n + 1, dtype=torch.float64, device=self.device)  # entropy, tokens, dropped

    def _hook(self, i):
        n = len(self.layers)

        def hook(module, args, output):
            if not module.training:
                return
            with torch.no_grad():
                logits, indices = output[0], output[2]
                if self.counts[i].device != logits.device:  # moved after construction (Trainer's .to(device))
                    self.device = logits.device
                    self.counts = [c.to(logits.device) for c in self.counts]
                    self.sums = self.sums.to(logits.device)
                mask = self.tap.flat(logits.shape[0])
                w = torch.ones(logits.shape[0], device=logits.device) if mask is None else mask.to(logits.device)
                probs = torch.softmax(logits.float(), dim=-1)
                ent = -(probs * torch.log(probs.clamp(min=1e-20))).sum(-1)
                self.sums[i] += (ent * w).sum().double()
                self.sums[n + i] += w.sum().double()
                self.counts[i].index_add_(0, indices.reshape(-1), w.repeat_interleave(indices.shape[-1]).double())
        return hook

    def _dropped_hook(self, module, args, output):
        if module.training:
            self.sums[-1] += float(module.last_dropped)

    def collect(self) -> dict:
        """Stats since the last call, summed over ranks (every rank logs at the same step)."""
        import torch.distributed as dist

        flat = torch.cat([*self.counts, self.sums])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        flat = flat.cpu()
        n, total = len(self.layers), sum(self.num_experts)
        counts, rest = flat[:total].split(self.num_experts), flat[total:]
        ent, tok, dropped = rest[:n], rest[n:2 * n], float(rest[-1])
        out = {}
        for i, c in enumerate(counts):
            if tok[i] <= 0:
                continue
            load = c / c.sum().clamp(min=1)
            for e, v in enumerate(load.tolist()):
                out[f"moe/layer{i}/load_e{e}"] = v
            out[f"moe/layer{i}/entropy"] = float(ent[i] / tok[i]) / math.log(self.num_experts[i])  # 1 = uniform
            out[f"moe/layer{i}/max_load"] = float(load.max()) * self.num_experts[i]  # 1 = balanced
        if out:
            out["moe/dropped_tokens"] = dropped
        self.reset()
        return out
