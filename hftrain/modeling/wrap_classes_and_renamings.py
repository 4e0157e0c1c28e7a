"""Two lists transformers attaches to a loaded model, set right for the sharded strategies: the layer classes FSDP2
wraps, and the key renamings a save reverts.

- `_no_split_modules`: transformers 5 gathers it from every sub-model's class (PreTrainedModel.post_init), and
  accelerate's FSDP2 wrap policy (fsdp2_prepare_auto_wrap_policy) refuses a name the model does not contain. A
  composite model can name classes it lacks: LLaVA's CLIP vision tower brings CLIPPreTrainedModel's list, which names
  CLIPTextEmbeddings, and FSDP2 stopped at prepare. Only the classes the model holds are kept (by what the model
  contains, not by family): the wrapping of those it holds is unchanged.
- `_weight_conversions`: the key renamings from_pretrained applied (a checkpoint's original names to the current
  module paths), reverted by save_pretrained to write the original names back. The ordinary load keeps the renamings
  that matched a checkpoint key (core_model_loading.convert_and_load_state_dict_in_model: `was_used()`); the ZeRO-3
  load (integrations.deepspeed._load_state_dict_into_zero3_model) keeps them all, so the save reverted renamings that
  never applied (Qwen2.5-VL's and LLaVA's legacy `model.language_model.model` one among them) and wrote keys such as
  `model.model.layers...`, a folder that did not load as trained. Keeping the used ones, as the ordinary load does,
  makes the ZeRO-3 save equal the one-rank save."""

from __future__ import annotations


def keep_present_no_split_modules(model) -> None:
    """`model._no_split_modules` restricted to the classes the model contains (nothing to do when it names none)."""
    named = model._no_split_modules
    if not named:
        return
    present = {type(m).__name__ for m in model.modules()}
    kept = [name for name in named if name in present]
    if len(kept) != len(named):
        model._no_split_modules = type(named)(kept) if isinstance(named, (set, list, tuple)) else kept


def keep_used_weight_conversions(model) -> None:
    """`model._weight_conversions` restricted to the renamings that matched a checkpoint key while it loaded."""
    conversions = getattr(model, "_weight_conversions", None)  # only on a model loaded by from_pretrained
    if conversions:
        model._weight_conversions = [c for c in conversions if c.was_used()]
