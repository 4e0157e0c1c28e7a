"""MoE benchmarks: the upcycled model against the dense one on the demo task, and the expert-parallel layer.

    python bench/moe.py train [--steps 60] [--experts 4 8] [--top-k 2] [--repeats 3]
    flock /tmp/hftrain-mp.lock python bench/moe.py ep [--tokens 2048] [--iters 20]
    python bench/moe.py impl [--tokens 2048] [--iters 10] [--experts 16] [--top-k 2]

1. train: the demo task (recipes/demo/sft.yaml, tiny Llama of hftrain.tiny.TINY_LLAMA) trained for --steps steps,
   dense and upcycled to E experts (top-k), each in its own process (recipes/sft.py): training tokens/s (the
   Trainer's train_tokens_per_second, median over --repeats alternated runs), peak RSS of the process,
   parameters, last logged train loss. transformers' default experts kernel (grouped_mm) runs the experts.
2. ep: 2 ranks (torchrun); per rank a batch of --tokens tokens through one Mixtral-style block, forward + backward:
   the native block holding all experts on each rank vs hftrain's ExpertParallelMoE holding half of them and
   dispatching with all_to_all. Median milliseconds per iteration (rank 0).
3. impl: transformers' experts implementations (eager: a loop over the experts hit; batched_mm; grouped_mm) on one
   Qwen3-MoE-shaped model, each in its own process: forward + backward of --tokens tokens, median milliseconds, the
   process's peak RSS, and the loss and gradients against eager's (exact: the same to 1e-5 relative); the fastest
   exact one is named (`model.experts_implementation` sets it in a recipe). Active against total parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
DEMO = os.path.join(REPO, "data", "demo", "train.jsonl")
PY = sys.executable


def _train_worker(argv: list[str]) -> None:
    """One training run in this process; prints its peak RSS last."""
    from hftrain.recipes import sft

    os.chdir(REPO)
    sft.main(argv)
    print("BENCH_MAXRSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)


def train(ns) -> None:
    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    tmp = tempfile.mkdtemp(prefix="hftrain-moe-bench-")
    base = build_tiny_model(os.path.join(tmp, "base"), texts_of_jsonl([DEMO]), seed=0)
    runs: dict[int, list] = {}
    for rep, experts in [(r, e) for r in range(ns.repeats) for e in [0, *ns.experts]]:  # alternated: fair under noise
        out = os.path.join(tmp, f"e{experts}_r{rep}")
        args = [os.path.join(REPO, "recipes", "demo", "sft.yaml"), f"model.name_or_path={base}",
                "data.eval_sources=[]", "training.eval_strategy=no", "eval.exact_match=0",
                f"training.output_dir={out}", f"training.max_steps={ns.steps}", "training.logging_steps=10",
                "training.report_to=none", "training.disable_tqdm=true", "training.warmup_steps=0",
                "training.dataloader_num_workers=0"]
        if experts:
            args += [f"moe.upcycle.num_experts={experts}", f"moe.upcycle.top_k={ns.top_k}",
                     "moe.aux_loss_coef=0.01"]
        env = dict(os.environ, PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(ns.threads))
        r = subprocess.run([PY, os.path.abspath(__file__), "_train_worker", *args], capture_output=True, text=True,
                           env=env)
        if r.returncode != 0:
            sys.exit(r.stdout[-2000:] + r.stderr[-3000:])
        rss = int(r.stdout.split("BENCH_MAXRSS_KIB")[-1].split()[0])
        hist = json.load(open(os.path.join(out, "trainer_state.json")))["log_history"]
        tps = [h["train_tokens_per_second"] for h in hist if "train_tokens_per_second" in h][-1]
        loss = [h["loss"] for h in hist if "loss" in h][-1]
        cfg = json.load(open(os.path.join(out, "config.json")))
        from safetensors import safe_open

        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
        runs.setdefault(experts, []).append((f"{cfg['model_type']} " + (f"E={experts} top-{ns.top_k}" if experts
                                             else "(dense)"), params, tps, rss / 1024, loss))
    rows = [(r[0][0], r[0][1], statistics.median(x[2] for x in r), max(x[3] for x in r), r[0][4])
            for r in runs.values()]
    print(f"demo task, {ns.steps} steps, batch 32 x <=64 tokens, {ns.threads} thread(s), 1 process; "
          f"median tokens/s of {ns.repeats} alternated runs")
    print(f"{'model':<26}{'params':>10}{'tokens/s':>11}{'peak RSS MiB':>14}{'last loss':>11}")
    for name, params, tps, rss, loss in rows:
        print(f"{name:<26}{params / 1e6:>9.2f}M{tps:>11.0f}{rss:>14.0f}{loss:>11.3f}")
    print("(upcycled / dense tokens/s: " + ", ".join(f"{r[0].split()[1]} {r[2] / rows[0][2]:.2f}x" for r in rows[1:])
          + ")")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _ep_worker(ns) -> None:
    import torch
    import torch.distributed as dist
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from hftrain.moe.expert_parallel import ExpertParallelMoE

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=ns.hidden, intermediate_size=ns.intermediate, num_local_experts=ns.num_experts,
                        num_experts_per_tok=2)
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(1, ns.tokens, ns.hidden, generator=torch.Generator().manual_seed(rank))
    layers = {"local (all experts per rank)": block,
              "expert-parallel (all_to_all)": ExpertParallelMoE(block, dist.group.WORLD)}
    res = {}
    for name, layer in layers.items():
        times = []
        for i in range(ns.iters + 3):
            dist.barrier()
            t = time.perf_counter()
            y = layer(x.requires_grad_(True))
            y.square().sum().backward()
            times.append(time.perf_counter() - t)
            layer.zero_grad()
            x.grad = None
        res[name] = statistics.median(times[3:]) * 1e3
    n_local = sum(p.numel() for p in layers["expert-parallel (all_to_all)"].experts.parameters())
    if rank == 0:
        print(f"2 ranks (gloo, CPU), {ns.tokens} tokens/rank, H={ns.hidden}, I={ns.intermediate}, "
              f"E={ns.num_experts}, top-2")
        for name, ms in res.items():
            print(f"  {name:<32} {ms:8.1f} ms / forward+backward")
        print(f"  expert parameters per rank: local {sum(p.numel() for p in block.experts.parameters()) / 1e6:.2f}M, "
              f"expert-parallel {n_local / 1e6:.2f}M")
    dist.destroy_process_group()


def ep(ns) -> None:
    from tests.support import free_port

    cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.abspath(__file__), "_ep_worker", "--tokens", str(ns.tokens), "--iters", str(ns.iters),
           "--hidden", str(ns.hidden), "--intermediate", str(ns.intermediate), "--num-experts", str(ns.num_experts)]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    sys.exit(subprocess.call(cmd, env=env))


IMPLS = ("eager", "batched_mm", "grouped_mm")


def _impl_model(ns, impl: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=1024, hidden_size=ns.hidden, intermediate_size=ns.hidden * 2,
                               moe_intermediate_size=ns.intermediate, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=ns.hidden // 4, num_experts=ns.experts,
                               num_experts_per_tok=ns.top_k, norm_topk_prob=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, experts_implementation=impl, dtype=torch.float32)


def _impl_worker(ns) -> None:
    """One implementation in this process: median ms of forward + backward, loss and gradients saved for the check."""
    import torch

    torch.set_num_threads(ns.threads)
    model = _impl_model(ns, ns.impl).train()
    ids = torch.randint(0, 1024, (ns.tokens // 256, 256), generator=torch.Generator().manual_seed(1))
    times = []
    for i in range(ns.iters + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if i:  # the first is warm-up
            times.append((time.perf_counter() - start) * 1e3)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"loss": loss.detach(), "grads": grads}, ns.out)
    print(json.dumps({"impl": ns.impl, "ms": statistics.median(times),
                      "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def impl(ns) -> None:
    import torch

    model = _impl_model(ns, "eager")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * ns.top_k // ns.experts
    print(f"Qwen3-MoE shape: hidden {ns.hidden}, {ns.experts} experts of {ns.intermediate}, top-{ns.top_k}: "
          f"{total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active per token; {ns.tokens} tokens, "
          f"{ns.threads} thread(s)")
    rows, tmp = {}, tempfile.mkdtemp()
    for name in IMPLS:
        out = os.path.join(tmp, f"{name}.pt")
        cmd = [PY, os.path.abspath(__file__), "_impl_worker", "--impl", name, "--out", out,
               *[a for k in ("tokens", "iters", "hidden", "intermediate", "experts", "top_k", "threads")
                 for a in (f"--{k.replace('_', '-')}", str(getattr(ns, k)))]]
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
        if r.returncode:
            print(f"  {name:<11} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
            continue
        rows[name] = {**json.loads(r.stdout.strip().splitlines()[-1]), "saved": torch.load(out)}
    ref = rows.get("eager")
    for name, row in rows.items():
        exact = ref is not None and _rel(row["saved"]["loss"], ref["saved"]["loss"]) <= 1e-5 and max(
            _rel(g, ref["saved"]["grads"][n]) for n, g in row["saved"]["grads"].items()) <= 1e-5
        row["exact"] = exact
        print(f"  {name:<11} {row['ms']:8.1f} ms / forward+backward  peak RSS {row['maxrss_mib']:7.0f} MiB  "
              f"{'exact' if exact else 'NOT exact'} against eager")
    fastest = min((n for n, r in rows.items() if r["exact"]), key=lambda n: rows[n]["ms"], default=None)
    print(f"fastest exact: {fastest}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_train_worker":
        return _train_worker(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--steps", type=int, default=60)
    t.add_argument("--experts", type=int, nargs="+", default=[4, 8])
    t.add_argument("--top-k", dest="top_k", type=int, default=2)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--repeats", type=int, default=3)
    for name in ("ep", "_ep_worker"):
        e = sub.add_parser(name)
        e.add_argument("--tokens", type=int, default=2048)
        e.add_argument("--iters", type=int, default=20)
        e.add_argument("--hidden", type=int, default=256)
        e.add_argument("--intermediate", type=int, default=512)
        e.add_argument("--num-experts", dest="num_experts", type=int, default=8)
    for name in ("impl", "_impl_worker"):
        i = sub.add_parser(name)
        i.add_argument("--tokens", type=int, default=2048)
        i.add_argument("--iters", type=int, default=10)
        i.add_argument("--hidden", type=int, default=256)
        i.add_argument("--intermediate", type=int, default=256)
        i.add_argument("--experts", type=int, default=16)
        i.add_argument("--top-k", dest="top_k", type=int, default=2)
        i.add_argument("--threads", type=int, default=1)
        if name == "_impl_worker":
            i.add_argument("--impl", choices=IMPLS, required=True)
            i.add_argument("--out", required=True)
    ns = p.parse_args()
    {"train": train, "ep": ep, "_ep_worker": _ep_worker, "impl": impl, "_impl_worker": _impl_worker}[ns.cmd](ns)


if __name__ == "__main__":
    main()
