"""The parameters of a LLaVA model that no forward reaches, frozen so that DDP can train it.

LLaVA feeds the projector the vision tower's hidden states of `vision_feature_layer` (an index into the encoder's
hidden states, or a list of them), never the tower's final output: the tower's post_layernorm (and a SigLIP tower's
pooling head) and every encoder layer after the deepest feature layer (llava-1.5: the last one, at -2) get no
gradient. DDP, which hftrain runs with find_unused_parameters false (training.ddp_find_unused_parameters), then
stops at the second step waiting for their gradients. Freezing them changes nothing in training (a parameter without
a gradient is skipped by the optimizer: weight decay included) and lets DDP run; tests/test_vision_exact.py checks the
set frozen is exactly the set without a gradient after a backward, and the 2-rank runs."""

from __future__ import annotations

LLAVAS = ("llava", "llava_next")  # the families whose projector reads a hidden layer of the vision tower


def unreached_vision_parameters(model) -> list[str]:
    """Names (in `model`) of the LLaVA (or LLaVA-NeXT) vision tower's parameters the projector's input does not
    depend on; [] for another family."""
    owner = next((m for m in model.modules() if getattr(getattr(m, "config", None), "model_type", None) in LLAVAS
                  and hasattr(m, "vision_tower")), None)
    if owner is None:
        return []
    tower = owner.vision_tower
    inner = getattr(tower, "vision_model", tower)
    layers = len(inner.encoder.layers)
    chosen = owner.config.vision_feature_layer
    deepest = max(k % (layers + 1) for k in (chosen if isinstance(chosen, (list, tuple)) else [chosen]))
    unreached = [m for name in ("post_layernorm", "head") if (m := getattr(inner, name, None)) is not None]
    unreached += list(inner.encoder.layers[deepest:])
    ids = {id(p) for m in unreached for p in m.parameters()}
    return sorted(name for name, p in model.named_parameters() if id(p) in ids)


def freeze_unreached(model) -> list[str]:
    """Freeze unreached_vision_parameters(model); returns their names."""
    names = set(unreached_vision_parameters(model))
    for name, p in model.named_parameters():
        if name in names:
            p.requires_grad_(False)
    return sorted(names)
