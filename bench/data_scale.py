"""Data at scale (issue #28): time to the first optimizer step and peak RSS per rank, hftrain next to TRL's
SFTTrainer, on generated alpaca-layout JSONL of distinct rows, a tiny model, max_length 512, batch 8.

For each size: an empty datasets cache ("cold"), then the same cache again ("warm"), on 1 and 2 processes (CPU,
gloo), and a streaming run (hftrain data.streaming; TRL given datasets' streaming loader). Also the cold preparation
alone (`hftrain prepare`) with data.num_proc 1 and 2, and `hftrain check` / `hftrain data` on a warm cache. Writes
bench/data_scale.json (every run, appended), prints a markdown table and plots bench/data_scale.png.

    flock /tmp/hftrain-heavy.lock python bench/data_scale.py --sizes 10000 100000 [--impls hftrain trl]
    python bench/data_scale.py --table        # the table and plot of what data_scale.json holds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
RESULTS = os.path.join(REPO, "bench", "data_scale.json")
PLOT = os.path.join(REPO, "bench", "data_scale.png")
WORKER = os.path.join(REPO, "bench", "data_scale_worker.py")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu red green blue amber teal violet cedar maple "
         "river stone cloud ember frost glade harbor island jungle").split()
TASKS = ("Reverse the order of these words.", "Sort these words alphabetically.", "Repeat the last word.",
         "Count the words.", "Write these words in upper case.", "Remove every other word.")


def alpaca_row(i: int, rng: random.Random) -> dict:
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 60))]
    k = i % len(TASKS)
    out = {0: words[::-1], 1: sorted(words), 2: words[-1:], 3: [str(len(words))], 4: [w.upper() for w in words],
           5: words[::2]}[k]
    return {"instruction": f"{TASKS[k]} (item {i})", "input": " ".join(words), "output": " ".join(out)}


def make_data(folder: str, n: int) -> str:
    path = os.path.join(folder, f"alpaca-{n}.jsonl")
    if not os.path.exists(path):
        rng = random.Random(n)
        with open(path + ".tmp", "w") as fh:
            for i in range(n):
                fh.write(json.dumps(alpaca_row(i, rng)) + "\n")
        os.replace(path + ".tmp", path)
    return path


def make_model(folder: str) -> str:
    from hftrain.tiny import build_tiny_model

    out = os.path.join(folder, "tiny")
    if not os.path.exists(os.path.join(out, "config.json")):
        rng = random.Random(0)
        texts = [" ".join(alpaca_row(i, rng).values()) for i in range(2000)]
        build_tiny_model(out, texts, vocab_size=1000, seed=0)
    return out


def load_now() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f}"


def launch(procs: int, args: list[str], env: dict) -> list[str]:
    from tests.support import free_port

    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            os.path.join(REPO, "accelerate_configs", "ddp.yaml"), "--num_processes", str(procs),
            "--main_process_port", str(free_port()), *args]


def run_one(impl: str, mode: str, n: int, procs: int, cache_state: str, folder: str, model: str, data: str,
            num_proc: str = "-") -> dict:
    cache = os.path.join(folder, f"cache-{impl}-{n}" + ("-stream" if mode == "streaming" else ""))
    if cache_state == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    out = os.path.join(folder, "runs", f"{impl}-{mode}-{n}-{procs}-{cache_state}")
    shutil.rmtree(out + ".run", ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    env = {**os.environ, "HF_DATASETS_CACHE": cache, "PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "true"}
    load = load_now()
    start = time.time()
    r = subprocess.run(launch(procs, [WORKER, impl, mode, model, data, out, num_proc], env), env=env,
                       capture_output=True, text=True)
    wall = time.time() - start
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-5000:], file=sys.stderr)
        raise SystemExit(f"{impl} {mode} {n} rows {procs} processes failed")
    ranks = [json.load(open(f"{out}.rank{i}")) for i in range(procs)]
    return {"impl": impl, "mode": mode, "rows": n, "procs": procs, "cache": cache_state,
            "first_step_s": round(max(x["first_step_at"] for x in ranks) - start, 2),
            "peak_rss_gb": [round(x["peak_rss"] / 2**30, 3) for x in ranks], "wall_s": round(wall, 1),
            "cpu_s": [round(x.get("cpu_s", float("nan")), 1) for x in ranks],
            "uss_gb": [round(x.get("uss", float("nan")) / 2**30, 3) for x in ranks],
            "load_before": load, "load_after": load_now(), "when": time.strftime("%Y-%m-%d %H:%M")}


def run_cli(what: str, n: int, folder: str, model: str, data: str, num_proc: int | None, cold: bool) -> dict:
    """`hftrain prepare` (cold, a given num_proc, a cache of its own) or `hftrain check` / `hftrain data` (warm: the
    cache the prepared hftrain runs made, the same recipe values)."""
    cache = os.path.join(folder, f"cache-cli-{n}-{num_proc}" if cold else f"cache-hftrain-{n}")
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    recipe = os.path.join(folder, f"recipe-{n}.yaml")
    with open(recipe, "w") as fh:
        json.dump({"model": {"name_or_path": model}, "data": {"sources": [{"path": data}], "max_length": 512},
                   "training": {"output_dir": os.path.join(folder, "runs", "cli-out"), "max_steps": 1}}, fh)
    env = {**os.environ, "HF_DATASETS_CACHE": cache, "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "hftrain.cli", what, recipe] + ([f"data.num_proc={num_proc}"] if num_proc else [])
    load, start = load_now(), time.time()
    r = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], env=env, capture_output=True, text=True)
    took = time.time() - start
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"hftrain {what} failed")
    return {"impl": "hftrain", "mode": what, "rows": n, "procs": 1, "cache": "cold" if cold else "warm",
            "num_proc": num_proc, "seconds": round(took, 1),
            "peak_rss_gb": [round(int(r.stderr.strip().splitlines()[-1]) / 2**20, 3)],
            "load_before": load, "load_after": load_now(), "when": time.strftime("%Y-%m-%d %H:%M")}


def save(result: dict) -> None:
    done = json.load(open(RESULTS)) if os.path.exists(RESULTS) else []
    done.append(result)
    with open(RESULTS, "w") as fh:
        json.dump(done, fh, indent=1)
    print(json.dumps(result), flush=True)


def latest(results: list[dict]) -> dict:
    """The last result of each configuration."""
    out = {}
    for r in results:
        out[(r["impl"], r["mode"], r["rows"], r["procs"], r["cache"], r.get("num_proc"))] = r
    return out


def table(results: list[dict]) -> str:
    last = latest(results)
    sizes = sorted({k[2] for k in last})
    lines = ["| rows | procs | first step, cold: hftrain / TRL | first step, warm: hftrain / TRL | CPU s to it, warm | "
             "peak RSS per rank, warm: hftrain / TRL | streaming first step: hftrain / TRL | "
             "streaming peak RSS: hftrain / TRL | load (1 min) |", "|---|---|---|---|---|---|---|---|---|"]

    def cell(impl, mode, n, p, cache, key):
        r = last.get((impl, mode, n, p, cache, None))
        if r is None or key not in r:
            return "-"
        v = r[key]
        if key == "cpu_s":
            return f"{max(v):.1f}" if v else "-"
        return f"{max(v):.2f} GB" if key == "peak_rss_gb" else f"{v:.1f} s"

    def loads(n, p):
        seen = [float(x) for r in last.values() if r["rows"] == n and r["procs"] == p and "first_step_s" in r
                for x in (r["load_before"].split("/")[0], r["load_after"].split("/")[0])]
        return f"{min(seen):.1f}-{max(seen):.1f}" if seen else "-"

    for n in sizes:
        for p in (1, 2):
            if not any(k[2] == n and k[3] == p for k in last):
                continue
            def pair(mode, cache, key):
                return f"{cell('hftrain', mode, n, p, cache, key)} / {cell('trl', mode, n, p, cache, key)}"
            lines.append(f"| {n:,} | {p} | {pair('prepared', 'cold', 'first_step_s')} | "
                         f"{pair('prepared', 'warm', 'first_step_s')} | {pair('prepared', 'warm', 'cpu_s')} | "
                         f"{pair('prepared', 'warm', 'peak_rss_gb')} | "
                         f"{pair('streaming', 'cold', 'first_step_s')} | {pair('streaming', 'cold', 'peak_rss_gb')} | "
                         f"{loads(n, p)} |")
    cli = [r for r in last.values() if r["mode"] in ("prepare", "check", "data")]
    if cli:
        lines += ["", "| command | rows | cache | data.num_proc | seconds | peak RSS | load (1 min) |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(cli, key=lambda r: (r["mode"], r["rows"], r.get("num_proc") or 0)):
            lines.append(f"| hftrain {r['mode']} | {r['rows']:,} | {r['cache']} | {r.get('num_proc') or 'default'} | "
                         f"{r['seconds']:.1f} | {max(r['peak_rss_gb']):.2f} GB | {r['load_before'].split('/')[0]} |")
    return "\n".join(lines)


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = list(latest(results).values())
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("prepared", "cold", "first_step_s", "first step, empty cache (s)"),
              ("prepared", "warm", "first_step_s", "first step, warm cache (s)"),
              ("prepared", "warm", "peak_rss_gb", "peak RSS per rank, warm (GB)")]
    for ax, (mode, cache, key, title) in zip(axes, panels):
        for impl, color in (("hftrain", "tab:blue"), ("trl", "tab:orange")):
            for procs, style in ((1, "-o"), (2, "--s")):
                pts = sorted((r["rows"], max(r[key]) if isinstance(r[key], list) else r[key]) for r in last
                             if (r["impl"], r["mode"], r["procs"], r["cache"]) == (impl, mode, procs, cache))
                if pts:
                    ax.plot(*zip(*pts), style, color=color, label=f"{impl}, {procs} proc")
            pts = sorted((r["rows"], max(r[key]) if isinstance(r[key], list) else r[key]) for r in last
                         if (r["impl"], r["mode"], r["procs"]) == (impl, "streaming", 1))
            if pts and cache == "warm":  # a stream has no cache: drawn with the warm runs it competes with
                ax.plot(*zip(*pts), ":^", color=color, label=f"{impl}, streaming")
        ax.set_xscale("log")
        ax.set_xlabel("rows")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    axes[2].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--impls", nargs="*", default=["hftrain", "trl"])
    p.add_argument("--procs", type=int, nargs="*", default=[1, 2])
    p.add_argument("--parts", nargs="*", default=["prepared", "streaming", "cli"])
    p.add_argument("--cold-procs", dest="cold_procs", type=int, nargs="*", default=[1, 2],
                   help="process counts also run on an empty cache (the others only warm)")
    p.add_argument("--prepare-up-to", dest="prepare_up_to", type=int, default=100_000,
                   help="largest size whose cold `hftrain prepare` is timed with num_proc 1 and 2")
    p.add_argument("--folder", default="/tmp/hftrain-data-scale")
    p.add_argument("--table", action="store_true", help="only print the table and plot of data_scale.json")
    a = p.parse_args()
    if not a.table:
        os.makedirs(a.folder, exist_ok=True)
        model = make_model(a.folder)
        for n in a.sizes:
            data = make_data(a.folder, n)
            for impl in a.impls:
                if "prepared" in a.parts:
                    for procs in a.procs:  # one cache per size and library: a warm run follows the runs before
                        for cache in (("cold", "warm") if procs in a.cold_procs else ("warm",)):
                            save(run_one(impl, "prepared", n, procs, cache, a.folder, model, data))
                if "streaming" in a.parts:
                    save(run_one(impl, "streaming", n, 1, "cold", a.folder, model, data))
            if "cli" in a.parts and "hftrain" in a.impls:
                if n <= a.prepare_up_to:
                    for num_proc in (1, 2):
                        save(run_cli("prepare", n, a.folder, model, data, num_proc, cold=True))
                for what in ("check", "data"):
                    save(run_cli(what, n, a.folder, model, data, None, cold=False))
    results = json.load(open(RESULTS)) if os.path.exists(RESULTS) else []
    print(table(results))
    plot(results)


if __name__ == "__main__":
    main()
