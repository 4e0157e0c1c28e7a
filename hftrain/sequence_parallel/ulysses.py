"""Ulysses sequence parallelism (strategy.sequence_parallel: N): every sequence split across N ranks.

DeepSpeed's ALST/Ulysses does the work, enabled through accelerate's `ParallelismConfig(sp_backend="deepspeed")` on
the run's arguments: at `accelerator.prepare` it registers an attention wrapper that exchanges heads for sequence
(all-to-all) around the model's attention kernel, and wraps the train loader so that the N ranks of a group each get
1/N of every batch's tokens, its labels already shifted (`shift_labels`). What hftrain adds, and why by hand:

- `parallelism_config`: the arguments' ParallelismConfig, built from the recipe as the DeepSpeed config is (the
  launcher's config only launches; launch.setup refuses one whose parallelism_config disagrees);
- `ShardableRows`: the train batches Ulysses can split: width a multiple of N, exactly `per_device_train_batch_size`
  rows (its attention checks the shape it registered), right padding, and position_ids in every batch (Ulysses
  masks causally by them: the attention mask is dropped);
- `DocumentAttention`: packed rows attend within each example (Ulysses' kernel call sees the whole sequence, mask
  dropped, so packed examples would attend to each other), and evaluation / generation (where Ulysses is bypassed)
  gets the model's own mask back;
- `ShardedBatches`: DeepSpeed's loader adapter, with `set_epoch` and skipping (resume mid-epoch);
- `full_rows`: a micro-batch's rows gathered whole over the group (sequence averaging needs each sequence's count).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..constants import IGNORE_INDEX
from ..distributed import sequence_parallel_size as size  # noqa: F401 (the package's name for it)
from ..data.collate import PackedRows, right_padded


def parallelism_config(n: int, attn_implementation: str | None):
    """accelerate's ParallelismConfig for Ulysses over groups of `n` ranks (variable sequence lengths)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    return ParallelismConfig(sp_backend="deepspeed", sp_size=n, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True, sp_attn_implementation=attn_implementation or "sdpa"))


def heads_problem(config, n: int) -> str | None:
    """Ulysses gives each rank 1/N of the query heads, and of the key/value heads (or copies of one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads is None:
        return None
    if heads % n:
        return (f"strategy.sequence_parallel: {n} does not divide the model's {heads} attention heads (each rank "
                f"of a group attends with heads / {n} of them); choose a divisor of {heads}")
    if kv % n and n % kv:
        return (f"strategy.sequence_parallel: {n} and the model's {kv} key/value heads must divide one another "
                f"(each rank holds kv_heads / {n} of them, or copies of one); choose another size")
    return None


class ShardableRows:
    """The train collator under sequence parallelism: `packed` rows (PackedRows) or right-padded rows, then padded
    to a width that is a multiple of `multiple` and to exactly `rows` rows (rows without targets), with
    position_ids (`widened`)."""

    def __init__(self, pad_token_id: int | None, multiple: int, rows: int, packed: bool):
        self.pad = pad_token_id if pad_token_id is not None else 0
        self.multiple, self.rows = multiple, rows
        self.packed = PackedRows(self.pad) if packed else None

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if self.packed is not None:
            batch = self.packed(features)
        else:
            batch = self._padded(features)
        width = batch["input_ids"].shape[1]
        return widened(batch, max(-(-width // self.multiple) * self.multiple, self.multiple), self.rows, self.pad)

    def _padded(self, features: list[dict]) -> dict[str, torch.Tensor]:
        """Right-padded rows whatever the tokenizer's padding side (the mask is dropped: real tokens come first)."""
        padded = right_padded([f["input_ids"] for f in features], self.pad,  # data/collate.py
                              labels=[f.get("labels", f["input_ids"]) for f in features])
        width = padded["input_ids"].shape[1]
        return {"input_ids": padded["input_ids"], "labels": padded["labels"],
                "position_ids": torch.arange(width).expand(len(features), width).clone()}


def widened(batch: dict, width: int, rows: int, pad: int) -> dict[str, torch.Tensor]:
    """`batch` (input_ids, labels, position_ids) padded on the right to `width` and below to `rows`: pad ids and
    IGNORE_INDEX labels; a row's positions go on counting (its last sequence gains padding after its tokens, which
    they never attend to), padding rows count from 0."""
    n, w = batch["input_ids"].shape
    extra_cols, extra_rows = width - w, rows - n
    if extra_rows < 0 or extra_cols < 0:
        raise ValueError(f"a batch of {n} x {w} cannot be widened to {rows} x {width}")
    out, on = {}, batch["input_ids"].device
    for key, fill in (("input_ids", pad), ("labels", IGNORE_INDEX)):
        t = torch.nn.functional.pad(batch[key], (0, extra_cols), value=fill)
        out[key] = torch.cat([t, torch.full((extra_rows, width), fill, dtype=t.dtype, device=on)])
    pos = batch["position_ids"]
    pos = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(extra_cols, device=on).expand(n, extra_cols)], dim=1)
    out["position_ids"] = torch.cat([pos, torch.arange(width, device=on).expand(extra_rows, width)])
    return out


