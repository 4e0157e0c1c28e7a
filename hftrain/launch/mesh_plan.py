"""The memory plan's rows for meshes past data parallelism (launch/plan.py's accounting, per GPU):

    hsdp R x S   R replicas (one per node) of the model sharded over the S GPUs of a node: (P + G + O) / S, the
                 largest layer gathered; activations as fsdp's
    tp N         every layer split over the N GPUs (strategy.tp_size under ddp: the whole world): (P + G + O) / N;
                 per layer s·b·h·(10 + 24/N) bytes of activations in 16-bit (Korthikanti et al. 2022, tensor
                 parallelism without sequence parallelism: layer norms, dropout and the attention's and MLP's inputs
                 stay whole on every rank), the logits whole (lm_head's output gathered)

Each row says whether the recipe could run on that mesh (strategy_problems of the recipe moved onto it)."""

from __future__ import annotations

import dataclasses

from ..config.strategy import MESH_OPTIONS
from ..config.strategy_rules import strategy_problems
from ..mesh import tensor_parallel_problem
from ..methods import Recipe
from .plan import ModelFacts, Row, activation_bytes, frozen_bytes, state_bytes
from .strategy_checks import config_problem


def tensor_parallel_activation_bytes(f: ModelFacts, micro_batch: int, seq: int, checkpointing: bool, n: int) -> float:
    """activation_bytes with each layer's 24·s·b·h of split activations over `n` ranks (the logits kept whole)."""
    whole = activation_bytes(f, micro_batch, seq, checkpointing)
    sbh = seq * micro_batch * f.hidden
    if checkpointing:  # the saved layer inputs stay whole; the one layer recomputed is split
        return whole - 34 * sbh + (10 + 24 / n) * sbh
    return whole - f.layers * 24 * sbh * (1 - 1 / n)


def mesh_rows(f: ModelFacts, gpus_per_node: int, nodes: int, micro_batch: int, seq: int, checkpointing: bool,
              mixed: bool, frozen: list[ModelFacts] = ()) -> list[Row]:
    """hsdp (several nodes only: one replica per node) and tp over every GPU, as the module docstring counts."""
    n = gpus_per_node * nodes
    P, G, Opt = state_bytes("fsdp", f, mixed)
    P += frozen_bytes(frozen)
    rows = []
    if nodes > 1:
        shard = gpus_per_node
        rows.append(Row(f"hsdp {nodes}x{shard}", P / shard + 4 * f.largest_layer, G / shard, Opt / shard,
                        activation_bytes(f, micro_batch, seq, checkpointing), 0.0, 0.0))
    rows.append(Row(f"tp {n}", P / n, G / n, Opt / n,
                    tensor_parallel_activation_bytes(f, micro_batch, seq, checkpointing, n), 0.0, 0.0))
    return rows


def refused_meshes(recipe: Recipe, rows: list[Row], gpus_per_node: int, nodes: int) -> dict[str, tuple[str, str]]:
    """{row: (key, why)} for the mesh rows `hftrain check` would refuse for this recipe (its method, its model's
    options), the recipe's own strategy options left out."""
    n = gpus_per_node * nodes
    meshes = {f"hsdp {nodes}x{gpus_per_node}": ("fsdp", {"dp_replicate_size": nodes}),
              f"tp {n}": ("ddp", {"tp_size": n})}
    refused = {}
    for row in rows:
        name, options = meshes[row.strategy]
        strategy = dataclasses.replace(recipe.strategy, name=name, num_processes=n, **{
            k: options.get(k) for k in MESH_OPTIONS})
        weights_only = {"save_only_model": True} if name == "ddp" else {}  # what tensor parallelism needs
        moved = dataclasses.replace(recipe, strategy=strategy, training={**recipe.training, **weights_only})
        problems = [(k, m) for k, m in strategy_problems(moved, name)
                    if not k.startswith("strategy.") or k.split(".", 1)[1] in MESH_OPTIONS]
        m = recipe.model
        split = (config_problem(m.name_or_path, m.trust_remote_code, tensor_parallel_problem, n)
                 if name == "ddp" else None)
        if problems or split:
            refused[row.strategy] = problems[0] if problems else ("strategy.tp_size", split.split(": ", 1)[1])
    return refused
