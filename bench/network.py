"""Does gradient compression reach the same loss sooner on a slow link? Two "hosts" (network namespaces joined by a
rate-shaped veth pair, tests/netns.py), 1 DDP process each, the demo SFT task; as root.

    sudo python bench/network.py [--rate 10mbit] [--steps 40] [--methods none int8 powersgd-r2 ...]
                                 [--workdir DIR] [--plot bench/network.png]

1. `none` (uncompressed, with compression.profile so its all-reduce is timed too) trains --steps steps; its final
   eval loss is the TARGET and its training time T the BUDGET.
2. Every other method trains from the same random init, seed and batches until an evaluation reaches TARGET or its
   training time passes T. Reported per method: bytes per step, seconds per step, the share of the step during
   which gradients were on the wire (comm/time_share), the share of that hidden behind the backward
   (comm/hidden_share), the training time to reach TARGET and its ratio to T, and the eval loss reached within T.
Training time excludes the evaluations (every --eval-steps steps, to place the moment TARGET is reached); the
launches' start-up (~30-60 s, equal for all) is not part of it either. A plot of eval loss against training time
per method goes to --plot.

Methods: none, fp16, bf16, int8, topk (1%), powersgd-rN (rank N; compression.start_step left at its default) and
powersgd-rN-sK (start_step K). The model is the demo's (0.9M parameters: 3.56 MB of fp32 gradient per step), the
learning rate constant after 10 warm-up steps (so a method that runs more steps gets the same schedule). CPU compute
is slow: on GPUs the same link would be a larger share of each step, and compression would pay more, not less.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests import netns  # noqa: E402

IP = ("10.97.0.1", "10.97.0.2")
PY = sys.executable
DEFAULT_METHODS = ["none", "fp16", "bf16", "int8", "topk", "powersgd-r1", "powersgd-r2", "powersgd-r4"]


def method_overrides(name: str) -> list[str]:
    if name == "none":
        return ["compression.profile=true"]
    if name.startswith("powersgd-r"):
        rank, _, start = name[len("powersgd-r"):].partition("-s")
        return ["compression.method=powersgd", f"compression.powersgd_rank={int(rank)}",
                *([f"compression.start_step={int(start)}"] if start else [])]
    return [f"compression.method={name}"]


def run_method(ns, name: str, base: str, work: str, steps: int, eval_steps: int, target: float,
               budget: float, timeout: int) -> dict:
    out = os.path.join(work, name)
    clock = os.path.join(work, f"{name}.clock.json")
    overrides = [f"model.name_or_path={base}", f"training.output_dir={out}", f"training.max_steps={steps}",
                 "training.logging_steps=1", "training.eval_strategy=steps", f"training.eval_steps={eval_steps}",
                 "training.lr_scheduler_type=constant_with_warmup", "training.warmup_steps=10",
                 "training.save_strategy=no", "training.report_to=none", "training.disable_tqdm=true",
                 "training.overwrite_output_dir=true", "eval.exact_match=0", *method_overrides(name)]
    procs = []
    for r in range(2):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=netns.IFACE[r], OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   TOKENIZERS_PARALLELISM="false")
        cmd = ["ip", "netns", "exec", ns[r], "timeout", "-s", "KILL", str(timeout), PY, "-m",
               "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml", "--num_machines", "2",
               "--num_processes", "2", "--machine_rank", str(r), "--main_process_ip", IP[0],
               "--main_process_port", "29500", "bench/network_worker.py", "recipes/demo/sft.yaml", clock,
               str(target), str(budget), *overrides]
        log = open(os.path.join(work, f"{name}.node{r}.log"), "w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    rcs = [p.wait() for p in procs]
    if rcs != [0, 0]:
        tail = open(os.path.join(work, f"{name}.node0.log")).read()[-3000:]
        raise SystemExit(f"{name}: exit {rcs}; logs in {work}\n{tail}")
    return summarise(name, out, clock, target, budget)


def summarise(name: str, out: str, clock_file: str, target: float, budget: float) -> dict:
    clock = json.load(open(clock_file))
    logs = [h for h in json.load(open(os.path.join(out, "trainer_state.json")))["log_history"] if "loss" in h]
    # Steady state: after the first step (DDP rebuilds its buckets) and a PowerSGD warm-up (uncompressed steps).
    k = next((int(o.split("=")[1]) for o in method_overrides(name) if o.startswith("compression.start_step=")),
             2 if name.startswith("powersgd") else 1)
    start = max(k, 1)
    steady = [h for h in logs if h["step"] > start] or logs
    times = dict((s, t) for s, t in clock["steps"])
    per_step = sorted(times[s] - times[s - 1] for s in times if s - 1 in times and s > start)
    reached = next((t for s, t, loss in clock["evals"] if target > 0 and loss <= target), None)
    within = [loss for s, t, loss in clock["evals"] if budget <= 0 or t <= budget * 1.02]

    def mean(key):
        vals = [h[key] for h in steady if key in h]
        return sum(vals) / len(vals) if vals else float("nan")

    return {"method": name, "bytes_sent": mean("comm/bytes_sent"), "bytes_raw": mean("comm/bytes_raw"),
            "s_per_step": per_step[len(per_step) // 2] if per_step else float("nan"),
            "time_share": mean("comm/time_share"), "hidden_share": mean("comm/hidden_share"),
            "steps": clock["steps"][-1][0] if clock["steps"] else 0,
            "train_time": clock["steps"][-1][1] if clock["steps"] else 0.0,
            "time_to_target": reached, "loss_within_budget": min(within) if within else float("nan"),
            "final_eval_loss": clock["evals"][-1][2], "evals": clock["evals"]}


def plot(rows: list[dict], target: float, rate: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        ax.plot([t for _, t, _ in r["evals"]], [loss for _, _, loss in r["evals"]], marker=".", label=r["method"])
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target (none's final)")
    ax.set_yscale("log")
    ax.set_xlabel("training time, s (evaluations excluded)")
    ax.set_ylabel("held-out eval loss")
    ax.set_title(f"Demo SFT, 2 hosts x 1 process (DDP, gloo), link {rate} each way")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="10mbit", help="link rate each way (tc syntax); 'none' for unshaped")
    ap.add_argument("--steps", type=int, default=40, help="steps of the uncompressed reference")
    ap.add_argument("--eval-steps", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    ap.add_argument("--workdir", default=os.path.join(REPO, "runs", "bench_network"))
    ap.add_argument("--plot", default=os.path.join(REPO, "bench", "network.png"))
    ap.add_argument("--timeout", type=int, default=1200, help="seconds a method's launch may take")
    ns_args = ap.parse_args()
    why = netns.problem()
    if why:
        raise SystemExit(f"bench/network.py {why}")
    work = os.path.abspath(ns_args.workdir)
    os.makedirs(work, exist_ok=True)
    base = os.path.join(work, "base")
    if not os.path.isdir(base):
        subprocess.run([PY, "-m", "hftrain.cli", "tiny-model", "--data", "data/demo/train.jsonl", "--output", base],
                       cwd=REPO, check=True, capture_output=True)
    rate = None if ns_args.rate == "none" else ns_args.rate
    methods = ["none", *[m for m in ns_args.methods if m != "none"]]
    rows = []
    with netns.two_hosts(IP, rate) as ns:
        for name in methods:
            t = time.perf_counter()
            if name == "none":
                rows.append(run_method(ns, name, base, work, ns_args.steps, ns_args.eval_steps, 0, 0,
                                       ns_args.timeout))
                target, budget = rows[0]["final_eval_loss"], rows[0]["train_time"]
                rows[0]["time_to_target"] = budget  # by definition: its final loss, at its end
            else:  # more steps than the budget allows: the target or the budget ends it
                rows.append(run_method(ns, name, base, work, 20 * ns_args.steps, ns_args.eval_steps, target,
                                       budget, ns_args.timeout))
            r = rows[-1]
            print(f"  {name}: {r['steps']} steps, {r['train_time']:.0f} s training "
                  f"({time.perf_counter() - t:.0f} s launch)", flush=True)
    json.dump(rows, open(os.path.join(work, "results.json"), "w"), indent=1)
    print(f"\nlink {ns_args.rate} each way, 2 hosts x 1 process (DDP, gloo), demo model; target = none's eval loss "
          f"after {ns_args.steps} steps = {target:.4f}, reached in T = {budget:.0f} s of training\n")
    print("| method | bytes/step sent | fewer bytes | s/step | comm share of step | comm hidden | "
          "time to target | / T | eval loss within T |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["bytes_raw"] / r["bytes_sent"] if r["bytes_sent"] else float("nan")
        tt = "-" if r["time_to_target"] is None else f"{r['time_to_target']:.0f} s"
        frac = "-" if r["time_to_target"] is None else f"{r['time_to_target'] / budget:.2f}"
        print(f"| {r['method']} | {r['bytes_sent'] / 1e6:.3f} MB | {ratio:.1f}x | {r['s_per_step']:.2f} | "
              f"{r['time_share']:.0%} | {r['hidden_share']:.0%} | {tt} | {frac} | {r['loss_within_budget']:.4f} |")
    plot(rows, target, ns_args.rate, os.path.abspath(ns_args.plot))
    print(f"\nplot: {ns_args.plot}; runs and logs: {work}")


if __name__ == "__main__":
    main()
