"""The rank vocabulary: every "am I rank 0?" question in hftrain goes through here.

Thin wrappers over accelerate's `PartialState` so that the answer is the same one the Trainer uses.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from .lifetime import stop_heartbeat


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's global rank; before the process group exists, the one the launcher exported."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    return rank() == 0


def local_rank() -> int:
    """This process's index on its machine (LOCAL_RANK as the launcher exported it; unset: a lone process, 0)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_local_main_process() -> bool:
    """The first process of this machine. The main process is one (every launcher gives global rank 0 local rank
    0)."""
    return local_rank() == 0


def print0(*args, **kwargs) -> None:
    """print() on the main process only, flushed so it interleaves sanely with the progress bar."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


@contextlib.contextmanager
def main_process_first():
    """The main process runs the block first (e.g. tokenises into the datasets cache); the others then reuse it.

    Unlike a bare barrier pair, the main process releases the others even when the block raises: they then run
    the block themselves and meet the same error, so a bad dataset ends every rank instead of hanging them.
    """
    if world_size() == 1:
        yield
        return
    if not is_main_process():
        barrier()
        yield
        return
    try:
        yield
    finally:
        barrier()


def machine_index() -> int:
    """This machine's rank among the machines: torchrun's (and accelerate's) GROUP_RANK, DeepSpeed's node launcher's
    CROSS_RANK, else from the global rank and LOCAL_WORLD_SIZE; a launcher that says none of them runs one machine
    (DeepSpeed's launcher sets no LOCAL_WORLD_SIZE: reading it as 1 put every rank on a machine of its own, and the
    ranks waited for data preparations that no process would run)."""
    for name in ("GROUP_RANK", "CROSS_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or world_size()
    return rank() // max(int(local), 1)


_ONCE_CALLS = [0]
_ONCE_POLL_S = 0.2


def once_per_node(fn, errors: tuple[type[BaseException], ...] = ()):
    """fn()'s result on every rank, fn run by the main process alone first, then by the first process of each other
    machine, then by all the others: a fn that prepares files in a cache and returns them memory-mapped (the data
    phase) thus does its work once per machine, or once per job when the machines share the cache's filesystem
    (the later runs find the files), and the other ranks wait holding nothing.

    The wait is on the process group's store, polled, not a collective: preparing may take longer than the
    group's timeout (the heartbeat still ends the job if the preparing rank dies). An error of the first run is
    raised on every rank that waited for it, without running fn again: as the same class when it is one of `errors`
    (built from its message), else as a RuntimeError naming its class. It travels as JSON (type name and message),
    never pickled: the store is a network service, and hftrain unpickles nothing."""
    if world_size() == 1:
        return fn()
    _ONCE_CALLS[0] += 1
    tag = f"hftrain/once/{restart_count()}/{_ONCE_CALLS[0]}"
    store = dist.distributed_c10d._get_default_store()  # private: no public accessor of the group's store
    node, first = machine_index(), is_local_main_process()
    if not is_main_process():
        _wait_and_raise(store, f"{tag}/main", errors)
        if node != 0 and not first:
            _wait_and_raise(store, f"{tag}/node{node}", errors)
    if is_main_process() or (first and node != 0):
        post = f"{tag}/main" if is_main_process() else f"{tag}/node{node}"
        try:
            result = fn()
        except BaseException as e:
            store.set(post, b"error" + json.dumps({"type": type(e).__name__, "message": str(e)}).encode())
            raise
        store.set(post, b"ok")
        return result
    return fn()


def _wait_and_raise(store, key: str, errors: tuple[type[BaseException], ...] = ()) -> None:
    while not store.check([key]):
        time.sleep(_ONCE_POLL_S)
    value = store.get(key)
    if value.startswith(b"error"):
        sent = json.loads(value[len(b"error"):])
        cls = next((c for c in errors if c.__name__ == sent["type"]), None)
        raise cls(sent["message"]) if cls is not None else RuntimeError(f"{sent['type']}: {sent['message']}")


def all_gather_object(obj) -> list:
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(value: float | int) -> float:
    if world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def shutdown(wait: bool = True) -> None:
    """Tear the process group down before interpreter exit: a gloo group still alive at exit can abort the process
    ("terminate called without an active exception"); a gc, then an explicit destroy, avoids it. The heartbeat stops
    first: the other ranks must not take this rank's normal end for a stall."""
    stop_heartbeat()
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # only a live group needs it; a full collection of a large heap costs a third of a second
        if wait:
            barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def accelerator_available() -> bool:
    """A GPU-like device is present (CUDA, XPU, MPS, ...): decides use_cpu, NCCL vs gloo, FSDP's CPU shim."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


def launcher_world_size() -> int:
    """How many processes the launcher (torchrun / accelerate / deepspeed) says it started."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def elastic_restart_count() -> int:
    """How many times an elastic launcher (torchrun / accelerate --max_restarts) has restarted the workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def requeue_count() -> int:
    """How many times SLURM has requeued this job (SLURM_RESTART_COUNT: after `scontrol requeue`, a preemption or
    a node failure the job's script runs again with it set, and srun passes it to every task)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def restart_count() -> int:
    """How many times this run has been started again, by an elastic launcher or by SLURM requeueing the job: a
    restarted run resumes from the newest complete checkpoint in output_dir."""
    return elastic_restart_count() + requeue_count()


def any_rank(flag: bool, device=None) -> bool:
    """True on every rank when `flag` is true on any (one MAX all-reduce; `device`: the process group's, e.g. a
    CUDA device under NCCL). Every rank must call it at the same point."""
    if world_size() == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def sequence_parallel_size(args) -> int:
    """N of a run's arguments (or accelerator) under sequence parallelism (DeepSpeed's Ulysses through accelerate's
    ParallelismConfig): the ranks that share each sequence; 1 without it."""
    pc = getattr(args, "parallelism_config", None)
    return pc.sp_size if pc is not None and pc.sp_backend == "deepspeed" and pc.sp_size > 1 else 1


def mesh_degrees(args) -> list[int] | None:
    """[replicate, shard, tensor, context] of a run's arguments (or accelerator) on an FSDP2 device mesh past
    sharding (HSDP, TP, CP through accelerate's ParallelismConfig); None for any other run."""
    pc = getattr(args, "parallelism_config", None)
    if pc is None or not (pc.dp_replicate_size > 1 or pc.tp_size > 1 or pc.cp_size > 1):
        return None
    return [pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size]
