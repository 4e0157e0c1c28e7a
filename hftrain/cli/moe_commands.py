"""`hftrain moe`: mixture-of-experts tools (`moe upcycle`: a dense model's MLPs into experts and a router)."""

from __future__ import annotations

from ..moe.upcycle import upcycle_folder


def _moe_upcycle(ns) -> int:
    out = upcycle_folder(ns.model, ns.output, ns.num_experts, ns.top_k, ns.layers, ns.router_init_std, ns.seed)
    print(f"hftrain: upcycled {ns.model} to {ns.num_experts} experts (top-{ns.top_k}) in {out}")
    return 0


def add_moe_command(sub) -> None:
    mo = sub.add_parser("moe", allow_abbrev=False, help="Mixture-of-experts tools.")
    up = mo.add_subparsers(dest="moe_command", required=True).add_parser(
        "upcycle", allow_abbrev=False,
        help="Dense Llama/Mistral -> Mixtral, Qwen2 -> Qwen2-MoE, Qwen3 -> Qwen3-MoE: each chosen MLP becomes E "
        "copies + a router; outputs unchanged; saved as the native transformers class (loads with transformers' Auto "
        "class alone).")
    up.add_argument("--model", required=True, help="dense model folder (safetensors)")
    up.add_argument("--num-experts", dest="num_experts", type=int, required=True)
    up.add_argument("--top-k", dest="top_k", type=int, required=True)
    up.add_argument("--layers", type=int, nargs="+", default=None, help="layer indices to upcycle (default: all)")
    up.add_argument("--router-init-std", dest="router_init_std", type=float, default=None)
    up.add_argument("--seed", type=int, default=0, help="seed of the routers' random init")
    up.add_argument("--output", required=True, help="folder to write the MoE model (and the tokenizer) to")
    up.set_defaults(fn=_moe_upcycle)
