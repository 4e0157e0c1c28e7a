"""The strategy: section (how a run is spread over processes and machines), which options each strategy reads,
and what an unset option means."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..constants import StrategyName
from .fields import option


@dataclass
class StrategySection:
    name: StrategyName | None = option(
        None, "How to distribute. Unset: the launcher's config decides; set: it must agree with the launcher."
    )
    num_processes: int | None = option(None, "Processes in all (all machines); default 2.")
    num_machines: int | None = option(None, "Machines (nodes); default 1.")
    machine_rank: int | None = option(None, "This machine's rank among the machines; default 0.")
    main_process_ip: str | None = option(None, "Address of machine 0 (several machines).")
    main_process_port: int | None = option(None, "Port of the rendezvous on machine 0; default 29500.")
    rank_timeout: int | None = option(
        None, "Seconds a rank may go without answering (stopped, hung, dead) before the job fails naming it; "
        "0 turns the check off; default 300."
    )
    socket_ifname: str | None = option(
        None, "Network interface the machines reach each other on (e.g. eth0, ib0): exported as GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME to every rank, and the SLURM script takes the main address from it; default: what the "
        "hostname resolves to."
    )
    fsdp_reshard_after_forward: bool | None = option(
        None, "fsdp: free gathered parameters after forward (ZeRO-3 like); default true."
    )
    fsdp_offload_params: bool | None = option(None, "fsdp: keep parameters and gradients on the CPU; default false.")
    fsdp_wrap_class: str | None = option(
        None, "fsdp: layer class to shard as one unit; default: the model's own decoder layer."
    )
    pin_memory: bool | None = option(None, "zero3_offload/zero_infinity: pin CPU buffers (GPU only); default false.")
    nvme_path: str | None = option(None, "zero_infinity: folder on a fast local disk for parameter and optimizer swap.")
    aio_block_size: int | None = option(None, "zero_infinity: async I/O block size in bytes; default 1048576.")
    aio_queue_depth: int | None = option(None, "zero_infinity: async I/O queue depth; default 8.")
    buffer_count: int | None = option(None, "zero_infinity: swap buffers for parameters; default 5.")
    buffer_size: int | None = option(
        None, "zero_infinity: elements per parameter swap buffer; default: the largest parameter."
    )
    sub_group_size: int | None = option(
        None, "zero_infinity: optimizer elements swapped as one unit (each of the optimizer's swap buffers holds "
        "one); default: 4x the largest parameter."
    )
    sequence_parallel: int | None = option(
        None, "zero2/zero3: split every sequence across this many ranks (DeepSpeed Ulysses: each rank holds 1/N of "
        "the tokens, attention heads are exchanged); the processes are data-parallel groups of N; default 1 (off)."
    )

    dp_replicate_size: int | None = option(
        None, "fsdp: replicas of the sharded model (HSDP: each parameter sharded over a group of dp_shard_size ranks, "
        "e.g. one machine's, and the groups replicated, so only gradients cross between groups); default 1."
    )
    dp_shard_size: int | None = option(
        None, "fsdp: ranks each parameter is sharded over; default: num_processes / (dp_replicate_size x tp_size x "
        "cp_size)."
    )
    tp_size: int | None = option(
        None, "ddp: tensor-parallel degree, equal to num_processes (each layer's weights split over the ranks by "
        "transformers' tp_plan, at load time); default 1 (off)."
    )
    cp_size: int | None = option(
        None, "fsdp: context-parallel degree (ring attention: each sequence split over this many ranks; GPU only); "
        "default 1 (off)."
    )

    def resolved_sequence_parallel(self) -> int:
        return self.sequence_parallel or 1

    def resolved_num_processes(self) -> int:
        """num_processes, or its default where unset (or not a number: the rules say so)."""
        n = self.num_processes
        return n if isinstance(n, int) and not isinstance(n, bool) else STRATEGY_DEFAULTS["num_processes"]

    def resolved_tensor_parallel(self) -> int:
        return self.tp_size if isinstance(self.tp_size, int) and self.tp_size > 1 else 1

    def mesh(self) -> Mesh:
        """The device mesh's degrees (unset ones resolved); the shard degree is what the others leave of the world."""
        replicate, tensor, context = (v if isinstance(v, int) and v >= 1 else 1
                                      for v in (self.dp_replicate_size, self.tp_size, self.cp_size))
        shard = self.dp_shard_size
        if not (isinstance(shard, int) and shard >= 1):
            shard = max(1, self.resolved_num_processes() // (replicate * tensor * context))
        return Mesh(replicate, shard, tensor, context)


@dataclass(frozen=True)
class Mesh:
    """The degrees of an FSDP2 run's device mesh (accelerate's ParallelismConfig), their product the world size:
    replicas x shards is the data-parallel size, tensor and context ranks share each batch."""
    replicate: int = 1
    shard: int = 1
    tensor: int = 1
    context: int = 1

    @property
    def degrees(self) -> list[int]:
        """[replicate, shard, tensor, context], as a checkpoint's layout records them."""
        return [self.replicate, self.shard, self.tensor, self.context]

    @property
    def beyond_sharding(self) -> bool:
        """More than one dimension: plain FSDP2 (every rank a shard) needs no mesh."""
        return self.replicate > 1 or self.tensor > 1 or self.context > 1


# Which options each strategy reads; any other option set in a recipe is an error, not silently ignored.
COMMON_OPTIONS = frozenset({"name", "num_processes", "num_machines", "machine_rank", "main_process_ip",
                            "main_process_port", "rank_timeout", "socket_ifname"})
MESH_OPTIONS = frozenset({"dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"})
STRATEGY_OPTIONS = {
    "ddp": COMMON_OPTIONS | {"tp_size"},
    "fsdp": COMMON_OPTIONS | {"fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_wrap_class"} | MESH_OPTIONS,
    "zero1": COMMON_OPTIONS,
    "zero2": COMMON_OPTIONS | {"sequence_parallel"},
    "zero3": COMMON_OPTIONS | {"sequence_parallel"},
    "zero3_offload": COMMON_OPTIONS | {"pin_memory"},
    "zero_infinity": COMMON_OPTIONS | {"pin_memory", "nvme_path", "aio_block_size", "aio_queue_depth",
                                       "buffer_count", "buffer_size", "sub_group_size"},
}
DEFAULT_PORT = 29500
# What an unset option means (the help text of each field says the same).
STRATEGY_DEFAULTS = {
    "num_processes": 2,
    "num_machines": 1,
    "machine_rank": 0,
    "main_process_port": DEFAULT_PORT,
    "rank_timeout": 300,
    "fsdp_reshard_after_forward": True,
    "fsdp_offload_params": False,
    "pin_memory": False,
    "nvme_path": "/local_nvme",
    "aio_block_size": 1048576,
    "aio_queue_depth": 8,
    "buffer_count": 5,
    "buffer_size": 100_000_000,
    "sub_group_size": 1_000_000_000,
    "sequence_parallel": 1,
    "dp_replicate_size": 1,
    "tp_size": 1,
    "cp_size": 1,
}


def resolved_strategy(s: StrategySection) -> StrategySection:
    """The section with every option the named strategy reads filled in from STRATEGY_DEFAULTS."""
    if s.name is None:
        raise ValueError("strategy.name is unset: name a strategy to resolve its options")
    values = {k: (getattr(s, k) if getattr(s, k) is not None else STRATEGY_DEFAULTS.get(k))
              for k in STRATEGY_OPTIONS[s.name] if k != "name"}
    return dataclasses.replace(s, **values)


def strategy_of_deepspeed_config(cfg: dict) -> str:
    """The strategy name a DeepSpeed config stands for (its ZeRO stage and offload devices)."""
    zero = cfg.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if stage != 3:
        return f"zero{stage}"
    devices = {zero.get("offload_param", {}).get("device"), zero.get("offload_optimizer", {}).get("device")}
    return "zero_infinity" if "nvme" in devices else "zero3_offload" if "cpu" in devices else "zero3"
