import os

# The pytest workers (pytest-xdist) and the processes they launch share the machine's cores: one thread each (set
# before torch is first imported; `torch.distributed.run` sets the same for its ranks).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Each pytest process (and what it launches) has caches of its own, never ones another test, worker or earlier suite
# wrote (nor the user's): a Hugging Face home (datasets' cache, where hftrain keeps its prepared copies of sources;
# the modules of trust_remote_code models; no token stored on this machine) and torch.compile's cache. Set before
# the libraries are first imported: they read these at import. DeepSpeed's op cache stays shared on purpose (built
# once beside the suite: tests/op_build.py).
_CACHES = tempfile.mkdtemp(prefix="hftrain-tests-caches-")
os.environ["HF_HOME"] = os.path.join(_CACHES, "hf_home")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_CACHES, "torchinductor")
for _inherited in ("HF_DATASETS_CACHE", "HF_MODULES_CACHE", "HF_HUB_CACHE", "HF_TOKEN"):
    os.environ.pop(_inherited, None)
atexit.register(shutil.rmtree, _CACHES, ignore_errors=True)

import contextlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from hftrain.launch.machine import extensions_dir  # noqa: E402
from hftrain.launch.op_cache import build_locks  # noqa: E402
from scripts.build_deepspeed_ops import missing_ops  # noqa: E402
from tests import forked, frozen_heap, launch_log, op_build  # noqa: E402
from tests.support import LaunchTimedOut, free_port, session_processes  # noqa: E402
from tests.launch_log import pytest_configure  # noqa: E402, F401  (hook: the launch log, when asked for)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TRAIN = os.path.join(REPO, "data", "demo", "train.jsonl")
DEMO_EVAL = os.path.join(REPO, "data", "demo", "eval.jsonl")
PY = sys.executable
# `accelerate launch` of the interpreter running the tests (the venv need not be on PATH).
ACCELERATE_LAUNCH = [PY, "-m", "accelerate.commands.launch"]
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    out = str(tmp_path_factory.mktemp("tiny") / "base")
    build_tiny_model(out, texts_of_jsonl([DEMO_TRAIN]), config=SMALL, vocab_size=300, seed=0)
    return out


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory, request):
    """One 2-rank run per strategy for the session, shared by the modules and the xdist workers (tests/references.py):
    reference_runs(strategy) -> its output folder; reference_runs.model_dir the tiny model they trained."""
    from filelock import FileLock

    from hftrain.tiny import build_tiny_model, texts_of_jsonl
    from tests.references import ReferenceRuns, reference_recipe

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker has a base folder of its own: share their parent
        root = root.parent
    root = root / "references"
    root.mkdir(exist_ok=True)
    model_dir = root / "base"
    with FileLock(str(root / "base.lock")):
        if not (model_dir / "done").exists():
            build_tiny_model(str(model_dir), texts_of_jsonl([DEMO_TRAIN]), config=SMALL, vocab_size=300, seed=0)
            (model_dir / "done").touch()

    def launch(strategy, folder, out):
        if strategy.startswith("zero"):
            request.getfixturevalue("deepspeed_ops")
        rec = reference_recipe(folder, model_dir, out, DEMO_TRAIN, DEMO_EVAL)
        return run([*ACCELERATE_LAUNCH, "--config_file", f"accelerate_configs/{strategy}.yaml",
                           "--main_process_port", str(free_port()), "recipes/sft.py", rec, f"strategy.name={strategy}"],
                          timeout=600)

    return ReferenceRuns(str(root), str(model_dir), launch)


@pytest.fixture(autouse=True)
def _forget_modules_of_temporary_folders(tmp_path_factory):
    """A module a test wrote into its temporary folder and imported by name (a reward function, a tool, an
    environment: `my_tools:add`) is forgotten after the test, with the folder's place on sys.path: another test's
    module of the same name, in another folder, would otherwise be this one (an earlier test's envs.py made a later
    test's envs:NoReset 'no function')."""
    yield
    base = str(tmp_path_factory.getbasetemp())
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(base):
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if not p.startswith(base)]


@pytest.fixture(autouse=True)
def _environment_put_back():
    """Each test leaves os.environ as it found it. A library imported or run in the pytest process sets variables of
    its own (lm-eval's import HF_XET_HIGH_PERFORMANCE, its evaluation TORCHINDUCTOR_CACHE_DIR); left set, they would
    make every later launch of that worker a real process (tests/forked.py forks only under the environment the
    suite started with), where a worker script's `from tests import ...` fails and a test of the forked launch
    itself fails. Fixtures of a wider scope set theirs before this one looks."""
    environ = dict(os.environ)
    yield
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture
def in_process(monkeypatch):
    """For a recipe script's or the CLI's main(argv) run in the pytest process (a case whose process is not under
    test): the signal handlers and environment variables a run's set-up installs (setup_run) are put back afterwards,
    and the process's tear-down (distributed.shutdown: it would destroy a process group the test module holds) is
    left out."""
    from hftrain import distributed

    monkeypatch.setattr(distributed, "shutdown", lambda wait=True: None)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}
    environ = dict(os.environ)
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    os.environ.clear()
    os.environ.update(environ)