def segments(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, stop) runs of consecutive positions: the sequences of a packed row (transformers' rule,
    masking_utils.find_packed_sequence_indices: a new sequence wherever the position does not grow by one)."""
    new = torch.ones_like(position_ids, dtype=torch.bool)
    new[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    out = []
    for row in new:
        starts = torch.nonzero(row).flatten().tolist()
        out.append(list(zip(starts, starts[1:] + [row.numel()])))
    return out


class DocumentAttention:
    """Wraps the attention kernel `impl` of transformers' registry twice around DeepSpeed's Ulysses wrapper.

    `install()` (before `accelerator.prepare`): the kernel Ulysses captures attends within each sequence of a packed
    row, by the whole sequence's position_ids it receives (Ulysses drops the mask; a row of one sequence goes to the
    kernel whole, causally). `dispatch()` (after prepare): training goes through Ulysses, evaluation and generation
    (Ulysses bypassed: accelerate registers it with disable_in_eval, and the loaders there are not split) to the
    kernel with the model's own mask, which Ulysses' wrapper would drop."""

    def __init__(self, impl: str):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.registry, self.impl = ALL_ATTENTION_FUNCTIONS, impl
        self.kernel = ALL_ATTENTION_FUNCTIONS[impl]
        self.ulysses = None

    def install(self) -> None:
        self.registry[self.impl] = self.by_document

    def dispatch_after_prepare(self) -> None:
        self.ulysses = self.registry[self.impl]
        self.registry[self.impl] = self.dispatch

    def uninstall(self) -> None:
        self.registry[self.impl] = self.kernel

    def dispatch(self, module, *args, **kwargs):
        return (self.ulysses if module.training else self.kernel)(module, *args, **kwargs)

    def by_document(self, module, query, key, value, attention_mask, *args, **kwargs):
        pos = kwargs.get("position_ids")
        runs = segments(pos) if pos is not None else None
        if runs is None or all(len(r) == 1 for r in runs):
            return self.kernel(module, query, key, value, attention_mask, *args, **kwargs)
        rows = []
        for r, row in enumerate(runs):
            pieces = []
            for start, stop in row:
                out, _ = self.kernel(module, query[r:r + 1, :, start:stop], key[r:r + 1, :, start:stop],
                                     value[r:r + 1, :, start:stop], None, *args,
                                     **{**kwargs, "position_ids": pos[r:r + 1, start:stop]})
                pieces.append(out)
            rows.append(torch.cat(pieces, dim=1))  # (1, tokens, heads, head_dim)
        return torch.cat(rows, dim=0), None


def group():
    """(process group, this rank's index in it, N) of the sequence-parallel group DeepSpeed built."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu  # optional dependency

    return mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size()


def full_rows(shard: torch.Tensor, device) -> torch.Tensor:
    """The group's (B, L/N) shards of one micro-batch, gathered into the whole (B, L) rows (no gradient)."""
    pg, _, n = group()
    shard = shard.to(device).contiguous()
    parts = [torch.empty_like(shard) for _ in range(n)]
    dist.all_gather(parts, shard, group=pg)
    return torch.cat(parts, dim=1)


def sharded_batches(adapter, pad_token_id: int | None):
    """DeepSpeed's UlyssesSPDataLoaderAdapter as a `ShardedBatches` over the same loader and group."""
    out = _sharded_batches_class()(adapter.dl, sp_rank=adapter.sp_rank, sp_group=adapter.sp_group,
                                   sp_world_size=adapter.sp_world_size, device=adapter.device)
    out.pad = pad_token_id if pad_token_id is not None else 0
    return out


@functools.cache
def _sharded_batches_class():
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter  # optional dependency

    class ShardedBatches(UlyssesSPDataLoaderAdapter):
        """DeepSpeed's adapter (each loader batch of the group's ranks becomes N micro-batches, one shard each) with
        what the Trainer needs of a train loader and it lacks: `set_epoch` (forwarded, so that every epoch, a resumed
        one too, has its own order) and `skip_first_batches(k)` (patches.transformers routes the Trainer's resume skip
        here: accelerate's would build a plain loader from the inner one and drop the adapter). And the group's
        batches are widened to the longest of them before DeepSpeed gathers them: gloo's all_gather takes tensors
        of one size only (DeepSpeed's gather of batches of different lengths fails there)."""

        skipped = None  # the inner loader without its first batches, for the resumed epoch only
        drop = 0  # micro-batches of the next loader batch still to skip
        pad = 0  # the pad token id of the widening

        def set_epoch(self, epoch: int) -> None:
            for loader in (self.dl, self.skipped):
                if hasattr(loader, "set_epoch"):
                    loader.set_epoch(epoch)

        def skip_first_batches(self, k: int):
            """Skip `k` micro-batches of this epoch: k // N whole loader batches (not loaded: accelerate's skip of the
            inner loader), then k % N micro-batches of the next one. Later epochs iterate the inner loader whole."""
            from accelerate import skip_first_batches

            whole, self.drop = divmod(k, self.sp_world_size)
            self.skipped = skip_first_batches(self.dl, whole) if whole else None
            self.iter = iter(self.skipped if whole else self.dl)  # lazy: the Trainer's set_epoch comes first
            self.micro_batches.clear()
            return self

        def refill(self):
            try:
                batch = next(self.iter)
            except StopIteration:
                self.iter = iter(self.dl)  # the next epoch iterates the whole loader
                raise
            mine = torch.tensor([batch["input_ids"].shape[1]], dtype=torch.long, device=self.device)
            widths = [torch.zeros_like(mine) for _ in range(self.sp_world_size)]
            dist.all_gather(widths, mine, group=self.sp_group)
            batch = widened(batch, int(max(widths)), batch["input_ids"].shape[0], self.pad)
            rest, self.iter = self.iter, iter([batch])
            try:
                super().refill()  # gathers the group's batches and keeps this rank's slice of each
            finally:
                self.iter = rest
            while self.drop and self.micro_batches:
                self.micro_batches.popleft()
                self.drop -= 1

    return ShardedBatches
