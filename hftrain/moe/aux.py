"""The router losses: the model's own load-balancing loss (read from its outputs) and the z-loss, both computed
over real tokens only. The trainer scales them (losses.aux_loss_term), so they are exact over ranks and accumulation.
"""

from __future__ import annotations

import torch


class MaskTap:
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


def expert_loads(indices: torch.Tensor, flat_mask: torch.Tensor | None, experts: int) -> torch.Tensor:
    """Tokens routed to each expert (float64, [experts]) from a router's top-k indices [tokens, k], real tokens only
    (`flat_mask`: MaskTap.flat; None: every token counts). Router health and the bias balancing count with it."""
    weight = (torch.ones(indices.shape[0], dtype=torch.float64, device=indices.device) if flat_mask is None
              else flat_mask.to(indices.device, torch.float64))
    loads = torch.zeros(experts, dtype=torch.float64, device=indices.device)
    return loads.index_add_(0, indices.reshape(-1), weight.repeat_interleave(indices.shape[-1]))


def z_loss(router_logits: tuple[torch.Tensor, ...], flat_mask: torch.Tensor | None) -> torch.Tensor:
    """Router z-loss (Zoph et al. 2022, ST-MoE): mean over layers and real tokens of logsumexp(router logits)^2.
    Hand-written because transformers' `router_z_loss_func` (switch_transformers) takes no padding mask."""
    per_layer = []
    for logits in router_logits:
        z = torch.logsumexp(logits.float(), dim=-1).pow(2)
        per_layer.append(z.mean() if flat_mask is None else (z * flat_mask).sum() / flat_mask.sum().clamp(min=1))
    return torch.stack(per_layer).mean()


def model_aux_loss(outputs) -> torch.Tensor:
    if getattr(outputs, "loss", None) is not None:
        raise RuntimeError("the MoE model returned its own loss; hftrain's aux loss would be counted twice")
    aux = getattr(outputs, "aux_loss", None)
    if aux is None or not torch.is_tensor(aux):
        raise RuntimeError("the MoE model returned no aux_loss although config.output_router_logits is set")
    return aux