def uneven_data(path, n=24, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            k = rng.choice([1, 1, 2, 8, 12])  # very uneven completion lengths, hence target counts
            fh.write(json.dumps({"prompt": f"reverse: {' '.join(rng.choice('abc') for _ in range(3))} ->",
                                 "completion": " " + " ".join(rng.choice("abcdefghij") for _ in range(k))}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def spiky_model_dir(tmp_path_factory):
    """Like tiny_model_dir, with large initial weights: per-token losses differ a lot between examples (at the
    usual small init every token costs ~ln(vocab), and no averaging scheme can be told from another)."""
    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    out = str(tmp_path_factory.mktemp("spiky") / "base")
    return build_tiny_model(out, texts_of_jsonl([DEMO_TRAIN]), config={**SMALL, "initializer_range": 0.3},
                            vocab_size=300, seed=0)


def eval_token_mean_and_old(model_dir, eval_path):
    """Plain PyTorch, one example at a time: (sum of CE over every target / number of targets, and the old
    Trainer's number for an eval batch size: the mean over examples of their batch's mean)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftrain.config import DataSection, DataSource
    from hftrain.constants import IGNORE_INDEX
    from hftrain.data import build_datasets

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    data = build_datasets(DataSection(sources=[DataSource(path=eval_path)], max_length=64), tok)
    per_example = []
    with torch.no_grad():
        for ex in data.train:
            logits = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0, :-1]
            tgt = torch.tensor(ex["labels"][1:])
            m = tgt != IGNORE_INDEX
            per_example.append((float(torch.nn.functional.cross_entropy(logits[m], tgt[m], reduction="sum")),
                                int(m.sum())))
    ref = sum(s for s, _ in per_example) / sum(n for _, n in per_example)

    def old(batch_size):
        batches = [per_example[i:i + batch_size] for i in range(0, len(per_example), batch_size)]
        return sum(len(b) * sum(s for s, _ in b) / sum(n for _, n in b) for b in batches) / len(per_example)

    return ref, old


def eval_token_mean(model_dir, eval_path) -> float:
    return eval_token_mean_and_old(model_dir, eval_path)[0]


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# Every launch of the session (and its workers) finds DeepSpeed's ops in the cache hftrain uses.
EXTENSIONS = extensions_dir()
os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS)  # also for DeepSpeed used in-process and by other workers


def run(cmd: list[str], timeout: int = 300, env: dict | None = None, real: bool = False
        ) -> subprocess.CompletedProcess:
    """Run a command from the repository root; the output is printed on failure by the caller's assert.

    A launch whose launcher is not under test is played by a fork of a preloaded interpreter (tests/forked.py: the
    same accelerate launch code and scripts without 12-15 s of imports per process) where it can be; `real=True` (or
    HFTRAIN_TEST_FORKED=0 for the whole suite) gives a real process, for a test of the process itself: signals, its
    exit on a launcher's death, what it imports.

    A real command gets a process group of its own, killed whole on a time-out: killing only the launcher would
    leave its workers running (and holding CPU, ports or a DeepSpeed build lock) through the rest of the suite."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    if not real and os.environ.get("HFTRAIN_TEST_FORKED", "1") != "0" and forked.forkable(cmd, full_env):
        return _run_forked(cmd, timeout, full_env)
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            extensions = full_env.get("TORCH_EXTENSIONS_DIR", EXTENSIONS)
            processes, locks = session_processes(proc.pid), build_locks(extensions)
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise LaunchTimedOut(cmd, timeout, out, err, processes, locks) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run_forked(cmd: list[str], timeout: int, env: dict) -> subprocess.CompletedProcess:
    record, result = launch_log.started(["[forked]", *cmd]), None
    try:
        result = forked.launch(cmd, env, REPO, timeout)
    finally:
        launch_log.record(record, result.returncode if result is not None else -9,
                          getattr(result, "cpu_seconds", None))
    return result


def _section(text: str, name: str) -> str:
    """What the launch printed while variant `name` ran (after the worker's line naming it, until the next)."""
    parts = text.split("hftrain-matrix: variant ")
    return "".join(p.split("\n", 1)[-1] for p in parts[1:] if p.split("\n", 1)[0] == name)


def launch_prefix(world: int, strategy: str = "ddp") -> list[str]:
    """The command before a script: one process ([PY]), or accelerate's launch with the shipped config of `strategy`
    (2 processes) on a port of this worker's own."""
    if world == 1:
        return [PY]
    return [*ACCELERATE_LAUNCH, "--config_file", f"accelerate_configs/{strategy}.yaml", "--main_process_port",
            str(free_port())]


class VariantResult:
    """One variant of a matrix launch (tests/matrix_worker.py): its status on every rank and its part of the launch's
    standard output. `check()` fails the calling test under the variant's own name."""

    def __init__(self, name: str, statuses: list[dict | None], launch: subprocess.CompletedProcess):
        self.name, self.statuses, self.launch = name, statuses, launch
        self.stdout, self.stderr = (_section(text, name) for text in (launch.stdout, launch.stderr))

    @property
    def ok(self) -> bool:
        return all(s is not None and s["ok"] for s in self.statuses)

    def check(self) -> None:
        if self.ok:
            return
        not_run = "not run (an earlier variant of the launch failed, or the launch died)"
        errors = [f"rank {r}: " + (not_run if s is None else s["error"])
                  for r, s in enumerate(self.statuses) if not (s or {}).get("ok")]
        raise AssertionError(f"variant {self.name} of the matrix launch failed (exit {self.launch.returncode}):\n"
                             + "\n".join(errors) + "\n--- launch stdout ---\n" + self.launch.stdout[-3000:]
                             + "\n--- launch stderr ---\n" + self.launch.stderr[-4000:])


def run_matrix(launch: list[str], variants: dict[str, tuple[str, list[str]]], folder, ranks: int = 1,
               timeout: int = 600) -> dict[str, VariantResult]:
    """Run every variant {name: (module, argv)} in one launch: `launch` is the command before the script ([PY], or
    accelerate's launch with its config and port), `ranks` the processes it starts. Returns {name: VariantResult}."""
    os.makedirs(folder, exist_ok=True)
    plan = [{"name": name, "module": module, "argv": [str(a) for a in argv],
             "status": os.path.join(str(folder), f"{name}.status")} for name, (module, argv) in variants.items()]
    plan_path = os.path.join(str(folder), "matrix_plan.json")
    with open(plan_path, "w") as fh:
        json.dump(plan, fh, indent=1)
    r = run([*launch, "tests/matrix_worker.py", plan_path], timeout=timeout)
    out = {}
    for v in plan:
        statuses = []
        for rank in range(ranks):
            path = f"{v['status']}.rank{rank}.json"
            statuses.append(json.load(open(path)) if os.path.exists(path) else None)
        out[v["name"]] = VariantResult(v["name"], statuses, r)
    return out


def processes_mentioning(marker: str) -> dict[int, str]:
    """pid -> command line of every live process (zombies left out) whose command line contains `marker`: a /proc
    scan, so that workers are found whoever their parent is now (an orphan is re-parented)."""
    found = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != b"Z" and pid != os.getpid():
            found[pid] = cmdline
    return found


def assert_no_process_left(marker: str, within: float = 60.0) -> None:
    """Within `within` seconds no process mentioning `marker` (a run's recipe path) is alive. On failure the
    survivors are SIGKILLed (so that they do not go on writing through the rest of the suite) and named."""
    deadline = time.time() + within
    while (alive := processes_mentioning(marker)) and time.time() < deadline:
        time.sleep(0.2)
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes of the run still alive {within:.0f} s after its launcher ended: {alive}"


@pytest.fixture(scope="session")
def deepspeed_ops():
    """DeepSpeed's CPU ops must be built before the first DeepSpeed launch (scripts/setup.sh builds them): a build
    inside a test would run within that test's time-out, with two ranks racing for the build lock. Where
    scripts/test.sh builds them in the background (tests/op_build.py), this waits for that build to end."""
    waited = op_build.wait_for_background_build()
    missing = missing_ops(EXTENSIONS)
    if missing:
        pytest.fail(f"DeepSpeed op(s) {', '.join(missing)} not built in {EXTENSIONS} (waited {waited:.0f} s for the "
                    "background build): run `.venv/bin/python scripts/build_deepspeed_ops.py` (scripts/setup.sh does)"
                    + op_build.build_log_tail(), pytrace=False)


def pytest_collection_finish(session):
    """The test modules are imported: their heap frozen, so that the full collections tests make (each refused run's
    shutdown, accelerate's free_memory) or the collector makes do not walk it (tests/frozen_heap.py)."""
    frozen_heap.freeze()


def pytest_collection_modifyitems(session, config, items):
    """Where scripts/test.sh started a background build of DeepSpeed's ops, the cluster tier (one process) runs the
    tests that need them last (tests/op_build.py)."""
    if op_build.background_build_started() and not getattr(config.option, "numprocesses", None):
        items[:] = op_build.tests_needing_ops_last(items)
