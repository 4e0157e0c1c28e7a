"""Strategies: the recipe's `strategy:` section rendered into an accelerate config and a DeepSpeed config.

Everything TrainingArguments owns (batch sizes, accumulation, learning rate, clipping, bf16/fp16) is "auto" in the
DeepSpeed config, so the two never disagree. `accelerate_configs/` is this module's output (`hftrain config --all
--output accelerate_configs`); a test regenerates it.
"""

from __future__ import annotations

import json
import os
import tempfile

import yaml

from .. import outdir
from ..config import StrategySection, resolved_strategy
from ..config.strategy import DEFAULT_PORT
from ..constants import OFFLOADED, ZERO_STAGE
from ..fileio import atomic_write


def optimizer_swap_buffers(buffer_count: int) -> int:
    """ZeRO-Infinity's optimizer swap buffers: DeepSpeed's pipelined optimizer swapper needs at least 4."""
    return max(4, buffer_count)


def deepspeed_config(s: StrategySection, communication_data_type: str | None = None) -> dict | None:
    """The DeepSpeed JSON for a ZeRO strategy (None for ddp/fsdp); `communication_data_type` (fp16/bf16) is
    gradient compression's reduction dtype (CompressionSection.reduce_dtype)."""
    if s.name not in ZERO_STAGE:
        return None
    s = resolved_strategy(s)
    stage = ZERO_STAGE[s.name]
    zero: dict = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
                "stage3_max_live_parameters": 1_000_000_000,
                "stage3_max_reuse_distance": 1_000_000_000,
                "sub_group_size": 1_000_000_000,
                # Without it save_model() writes only shards and from_pretrained fails on the output.
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    else:
        zero.update({"allgather_partitions": True, "allgather_bucket_size": 200_000_000, "reduce_scatter": True})
    cfg: dict = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if communication_data_type is not None:
        cfg["communication_data_type"] = communication_data_type
    if s.name == "zero3_offload":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": s.pin_memory}
        zero["offload_param"] = {"device": "cpu", "pin_memory": s.pin_memory}
    if s.name == "zero_infinity":
        swap = {"device": "nvme", "nvme_path": s.nvme_path, "pin_memory": s.pin_memory,
                "buffer_count": s.buffer_count}
        zero["offload_param"] = {**swap, "buffer_size": s.buffer_size, "max_in_cpu": 0}
        zero["offload_optimizer"] = {**swap, "buffer_count": optimizer_swap_buffers(s.buffer_count), "fast_init": False}
        # The optimizer's swap buffers each hold one sub-group: 1e9 elements pins GBs of RAM per rank.
        zero["sub_group_size"] = s.sub_group_size
        # With NVMe params, a non-zero prefetch bucket fails "param N already assigned swap buffer id".
        zero["stage3_prefetch_bucket_size"] = 0
        # Parameters kept for reuse hold their swap buffer, and once buffer_count of them are held the next fetch
        # fails "Not enough swap in buffers"; release each parameter after use instead.
        zero["stage3_max_reuse_distance"] = 0
        # aio is a TOP-LEVEL key, not part of zero_optimization.
        cfg["aio"] = {"block_size": s.aio_block_size, "queue_depth": s.aio_queue_depth, "thread_count": 1,
                      "single_submit": False, "overlap_events": True}
    if s.name in OFFLOADED:
        # Offloaded optimizer states need DeepSpeed's own (CPU) Adam; lr/betas/eps/decay still come from
        # TrainingArguments through "auto".
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}
    return cfg


