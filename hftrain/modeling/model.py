"""The model (loaded by the Auto class of its head, heads.Head): dtype, attention kernel, a quantised base
(quantization/), liger's kernels, MoE upcycling, LoRA through peft, and packed rows joined into one for flash
kernels."""

from __future__ import annotations

import torch

from ..config import ModelSection
from ..errors import ModelError
from ..heads import Head
from ..kernels import apply_liger, liger_problem, uses_liger
from ..mesh import tensor_parallel_config
from ..moe.upcycle import upcycle
from ..quantization import (bitsandbytes_problem, bnb_config, keep_training_kernels, placement, prepare_for_training,
                            record_fingerprint)
from .before_loading import path_problems
from .wrap_classes_and_renamings import keep_present_no_split_modules, keep_used_weight_conversions
from .lora import lora_config
from .paths import (raise_if, resolved_name_or_path,
                    warn_remote_code)
from .tokenizer import load_tokenizer


def reads_packing_from_one_row(attn_implementation: str | None) -> bool:
    """Flash-attention kernels (flash_attention_2/3, kernels-community/flash-attn*) find packed sequences from
    position_ids only in a batch of one row (transformers' _is_packed_sequence); in several rows they would attend
    across the examples of a row."""
    return "flash" in (attn_implementation or "")


def join_packed_rows(model) -> None:
    """Hooks on `model`: a packed batch of several rows (hftrain's packing collator) goes through the model as one
    row (the rows end to end; each row's padding is a sequence of its own), its logits come back in rows. Exact:
    packed sequences never attend to each other."""
    shapes: list[torch.Size] = []

    def before(module, args, kwargs):
        ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
        if args or ids is None or pos is None or ids.shape[0] == 1 or kwargs.get("attention_mask") is not None:
            shapes.append(None)
            return None
        shapes.append(ids.shape)
        return args, {**kwargs, "input_ids": ids.reshape(1, -1), "position_ids": pos.reshape(1, -1)}

    def after(module, args, kwargs, output):
        shape = shapes.pop()
        if shape is not None and getattr(output, "logits", None) is not None:
            output.logits = output.logits.reshape(*shape, -1)
        return output

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)


def score_pad_token(model, cfg: ModelSection, key: str = "model") -> None:
    """A sequence classifier reads its score at the last token that is not config.pad_token_id: without one it
    refuses batches of several rows, and with a pad id other than the tokenizer's it scores a padding position. The
    model's pad id is set here from the run's tokenizer (load_tokenizer: its pad token, else its EOS or UNK, said
    so); where the tokenizer has none to take, the data phase refuses the run (the method's read)."""
    tokenizer = load_tokenizer(cfg, say_padding=key)
    if tokenizer.pad_token_id is not None:
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        model.config.pad_token_id = tokenizer.pad_token_id


def load_base(cfg: ModelSection, quantized: bool, head: Head = Head.CAUSAL_LM, key: str = "model",
              num_labels: int | None = None, tensor_parallel: int = 1):
    """The base of `cfg` as transformers loads it by the Auto class of its `head` (safetensors only: a pickle
    checkpoint could run code on load), quantised by bitsandbytes when asked (placed whole on this rank's device, as
    accelerate requires), split over `tensor_parallel` ranks by the family's tp_plan (transformers' own sharding at
    load time: the Trainer then builds accelerate's mesh from the model). `key`: where `cfg` sits in the recipe."""
    for _, problem in path_problems(cfg, key=key):
        raise_if(problem)
    warn_remote_code(cfg, cfg.name_or_path)
    dtype = "auto" if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    kwargs = {"dtype": dtype, "revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if num_labels is not None:  # the method's classes (a reward model's one score)
        kwargs["num_labels"] = num_labels
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.experts_implementation:
        kwargs["experts_implementation"] = cfg.experts_implementation
    if quantized:
        raise_if(bitsandbytes_problem())
        kwargs.update(quantization_config=bnb_config(cfg), **placement())
    if tensor_parallel > 1:
        kwargs["distributed_config"] = tensor_parallel_config(tensor_parallel)
    try:
        model = head.auto_class.from_pretrained(resolved_name_or_path(cfg.name_or_path), use_safetensors=True, **kwargs)
    except (OSError, ValueError, KeyError) as e:  # a missing file, an unknown architecture, a broken header
        raise ModelError(f"{key}.name_or_path: cannot load {cfg.name_or_path} ({type(e).__name__}: {str(e)[:300]}); "
                         "check the folder (config.json and the weights) or save it again") from None
    keep_present_no_split_modules(model)  # FSDP2's wrap policy refuses a class the model lacks
    keep_used_weight_conversions(model)  # a ZeRO-3 load kept them all: its save wrote doubled prefixes
    if head.scores_last_token:
        score_pad_token(model, cfg, key)
    return keep_training_kernels(model) if quantized else model


def load_model(cfg: ModelSection, packing: bool = False, moe=None, sequence_parallel: int = 1,
               head: Head = Head.CAUSAL_LM, key: str = "model", num_labels: int | None = None,
               tensor_parallel: int = 1):
    """The model of `cfg` with its `head` (the method declares it: methods.Method.models), quantised (QLoRA's base)
    or upcycled to MoE, with liger's kernels, with LoRA. `sequence_parallel` > 1: packed rows are split by
    sequence_parallel.DocumentAttention, never joined into one row (Ulysses checks the rows it registered). `key`:
    where `cfg` sits in the recipe (model, or a method's other model: ModelSpec.key), for the messages; `num_labels`:
    a classifier's classes where the method fixes them (a reward model's one score)."""
    model = load_base(cfg, quantized=cfg.quantization is not None, head=head, key=key, num_labels=num_labels,
                      tensor_parallel=tensor_parallel)
    if cfg.kernels == "liger":
        raise_if(liger_problem(model.config.model_type))
    if uses_liger(cfg.kernels, model.config.model_type, quantized=cfg.quantization is not None):
        apply_liger(model)
    if cfg.quantization is not None:
        model = prepare_for_training(record_fingerprint(model))  # the packed base trained against, for the merge
    if moe is not None and moe.upcycle is not None:  # dense -> native MoE, equal outputs (hftrain.moe.upcycle)
        u = moe.upcycle
        model = upcycle(model, u.num_experts, u.top_k, u.layers, u.router_init_std)
    if packing:
        # transformers 5 builds the block-diagonal mask of packed rows from position_ids only when no KV cache is
        # passed, and with config.use_cache=True the forward creates one even in training: packed examples would
        # attend to each other. Training never needs the cache (generate() turns it back on for itself).
        model.config.use_cache = False
    if cfg.lora is not None:
        from peft import get_peft_model  # optional dependency, heavy to import: LoRA runs only

        model = get_peft_model(model, lora_config(cfg, head))
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()
    if packing and sequence_parallel == 1 and reads_packing_from_one_row(model.config._attn_implementation):
        join_packed_rows(model)  # on the outermost model: peft calls the base model's forward() without hooks
    return model
