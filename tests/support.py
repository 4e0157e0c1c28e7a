"""What tests and benchmarks share beyond pytest's fixtures (conftest.py): importable as `tests.support` from the
repository root (benchmarks put it on sys.path)."""

from __future__ import annotations

import itertools
import os
import random
import resource
import socket
import subprocess

# Under pytest-xdist each worker takes its ports from a range of its own, below Linux's ephemeral range (32768 and
# up, where the kernel picks the ports of outgoing connections and of gloo's pairs): a port found free by one worker
# cannot be handed to the other worker's launch before it binds it.
PORTS_PER_WORKER = 2000
FIRST_WORKER_PORT = 12000
_worker_ports = None


def _xdist_worker_index() -> int | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on this machine now, for a local launch's rendezvous (tests and benchmarks start many)."""
    global _worker_ports
    index = _xdist_worker_index()
    if index is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    if _worker_ports is None:  # each worker walks its own range from a random start, never handing a port out twice
        first = FIRST_WORKER_PORT + index * PORTS_PER_WORKER
        start = random.randrange(PORTS_PER_WORKER)
        _worker_ports = (first + (start + k) % PORTS_PER_WORKER for k in itertools.count())
    for port in itertools.islice(_worker_ports, PORTS_PER_WORKER):
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port left in pytest worker {index}'s range")


def cpu_seconds(who: int) -> float:
    """User plus system CPU seconds of `who` (resource.RUSAGE_SELF or RUSAGE_CHILDREN) so far: the suite's cost
    accounting (tests/launch_log.py, and tests/forked.py's launches, which are no children of the pytest process)."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class LaunchTimedOut(subprocess.TimeoutExpired):
    """A launch past its time-out, told with what it was doing when it was killed: the processes of its session (state,
    CPU time, command: a compiler or ninja is a JIT build of DeepSpeed's ops inside the test, a process asleep with
    little CPU a hang), the DeepSpeed build locks present, and the ends of its output. pytest prints str(exception),
    and subprocess.TimeoutExpired's own names only the command: a CI failure of that kind could not be explained."""

    def __init__(self, cmd, timeout, output, stderr, processes: str, locks: list[tuple[str, float]]):
        super().__init__(cmd, timeout, output=output, stderr=stderr)
        self.processes, self.locks = processes, locks

    def __str__(self) -> str:
        return (f"{super().__str__()}\nits processes when killed:\n{self.processes}"
                f"\nDeepSpeed build locks: {locks_told(self.locks)}"
                f"\nstdout ends:\n{(self.output or '')[-3000:]}\nstderr ends:\n{(self.stderr or '')[-4000:]}")


def locks_told(locks: list[tuple[str, float]]) -> str:
    return ", ".join(f"{lock} ({age:.0f} s old)" for lock, age in locks) or "none"


def session_processes(session: int) -> str:
    """`ps` lines of the processes in session `session` (a launch's own: conftest.run and tests/forked.py start one)."""
    ps = subprocess.run(["ps", "-eo", "sid=,pid=,stat=,time=,etime=,args="], capture_output=True, text=True)
    lines = [line.strip() for line in ps.stdout.splitlines() if line.split(None, 1)[:1] == [str(session)]]
    return "\n".join(line[:300] for line in lines) or "(none left)"


def run_with_micro_batch_means(trainer_class: type, main, argv) -> None:
    """The negative control of an exactness test (a matrix variant's body): `main(argv)` with `trainer_class`'s loss
    taken as each micro-batch's own token mean averaged over the accumulation steps (what a per-micro-batch loss
    gives), instead of the sum over the step's global count (losses.GlobalBatchMixin)."""
    counted, share = trainer_class._get_num_items_in_batch, trainer_class.step_share

    def no_global_count(self, batch_samples, device):
        return None  # compute_loss then counts this micro-batch alone

    def micro_mean(self, loss_sum, count):
        return loss_sum / count / self.current_gradient_accumulation_steps

    trainer_class._get_num_items_in_batch, trainer_class.step_share = no_global_count, micro_mean
    try:
        main(argv)
    finally:
        trainer_class._get_num_items_in_batch, trainer_class.step_share = counted, share


# -- a resume against the uninterrupted run, for the methods whose tests launch their runs in a matrix ---------------
RESUMED = {"optim": "adamw_torch", "learning_rate": 1e-3, "save_strategy": "steps", "save_steps": 2}


def resume_variants(plan, tmp, model_dir, rows) -> dict:
    """A whole model and a LoRA adapter, each trained 4 steps (micro-batch 2, GA2) with AdamW and a checkpoint at step
    2, then resumed from it later in the same launch, and resumed from it with the weights only (the control: a fresh
    optimizer). `plan(tmp, name, model_dir, rows, bs, ga, steps, model=..., training=...)` is the test module's own
    variant of a matrix launch."""
    out = {}
    for kind, model in (("whole", {}), ("lora", {"lora": {"r": 4, "alpha": 8}})):
        ck = str(tmp / f"resume_{kind}" / "checkpoint-2")
        for name, more in (("", {}), ("_after", {"resume_from_checkpoint": ck}),
                           ("_weights_only", {"resume_from_checkpoint": ck, "resume_weights_only": True})):
            out[f"resume_{kind}{name}"] = plan(tmp, f"resume_{kind}{name}", model_dir, rows, 2, 2, 4, model=model,
                                               training={**RESUMED, **more})
    return out


def assert_resume_exact(tmp, variants, kind: str, bounds: str) -> None:
    """Steps 3-4 from checkpoint-2 (weights, AdamW state, data position) equal the uninterrupted run's (bounds
    `<bounds>.resumed_vs_uninterrupted.*`); resuming the weights alone is the control."""
    import json

    from safetensors.torch import load_file

    from tests.exactness import beyond, within

    weights = "adapter_model.safetensors" if kind == "lora" else "model.safetensors"
    runs = {}
    for name in (f"resume_{kind}", f"resume_{kind}_after", f"resume_{kind}_weights_only"):
        variants[name].check()
        history = json.load(open(tmp / name / "trainer_state.json"))["log_history"]
        runs[name] = ([h["loss"] for h in history if "loss" in h], load_file(str(tmp / name / weights)))
    whole, after, control = runs[f"resume_{kind}"], runs[f"resume_{kind}_after"], runs[f"resume_{kind}_weights_only"]
    within(f"{bounds}.resumed_vs_uninterrupted.losses", after[0][-2:], whole[0][-2:], label=kind)
    within(f"{bounds}.resumed_vs_uninterrupted.weights", after[1], whole[1], label=kind)
    beyond(f"{bounds}.resumed_vs_uninterrupted.weights", control[1], whole[1], label=f"{kind}, weights only")


def scrambled(tiny_model_dir, folder, seed, scale: float = 0.5) -> str:
    """The tiny model with every matrix drawn anew at a larger scale, saved in `folder` with its tokenizer: a tiny
    model as built answers every prompt with the same blank lines, which leaves a comparison of answers nothing to
    tell apart (tests/test_harness_eval.py, tests/test_export.py)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    draw = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in (p for p in model.parameters() if p.dim() == 2):
            weight.copy_(torch.randn(weight.shape, generator=draw) * scale)
    model.save_pretrained(folder)
    for name in os.listdir(tiny_model_dir):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(tiny_model_dir, name), folder)
    return folder