def accelerate_config(s: StrategySection, deepspeed_file: str | None = None, mixed_precision: str = "no") -> dict:
    """The accelerate launcher config. `deepspeed_file` is where the DeepSpeed JSON lies (ZeRO strategies)."""
    s = resolved_strategy(s)
    cfg: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "MULTI_GPU",
        "downcast_bf16": "no",
        "machine_rank": s.machine_rank,
        "main_training_function": "main",
        "mixed_precision": mixed_precision,
        "num_machines": s.num_machines,
        "num_processes": s.num_processes,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if s.num_machines > 1 or s.main_process_ip:
        cfg["main_process_ip"] = s.main_process_ip or "MAIN_NODE_ADDRESS"
    if s.main_process_port != DEFAULT_PORT or s.num_machines > 1:
        cfg["main_process_port"] = s.main_process_port
    if s.name == "ddp":
        cfg["gpu_ids"] = "all"
    elif s.name == "fsdp":
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            # No class named: accelerate wraps the model's own `_no_split_modules` (its decoder layers).
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": s.fsdp_reshard_after_forward,
            "fsdp_offload_params": s.fsdp_offload_params,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": False,
        }
        if s.fsdp_wrap_class:
            cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = s.fsdp_wrap_class
        if s.mesh().beyond_sharding:
            cfg["parallelism_config"] = parallelism_config_section(s)
    else:
        cfg["distributed_type"] = "DEEPSPEED"
        # DeepSpeed takes precision from its JSON ("auto" = TrainingArguments); accelerate refuses the key here.
        del cfg["mixed_precision"]
        cfg["deepspeed_config"] = {"deepspeed_config_file": deepspeed_file or f"{s.name}.json",
                                   "zero3_init_flag": ZERO_STAGE[s.name] == 3}
        # Always, also in a 1-machine config (accelerate reads it only with num_machines > 1): the shipped config
        # launched with `--num_machines 2 ...` flags must not fall back to DeepSpeed's pdsh runner, which needs pdsh
        # and a hostfile, and without a hostfile starts a 1-machine job on each node.
        cfg["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    return cfg


def parallelism_config_section(s: StrategySection) -> dict:
    """The mesh's degrees as accelerate's config file spells them (its launcher exports them as PARALLELISM_CONFIG_*
    to every rank, and the Accelerator builds its ParallelismConfig and device mesh from them)."""
    mesh = s.mesh()
    return {"parallelism_config_dp_replicate_size": mesh.replicate, "parallelism_config_dp_shard_size": mesh.shard,
            "parallelism_config_tp_size": mesh.tensor, "parallelism_config_cp_size": mesh.context}


def mixed_precision_of(training: dict | None) -> str:
    training = training or {}
    return "bf16" if training.get("bf16") else "fp16" if training.get("fp16") else "no"


HEADER = (
    "# Generated by `hftrain config` from strategy '{name}'. Do not edit: change the recipe's strategy section\n"
    "# (or hftrain/launch/strategies.py) and regenerate. Launch:\n"
    "#   accelerate launch --config_file {path} recipes/sft.py <recipe.yaml>\n"
)


MACHINES = (
    "# {n} machines: this file is machine {k}'s. On machine K (0 .. {last}) run the same with `--machine_rank K`, or\n"
    "#   hftrain launch <recipe.yaml> --machine-rank K    (renders its own config, in a private temporary folder)\n"
)


def render(s: StrategySection, out_dir: str, training: dict | None = None, json_dir: str | None = None,
           communication_data_type: str | None = None) -> list[str]:
    """Write `<name>.yaml` (and `<name>.json` for ZeRO) into out_dir; return the paths written.

    The YAML refers to the JSON as `json_dir/<name>.json` (default: out_dir), the path seen from where you launch.
    """
    json_dir = json_dir if json_dir is not None else out_dir
    os.makedirs(out_dir, exist_ok=True)
    written = []
    ds = deepspeed_config(s, communication_data_type)
    json_ref = None
    if ds is not None:
        json_path = os.path.join(out_dir, f"{s.name}.json")
        json_ref = os.path.join(json_dir, f"{s.name}.json")
        atomic_write(json_path, json.dumps(ds, indent=2) + "\n")
        written.append(json_path)
    acc = accelerate_config(s, json_ref, mixed_precision_of(training))
    yaml_path = os.path.join(out_dir, f"{s.name}.yaml")
    shown = os.path.join(json_dir, f"{s.name}.yaml")
    header = HEADER.format(name=s.name, path=shown)
    if acc["num_machines"] > 1:
        header += MACHINES.format(n=acc["num_machines"], last=acc["num_machines"] - 1, k=acc["machine_rank"],
                                  path=shown)
    atomic_write(yaml_path, header + yaml.safe_dump(acc, sort_keys=False))
    written.insert(0, yaml_path)
    return written


def run_files_rewritten(s: StrategySection, out_dir: str, training: dict | None = None,
                        communication_data_type: str | None = None) -> list[str]:
    """The launcher configs that a run in out_dir (finished, or with checkpoints: outdir.run_state) wrote for itself
    and that rendering `s` there would change: `hftrain config` refuses to rewrite them."""
    if outdir.run_state(out_dir)[0] not in ("finished", "unfinished"):
        return []
    changed = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in render(s, tmp, training, json_dir=out_dir, communication_data_type=communication_data_type):
            theirs = os.path.join(out_dir, os.path.basename(path))
            if os.path.isfile(theirs) and _bytes(theirs) != _bytes(path):
                changed.append(theirs)
    return changed


def _bytes(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()
