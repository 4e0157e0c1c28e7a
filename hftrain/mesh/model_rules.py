"""What a model's config says of tensor parallelism (strategy.tp_size): a family with a tensor-parallel plan, and
attention heads the degree divides (each rank computes heads / tp_size of them, and as many key/value heads)."""

from __future__ import annotations


def tensor_parallel_problem(config, size: int) -> str | None:
    """Why `config`'s model cannot be split over `size` ranks (None when it can)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "base_model_tp_plan", None):
        return (f"strategy.tp_size: the model's family ({getattr(text, 'model_type', '?')}) has no tensor-parallel "
                "plan in transformers (its config's base_model_tp_plan is empty); remove strategy.tp_size, or shard "
                "it with strategy.name: fsdp")
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    for count, what in ((heads, "attention heads"), (kv, "key/value heads")):
        if count is not None and count % size:
            return (f"strategy.tp_size: {size} does not divide the model's {count} {what} (each rank computes "
                    f"{what} / {size} of them); choose a divisor of {count}")
    return None
