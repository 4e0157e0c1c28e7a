"""Gradient compression on the data-parallel gradient reduction, and what it costs and saves.

DDP: a communication hook (fp16 and PowerSGD are PyTorch's; bf16, int8 and top-k are written here because PyTorch's
refuse gloo or lack error feedback). FSDP2 and ZeRO: fp16/bf16 as their reduce dtype (config.rules refuses the rest).
Each hook here issues one collective, from the hook itself (one issued from a future callback can race DDP's own),
and returns the MEAN gradient, which hftrain's loss normalisation (losses/maths.py) assumes.

Bytes on the wire per rank (ring): all-reduce of B bytes 2(W-1)/W * B, all-gather of B bytes per rank (W-1) * B.
int8 and top-k are all-gathered (their sum has no compressed form), so their saving shrinks as W grows.

The package: codecs.py (int8, top-k, wire bytes), meter.py (bytes and overlap), hooks.py (the DDP hooks and their
wiring), metrics.py (comm/* logs), mixin.py (the trainer's: registers the hook, sets FSDP's reduce dtype, logs).
"""

from .codecs import dequantize_int8, quantize_int8, topk_select, wire_bytes
from .hooks import HookState, ddp_hook, ddp_kwargs_with_hook, fsdp_reduce_dtype, int8_hook, make_hook_state, topk_hook
from .meter import CommMeter, length, merge, minus
from .metrics import CommMetricsCallback
from .mixin import CommHookMixin

__all__ = ["CommHookMixin", "CommMeter", "CommMetricsCallback", "HookState", "ddp_hook", "ddp_kwargs_with_hook",
           "dequantize_int8", "fsdp_reduce_dtype", "int8_hook", "length", "make_hook_state", "merge", "minus",
           "quantize_int8", "topk_hook", "topk_select", "wire_bytes"]
