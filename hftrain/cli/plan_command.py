"""`hftrain plan`: memory per GPU and node for every strategy, what fits, and a recommendation."""

from __future__ import annotations

from ..launch.mesh_plan import mesh_rows, refused_meshes
from ..launch.plan import GiB, format_plan, kernels_here, recipe_plan, refused_strategies
from ..methods import load_recipe
from .arguments import recipe_arguments


def _plan(ns) -> int:
    recipe = load_recipe(ns.recipe, ns.overrides)
    m, micro = recipe.model, recipe.typed_training.per_device_train_batch_size
    planned = recipe_plan(recipe, ns.gpus_per_node, ns.nodes)
    facts, rows, sp = planned.facts, planned.rows, recipe.strategy.resolved_sequence_parallel()
    active = f" ({facts.active_params / 1e6:.1f}M active per token)" if facts.active_params != facts.params else ""
    print(f"{m.name_or_path}: {facts.params / 1e6:.1f}M parameters{active}, {facts.trainable / 1e6:.1f}M trained; "
          f"{ns.gpus_per_node} GPU(s) x {ns.nodes} node(s); micro-batch {micro} x {recipe.data.max_length} tokens"
          + (f", each sequence split across {sp} GPUs" if sp > 1 else "")
          + "".join(f"; {o.role.value} ({o.key}) {o.section.name_or_path}: {x.params / 1e6:.1f}M parameters, frozen"
                    + (", whole on every GPU" if o.whole else "") for o, x in planned.frozen))
    t = recipe.typed_training
    meshes = mesh_rows(facts, ns.gpus_per_node, ns.nodes, micro, recipe.data.max_length, m.gradient_checkpointing,
                       bool(t.bf16 or t.fp16), [f for spec, f in planned.frozen])
    refused = {**refused_strategies(recipe), **refused_meshes(recipe, meshes, ns.gpus_per_node, ns.nodes)}
    print(format_plan(rows + meshes, ns.gpu_memory * GiB if ns.gpu_memory else None, sp, refused),
          kernels_here(m, facts), sep="\n")
    return 0


def add_plan_command(sub) -> None:
    pl = sub.add_parser("plan", allow_abbrev=False,
                        help="Memory per GPU / node for every strategy, what fits, and a recommendation.")
    recipe_arguments(pl)
    pl.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=8)
    pl.add_argument("--nodes", type=int, default=1)
    pl.add_argument("--gpu-memory", dest="gpu_memory", type=float, default=None, help="GiB per GPU")
    pl.set_defaults(fn=_plan)
