"""Packed image rows: several examples (their images of any sizes) in one row, none attending to another, each with
its own positions, so that the packed loss is the padded loss (tests/test_vision_packing.py).

The batch is the text packing's (data/collate.py: whole examples per row, position_ids restarting at 0 for each,
the first label of each example untrained, no attention_mask) plus the images of every row in the order their tokens
appear, and Qwen-VL's mm_token_type_ids. The losses read those 2-D position ids (the examples of a row) as for text.
The model needs more (transformers 5, checked on sdpa and eager):
- Qwen-VL's rotary positions are mrope (temporal, height, width per image token): position ids of shape [4, B, L],
  the text row (the restarting positions: transformers builds the block-diagonal mask from it) and the three mrope
  rows, restarted per example. Each example's mrope rows are the model's own get_rope_index on that example alone
  (its tokens, token types and image grids), concatenated along the row; nothing here re-derives them. 2-D position
  ids (the model copies them into the three rows), no position ids, or one get_rope_index over the whole row are
  silently wrong;
- no KV cache: with a cache the mask is not built from the position ids and the examples of a row attend to each
  other. A VLM's language model reads use_cache from its text config (model.config.use_cache does not reach it), so
  the packed batch's forward is given use_cache=False.
Hooks, not the collator: get_rope_index is a method of the loaded model (its config's merge size), and the batch the
losses count must keep its 2-D position ids.
"""

from __future__ import annotations

import torch

from ..data.collate import packed_tokens
from .image_batches import ImageRows
from .images import open_rgb


class PackedImageRows:
    """The collator of packed image rows (labels.py: input_ids, labels, images). `padded`: the padded collator of the
    same rows, for eval batches (one row per example: losses.ExactLossMixin.get_eval_dataloader)."""

    def __init__(self, processor):
        self.padded = ImageRows(processor)
        self.processor = processor

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        self.padded.check(features)
        batch, rows = packed_tokens(features, self.padded.pad_token_id)  # data/collate.py: the packing loop
        # the images in the order of their tokens, row by row
        images = [open_rgb(path) for members in rows for i in members for path in features[i]["images"]]
        input_ids = batch["input_ids"]
        if images:
            batch.update(self.processor.image_processor(images=images, return_tensors="pt"))
        if self.padded.token_types:
            batch[self.padded.token_types] = (input_ids == self.padded.image_token_id).long()
        return batch


def _is_packed(kwargs: dict) -> bool:
    """A packed batch (PackedImageRows, maybe joined into one row by modeling.join_packed_rows): position ids of
    one row per sequence and no attention mask (generate() and padded batches pass an attention mask)."""
    pos = kwargs.get("position_ids")
    return pos is not None and pos.dim() == 2 and kwargs.get("attention_mask") is None


def example_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, stop) of each sequence: a sequence starts where its position is 0."""
    out = []
    for row in position_ids.tolist():
        starts = [k for k, p in enumerate(row) if p == 0] + [len(row)]
        out.append(list(zip(starts[:-1], starts[1:])))
    return out


def restarted_mrope(model, input_ids, position_ids, token_types, image_grid_thw) -> torch.Tensor:
    """[4, B, L]: the text row (`position_ids`) and the three mrope rows of each example by the model's own
    get_rope_index on that example alone, concatenated along the row (its images' grids taken in order)."""
    rows = torch.zeros((3, *input_ids.shape), dtype=torch.long, device=input_ids.device)
    grid_at = 0
    for r, spans in enumerate(example_spans(position_ids)):
        for start, stop in spans:
            types = token_types[r:r + 1, start:stop]
            images = int(((types[:, 1:] != types[:, :-1]) & (types[:, 1:] == 1)).sum() + (types[:, 0] == 1).sum())
            grids = image_grid_thw[grid_at:grid_at + images] if images else None
            rows[:, r:r + 1, start:stop] = model.get_rope_index(input_ids[r:r + 1, start:stop], types,
                                                                image_grid_thw=grids)[0]
            grid_at += images
    return torch.cat([position_ids.unsqueeze(0).to(rows.device), rows])


def positions_hook(model):
    """The pre-hook of `model` (the module owning get_rope_index, or the whole model for a family without mrope)."""
    mrope = hasattr(model, "get_rope_index")

    def before(module, args, kwargs):
        if args or not _is_packed(kwargs):
            return None
        kwargs = {**kwargs, "use_cache": False}
        types = kwargs.get("mm_token_type_ids")
        if mrope and types is None:
            raise ValueError("a packed batch of a model with mrope positions (Qwen-VL) needs mm_token_type_ids (1 at "
                             "image tokens) to restart each example's positions; the batch has none")
        if mrope:
            ids = kwargs["input_ids"]
            types = types.reshape(ids.shape)  # join_packed_rows reshapes ids and positions only
            kwargs["mm_token_type_ids"] = types
            kwargs["position_ids"] = restarted_mrope(module, ids, kwargs["position_ids"], types,
                                                     kwargs.get("image_grid_thw"))
        return args, kwargs

    return before


def pack_image_rows(model) -> None:
    """Hooks on `model` (loaded for training with packed image rows): each packed batch's forward without a cache,
    and, for a family with mrope (Qwen-VL), with each example's positions restarted (restarted_mrope)."""
    owner = next((m for m in model.modules() if hasattr(type(m), "get_rope_index")), None)
    target = owner if owner is not None else model
    target.register_forward_pre_hook(positions_hook(target), with_kwargs=True)
