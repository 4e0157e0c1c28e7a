"""Hub push end to end over HTTP: a Hub-compatible server on 127.0.0.1, the real huggingface_hub client, real runs.

The server implements only what `HfApi.create_repo`, `create_branch` and `upload_folder` call: /api/repos/create,
.../branch/{rev}, .../preupload/{rev}, the NDJSON .../commit/{rev} and /api/validate-yaml (the card's metadata). It
answers "regular" upload mode for every file, so contents arrive base64 in the commit (an "lfs" answer would send
weights through the Xet storage protocol, which hf_xet speaks and this server does not).
"""

import base64
import hashlib
import json
import os
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

import pytest
import torch
import yaml

from hftrain.errors import HubError
from hftrain.hub.checks import validate_folder
from hftrain.hub.push import STAGE_DIR, push
from hftrain.hub.stage import STAGE_MARKER
from hftrain.config import HubSection, RecipeError
from hftrain.methods import load_recipe
from tests.exactness import within
from tests.support import free_port

from .conftest import ACCELERATE_LAUNCH, DEMO_EVAL, DEMO_TRAIN, PY, REPO, run

TOKEN = "hf_TestOnlyTokenAbcdefghijklmnopqrstuvwx"  # shaped like a real token, so the pattern scan sees it too
REPO_PATH = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<op>preupload|commit|branch)/(?P<rev>.+)$")


class FakeHub:
    """Repositories in memory: repos[repo_id] = {"private": bool, "branches": {name: {path: bytes}}}."""

    def __init__(self):
        self.repos: dict = {}
        self.requests: list = []  # (method, path, headers, body)
        self.fail_commits = 0  # answer this many commit POSTs with 500 (float("inf"): until reset)
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with hub.lock:
                    hub.requests.append(("POST", self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    status, payload = hub.handle(urlparse(self.path).path, body, self.headers.get("Authorization"))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status >= 500:
                    self.send_header("Retry-After", "0")  # the client's own backoff then waits 1 s, not 1..8 s
                if status == 404:
                    self.send_header("X-Error-Code", "RepoNotFound")
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, path: str, body: bytes, auth: str | None):
        if path != "/api/validate-yaml" and auth != f"Bearer {TOKEN}":
            return 401, {"error": "Invalid credentials in Authorization header"}
        if path == "/api/repos/create":
            req = json.loads(body)
            repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
            self.repos[repo_id] = {"private": req.get("visibility") == "private", "branches": {"main": {}}}
            return 200, {"url": f"{self.url}/{repo_id}"}
        if path == "/api/validate-yaml":  # upload_folder checks README.md's metadata first
            try:
                meta = yaml.safe_load(json.loads(body)["content"].split("---")[1])
                assert isinstance(meta, dict) and isinstance(meta.get("tags", []), list)
            except Exception as e:
                return 400, {"errors": [{"message": f"invalid metadata: {e}"}]}
            return 200, {"warnings": []}
        m = REPO_PATH.match(path)
        if not m or m["repo"] not in self.repos:
            return 404, {"error": "Repository not found"}
        repo, rev = self.repos[m["repo"]], unquote(m["rev"])
        if m["op"] == "branch":
            if rev in repo["branches"]:
                return 409, {"error": "Branch already exists"}
            repo["branches"][rev] = dict(repo["branches"]["main"])
            return 200, {}
        if rev not in repo["branches"]:
            return 404, {"error": f"Invalid rev id: {rev}"}
        if m["op"] == "preupload":
            files = json.loads(body)["files"]
            return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
        if self.fail_commits > 0:
            self.fail_commits -= 1
            return 500, {"error": "Internal Error - We're working hard to fix this as soon as possible!"}
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        assert lines[0]["key"] == "header"
        for item in lines[1:]:
            assert item["key"] == "file" and item["value"]["encoding"] == "base64", item["key"]
            repo["branches"][rev][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
        oid = hashlib.sha1(body).hexdigest()
        return 200, {"commitUrl": f"{self.url}/{m['repo']}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}

    def files(self, repo_id: str, branch: str = "main") -> dict:
        return self.repos[repo_id]["branches"][branch]

    def count(self, op: str) -> int:
        return sum(1 for r in self.requests if f"/{op}/" in r[1])

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def hub():
    server = FakeHub()
    yield server
    server.close()


def hub_env(hub, tmp_path, token=TOKEN) -> dict:
    # HF_HOME points at an empty folder: no stored login on this machine interferes.
    return {"HF_ENDPOINT": hub.url, "HF_TOKEN": token, "HF_HOME": str(tmp_path / "hf_home"),
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def recipe_file(tmp_path, model_dir, out, **sections) -> str:
    tree = {
        "model": {"name_or_path": model_dir, "dtype": "float32"},
        "data": {"sources": [{"path": DEMO_TRAIN}], "eval_sources": [{"path": DEMO_EVAL}], "max_length": 48},
        "training": {"output_dir": str(out), "max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 3e-3,
                     "logging_steps": 1, "save_strategy": "no", "seed": 0, "disable_tqdm": True, "report_to": "none",
                     "eval_strategy": "steps", "eval_steps": 3},
        **sections,
    }
    p = tmp_path / f"recipe-{os.path.basename(str(out))}.yaml"
    p.write_text(yaml.safe_dump(tree))
    return str(p)


def tree_digest(folder) -> dict:
    """sha256 of every file under folder except the staged upload: 'local artifacts unchanged' made checkable."""
    out = {}
    for root, _, files in os.walk(folder):
        if STAGE_DIR in os.path.relpath(root, folder).split(os.sep):
            continue
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def staged_files(folder) -> list[str]:
    """The files of a stage that are uploaded: all but hftrain's marker (STAGE_MARKER, which says the folder is
    hftrain's own to replace)."""
    return sorted(f for f in os.listdir(folder) if f != STAGE_MARKER)


def assert_received_equals_staged(received: dict, staged_dir):
    staged = {f: open(os.path.join(staged_dir, f), "rb").read() for f in staged_files(staged_dir)}
    assert sorted(received) == sorted(staged)
    for f in staged:
        assert received[f] == staged[f], f


def probe_equal(folder, info, label=""):
    from transformers import AutoModelForCausalLM

    from hftrain.constants import PROBE_IDS

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor(PROBE_IDS) % model.config.vocab_size
    with torch.no_grad():
        within("hub.pushed_vs_run.probe_logits", model(input_ids=ids).logits, torch.tensor(info["probe_logits"]),
               label=label)


@pytest.fixture(scope="module")
def pushed_run(tmp_path_factory, tiny_model_dir, hub):
    """A real single-process run whose recipe has hub.push: the script itself validates and uploads."""
    tmp = tmp_path_factory.mktemp("pushed")
    out = tmp / "out"
    rec = recipe_file(tmp, tiny_model_dir, out, hub={"push": True, "repo_id": "me/tiny-sft", "license": "apache-2.0",
                                                      "commit_message": "first push"})
    r = run([PY, "recipes/sft.py", rec], env=hub_env(hub, tmp))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r


@pytest.mark.launches
def test_run_pushes_exactly_the_validated_folder(pushed_run, hub, tmp_path):
    from huggingface_hub import ModelCard

    out, r = pushed_run
    assert f"hftrain: pushed {len(staged_files(out / STAGE_DIR))} files to me/tiny-sft" in r.stdout, r.stdout[-2000:]
    received = hub.files("me/tiny-sft")
    assert_received_equals_staged(received, out / STAGE_DIR)
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja",
            "README.md", "curves.png", "recipe.yaml", "run_info.json", "ddp.yaml"} <= set(received)
    assert "training_args.bin" not in received  # a pickle stays local
    # The weights received reload with the logits the run recorded.
    for f, data in received.items():
        (tmp_path / f).write_bytes(data)
    info = json.loads(received["run_info.json"])
    probe_equal(tmp_path, info, label="one process")

    # The card: metadata, the resolved recipe, the generated launcher config, the final metrics, the curves.
    card = ModelCard(received["README.md"].decode())
    assert "hftrain" in card.data.tags and card.data.library_name == "transformers"
    assert card.data.license == "apache-2.0" and card.data.pipeline_tag == "text-generation"
    assert received["recipe.yaml"].decode().strip() in card.text
    assert received["ddp.yaml"].decode().strip() in card.text
    assert f"| final_eval_loss | {info['metrics']['final_eval_loss']:.4g} |" in card.text
    assert f"| train_loss | {info['metrics']['train_loss']:.4g} |" in card.text
    assert "![Loss, learning rate and throughput against the step](curves.png)" in card.text
    assert "world size: 1 process" in card.text

    # The token went to the server in the Authorization header, and nowhere else.
    posts = [req for req in hub.requests if "me/tiny-sft" in req[1] or b"tiny-sft" in req[3]]
    assert posts and all(req[2].get("authorization") == f"Bearer {TOKEN}" for req in posts)
    assert not any(TOKEN.encode() in req[3] for req in hub.requests)
    assert TOKEN not in r.stdout + r.stderr
    for root, _, files in os.walk(out):
        for f in files:
            assert TOKEN.encode() not in open(os.path.join(root, f), "rb").read(), f
    assert hub.repos["me/tiny-sft"]["private"] is False


@pytest.mark.launches
def test_a_preference_run_pushes_itself_with_its_stage_on_the_card(tiny_model_dir, hub, tmp_path):
    """recipes/dpo.py with hub.push: the token checked before training, the folder validated and uploaded after; the
    card says the model was preference-tuned from its base."""
    pairs = os.path.join(REPO, "data", "demo", "preference_train.jsonl")
    out = tmp_path / "out"
    rec = recipe_file(tmp_path, tiny_model_dir, out, preference={"beta": 0.1},
                      eval={"exact_match": 0}, hub={"push": True, "repo_id": "me/tiny-dpo"})
    tree = yaml.safe_load(open(rec))
    tree["data"] = {"sources": [{"path": pairs}], "max_length": 48}
    tree["training"].update(eval_strategy="no", per_device_train_batch_size=2)
    open(rec, "w").write(yaml.safe_dump(tree))
    r = run([PY, "recipes/dpo.py", rec], env=hub_env(hub, tmp_path, token=""))
    assert r.returncode == 2 and "no Hugging Face token found" in r.stderr, r.stderr[-2000:]
    assert not (out / "model.safetensors").exists()  # refused before training
    r = run([PY, "recipes/dpo.py", rec], env=hub_env(hub, tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    received = hub.files("me/tiny-dpo")
    assert {"model.safetensors", "README.md", "recipe.yaml"} <= set(received)
    card = received["README.md"].decode()
    assert "preference tuning (sigmoid loss, beta=0.1)" in card and tiny_model_dir in card, card[:2000]
    assert TOKEN not in card


@pytest.mark.launches
def test_cli_dry_run_needs_no_token_and_a_push_without_one_stages_nothing(pushed_run, hub, tmp_path):
    out, _ = pushed_run
    env = hub_env(hub, tmp_path, token="")
    n = len(hub.requests)
    stage = tmp_path / "dry"
    r = run([PY, "-m", "hftrain.cli", "push", str(out), "--repo-id", "me/dry", "--dry-run", "--stage-dir", str(stage)],
            env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    listed = r.stdout.split("files): ")[1].splitlines()[0].split(", ")
    assert listed == staged_files(stage) and "model.safetensors" in listed
    stage2 = tmp_path / "nope"
    r = run([PY, "-m", "hftrain.cli", "push", str(out), "--repo-id", "me/nope", "--stage-dir", str(stage2)], env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "hftrain: error: no Hugging Face token found: set HF_TOKEN" in r.stderr
    assert not stage2.exists() and len(hub.requests) == n  # refused before staging, nothing sent


@pytest.mark.launches
def test_cli_push_to_a_private_branch(pushed_run, hub, tmp_path):
    out, _ = pushed_run
    cmd = [PY, "-m", "hftrain.cli", "push", str(out), "--repo-id", "me/branchy", "--private", "--revision", "dev",
           "--commit-message", "from the cli"]
    r = run(cmd, env=hub_env(hub, tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert TOKEN not in r.stdout + r.stderr
    assert hub.repos["me/branchy"]["private"] is True
    assert hub.files("me/branchy", "main") == {}
    assert_received_equals_staged(hub.files("me/branchy", "dev"), out / STAGE_DIR)


@pytest.mark.launches
def test_server_error_mid_upload_retries_then_fails_clearly_and_a_rerun_succeeds(pushed_run, hub, monkeypatch, capsys):
    out, _ = pushed_run
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    before = tree_digest(out)
    hub.fail_commits = float("inf")
    commits = hub.count("commit")
    target = HubSection(repo_id="me/flaky", revision="v1")
    with pytest.raises(HubError) as e:
        push(str(out), target, endpoint=hub.url, attempts=2, backoff_s=0.1)
    msg = str(e.value)
    assert "pushing to me/flaky failed 2 times" in msg and "500" in msg
    assert f"Run `hftrain push {out} --repo-id me/flaky --revision v1` again" in msg
    # Each attempt is one upload_folder, whose commit POST huggingface_hub itself retries 5 times on a 5xx.
    assert hub.count("commit") - commits == 2 * 6
    assert hub.files("me/flaky", "v1") == {}  # the repository and branch exist, nothing was committed
    assert tree_digest(out) == before  # local artifacts unchanged
    assert sorted(os.listdir(out / STAGE_DIR))  # the validated upload is still there

    hub.fail_commits = 0  # the server recovers: the same call again succeeds
    url = push(str(out), target, endpoint=hub.url, attempts=2, backoff_s=0.1)
    assert url.startswith(f"{hub.url}/me/flaky/commit/")
    assert_received_equals_staged(hub.files("me/flaky", "v1"), out / STAGE_DIR)
    assert tree_digest(out) == before
    captured = capsys.readouterr()
    assert "push attempt 1/2 failed" in captured.out
    assert TOKEN not in captured.out + captured.err + msg


@pytest.mark.launches
def test_a_refused_token_is_not_retried(pushed_run, hub, monkeypatch):
    out, _ = pushed_run
    monkeypatch.setenv("HF_TOKEN", "hf_WrongTokenAbcdefghijklmnopqrstuvwxyz")
    n = len(hub.requests)
    with pytest.raises(HubError, match="the Hub refused the token for me/denied .*401.*write access"):
        push(str(out), HubSection(repo_id="me/denied"), endpoint=hub.url, backoff_s=0.05)
    assert [r[1] for r in hub.requests[n:]] == ["/api/repos/create"]  # one try, then the clear error


@pytest.mark.launches
def test_unreachable_hub_fails_after_bounded_retries(pushed_run, monkeypatch):
    out, _ = pushed_run
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(HubError, match="pushing to me/x failed 3 times; last error: .*Nothing local changed"):
        push(str(out), HubSection(repo_id="me/x"), endpoint=f"http://127.0.0.1:{free_port()}", backoff_s=0.05)


# ---------------------------------------------------------------------------------------------------------------
# Validation refusals


def copy_run(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(STAGE_DIR))
    return dst


@pytest.mark.launches
def test_validation_refuses_an_empty_shard_and_nothing_is_uploaded(pushed_run, hub, tmp_path, monkeypatch):
    out = copy_run(pushed_run[0], tmp_path / "run")
    assert validate_folder(str(out)) == []  # the real run is fit to push
    (out / "model.safetensors").write_bytes(b"")
    problems = validate_folder(str(out))
    assert len(problems) == 1 and problems[0].startswith("model.safetensors: empty file (0 bytes)")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    n = len(hub.requests)
    with pytest.raises(HubError, match="refusing to push .*nothing uploaded:\n  - model.safetensors: empty file"):
        push(str(out), HubSection(repo_id="me/empty"), endpoint=hub.url)
    assert len(hub.requests) == n and "me/empty" not in hub.repos
    assert not (out / STAGE_DIR).exists()


@pytest.mark.launches
def test_validation_refuses_shape_mismatches(pushed_run, tmp_path):
    from safetensors.torch import load_file, save_file

    out = copy_run(pushed_run[0], tmp_path / "run")
    w = load_file(str(out / "model.safetensors"))
    w["model.layers.0.mlp.up_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"][:-1]
    w["model.layers.1.self_attn.q_proj.weight"] = torch.empty(0)  # what an unconsolidated ZeRO-3 save holds
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    problems = validate_folder(str(out))
    assert problems[0] == "model.layers.0.mlp.up_proj.weight: saved shape [63, 32], the config needs [64, 32]"
    assert problems[1].startswith("model.layers.1.self_attn.q_proj.weight: saved shape [0], the config needs [32, 32]")
    assert "unconsolidated" in problems[1] and len(problems) == 2


@pytest.mark.launches
def test_validation_refuses_missing_tokenizer_chat_template_and_eos(pushed_run, tmp_path):
    out = copy_run(pushed_run[0], tmp_path / "run")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(out / f)
    problems = validate_folder(str(out))
    assert len(problems) == 1 and problems[0].startswith(f"no tokenizer in {out} (tokenizer.json")

    out = copy_run(pushed_run[0], tmp_path / "run2")
    os.remove(out / "chat_template.jinja")
    cfg = json.loads((out / "generation_config.json").read_text())
    cfg.pop("eos_token_id")
    (out / "generation_config.json").write_text(json.dumps(cfg))
    problems = validate_folder(str(out))
    assert any(p.startswith("generation_config.json has no eos_token_id") for p in problems), problems
    assert any("has no chat template" in p for p in problems), problems


@pytest.mark.launches
def test_a_pasted_token_is_refused(pushed_run, hub, tmp_path, monkeypatch):
    out = copy_run(pushed_run[0], tmp_path / "run")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with open(out / "chat_template.jinja", "a") as fh:
        fh.write("{# push with hf_PastedByMistake0123456789abcdefghij #}\n")
    with pytest.raises(HubError, match="chat_template.jinja contains a Hugging Face token"):
        push(str(out), HubSection(repo_id="me/leak"), dry_run=True)


@pytest.mark.launches
def test_only_what_a_model_repository_needs_is_staged(pushed_run, tmp_path, monkeypatch):
    """An allow-list, not a list of suffixes: credentials, keys and stray files in output_dir stay local."""
    out = copy_run(pushed_run[0], tmp_path / "run")
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    for name in ("credentials.json", "id_rsa", ".secrets.yaml", "notes.txt", "modeling_evil.py"):
        (out / name).write_text("secret\n")
    stage = push(str(out), HubSection(repo_id="me/clean"), dry_run=True)
    staged = set(staged_files(stage))
    assert {"model.safetensors", "config.json", "tokenizer.json", "recipe.yaml", "README.md"} <= staged
    assert not staged & {"credentials.json", "id_rsa", ".secrets.yaml", "notes.txt", "modeling_evil.py",
                         "training_args.bin"}


@pytest.mark.parametrize("secret, what", [
    ("-----BEGIN OPENSSH PRIVATE KEY----- b3BlbnNzaC1rZXk=\n", "a private key"),
    ("aws_access_key_id = AKIAIOSFODNN7EXAMPLE\n", "an AWS access key"),
    ("token: ghp_abcdefghijklmnopqrstuvwxyz0123456789AB\n", "a GitHub token"),
])
@pytest.mark.launches
def test_secrets_of_other_kinds_are_refused(pushed_run, tmp_path, monkeypatch, secret, what):
    out = copy_run(pushed_run[0], tmp_path / "run")
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with open(out / "recipe.yaml", "a") as fh:
        fh.write("# " + secret)
    with pytest.raises(HubError, match=f"recipe.yaml contains {what}"):
        push(str(out), HubSection(repo_id="me/leak"), dry_run=True)


@pytest.mark.launches
def test_a_symlink_is_never_followed(pushed_run, tmp_path, monkeypatch):
    out = copy_run(pushed_run[0], tmp_path / "run")
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    os.remove(out / "run_info.json")
    os.symlink("/etc/passwd", out / "run_info.json")
    with pytest.raises(HubError, match=r"run_info.json is a symbolic link \(to /etc/passwd\)"):
        push(str(out), HubSection(repo_id="me/leak"), dry_run=True)


# ---------------------------------------------------------------------------------------------------------------
# LoRA


def test_zero_lora_adapter_is_refused(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear"))
    model.save_pretrained(tmp_path / "adapter")  # untrained: peft initialises lora_B to zero
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "adapter")
    problems = validate_folder(str(tmp_path / "adapter"))
    assert len(problems) == 1 and "is all zeros (lora_B everywhere)" in problems[0]


@pytest.mark.launches
def test_lora_adapter_and_merged_pushes(tiny_model_dir, hub, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "lora"
    rec = recipe_file(tmp_path, tiny_model_dir, out, training={
        "output_dir": str(out), "max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 5e-2,
        "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "seed": 0, "logging_steps": 1})
    r = run([PY, "recipes/sft.py", rec, "model.lora.r=4", "model.lora.merge=true"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The adapter validates, including base + adapter == merged.
    assert validate_folder(str(out), merged=str(out / "merged")) == []
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    push(str(out), HubSection(repo_id="me/tiny-lora"), endpoint=hub.url)
    received = hub.files("me/tiny-lora")
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(received)
    assert "model.safetensors" not in received and "peft" in received["README.md"].decode().split("---")[1]
    push(str(out), HubSection(repo_id="me/tiny-merged", merge_lora=True), endpoint=hub.url)
    received = hub.files("me/tiny-merged")
    assert "model.safetensors" in received and "adapter_model.safetensors" not in received
    assert received["model.safetensors"] == (out / "merged" / "model.safetensors").read_bytes()

    # A merged model that is not base + this adapter is refused.
    w = load_file(str(out / "merged" / "model.safetensors"))
    w["model.layers.0.mlp.down_proj.weight"] += 0.5
    save_file(w, str(out / "merged" / "model.safetensors"), metadata={"format": "pt"})
    problems = validate_folder(str(out), merged=str(out / "merged"))
    assert len(problems) == 1 and "does not match base + adapter" in problems[0]


# ---------------------------------------------------------------------------------------------------------------
# The recipe's hub: section


BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}}


def test_recipe_hub_section_rules():
    r = load_recipe(None, ["hub.push=true", "hub.repo_id=me/model", "hub.private=true"], raw=dict(BASE))
    assert r.hub == HubSection(push=True, repo_id="me/model", private=True)
    assert "hub:" in r.to_yaml()
    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["hub.push=true", "hub.token=hf_secret", "hub.merge_lora=true", "training.push_to_hub=true"],
                    raw=dict(BASE))
    msg = str(e.value)
    assert "hub.token: not accepted here: the Hub token is read from HF_TOKEN or `hf auth login`" in msg
    assert "hub.repo_id: hub.push is true but no repository is named" in msg
    assert "hub.merge_lora: needs a LoRA run (model.lora)" in msg
    assert "training.push_to_hub: not accepted here: set hub.push: true" in msg
    assert "hf_secret" not in msg
    with pytest.raises(RecipeError, match="hub.repo_id: 'me/a/b' is not a repository id"):
        load_recipe(None, ["hub.repo_id=me/a/b"], raw=dict(BASE))


@pytest.mark.launches
def test_a_run_that_will_push_without_a_token_stops_before_training(tiny_model_dir, tmp_path):
    rec = recipe_file(tmp_path, tiny_model_dir, tmp_path / "out", hub={"push": True, "repo_id": "me/m"})
    r = run([PY, "recipes/sft.py", rec], env={"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf_home")})
    assert r.returncode == 2 and "no Hugging Face token found" in r.stderr and "(hub.push is true)" in r.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-3 on 2 ranks


@pytest.mark.launches
def test_zero3_two_ranks_pushes_full_weights_that_reload_with_equal_logits(tiny_model_dir, hub, tmp_path,
                                                                           deepspeed_ops):
    from safetensors import safe_open

    out = tmp_path / "z3"
    cmd = [*ACCELERATE_LAUNCH, "--config_file", "accelerate_configs/zero3.yaml", "--main_process_port",
           str(free_port()), "recipes/sft.py", os.path.join(REPO, "recipes/demo/sft.yaml"),
           f"model.name_or_path={tiny_model_dir}", f"data.sources.0.path={DEMO_TRAIN}", "data.eval_sources=[]",
           "training.eval_strategy=no", "eval.exact_match=0", f"training.output_dir={out}", "training.max_steps=3",
           "training.per_device_train_batch_size=4", "training.report_to=none", "training.logging_steps=1",
           "strategy.name=zero3", "hub.push=true", "hub.repo_id=me/tiny-zero3"]
    r = run(cmd, timeout=600, env=hub_env(hub, tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    assert r.stdout.count("hftrain: pushed") == 1  # the main process only
    received = hub.files("me/tiny-zero3")
    assert_received_equals_staged(received, out / STAGE_DIR)
    info = json.loads(received["run_info.json"])
    assert info["world_size"] == 2 and info["zero_stage"] == 3
    for f, data in received.items():
        (tmp_path / "reload").mkdir(exist_ok=True)
        (tmp_path / "reload" / f).write_bytes(data)
    # Full-size tensors: every one has the shape of the base model's (no empty ZeRO partitions).
    with safe_open(str(tmp_path / "reload" / "model.safetensors"), "pt") as got, \
            safe_open(os.path.join(tiny_model_dir, "model.safetensors"), "pt") as ref:
        assert set(got.keys()) == set(ref.keys())
        for k in ref.keys():
            assert got.get_slice(k).get_shape() == ref.get_slice(k).get_shape(), k
    probe_equal(tmp_path / "reload", info, label="zero3")
    card = received["README.md"].decode()
    assert "strategy: `zero3` (wrapper DeepSpeedEngine, zero_stage 3" in card and "world size: 2 process(es)" in card
    assert received["zero3.json"].decode().strip() in card


# -- the stage folder: hftrain removes only what it made (issue 33, point 1) ------------------------------------------
def _cli_dry_run(out, stage, capsys) -> tuple[int, str]:
    """`hftrain push OUT --dry-run --stage-dir STAGE` in this process: (exit status, stderr)."""
    from hftrain.cli import main

    try:
        code = main(["push", str(out), "--repo-id", "me/stage", "--dry-run", "--stage-dir", str(stage)])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.launches
def test_a_dry_run_never_deletes_a_folder_it_did_not_stage(pushed_run, tmp_path, capsys):
    """--stage-dir pointed at the run itself, at its parent, at a checkpoint-like folder or at a folder of the user's:
    refused with exit 2 before anything is written; every file there is as it was."""
    out, _ = pushed_run
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for stage in (out, out.parent, mine):
        before = tree_digest(out.parent)
        code, err = _cli_dry_run(out, stage, capsys)
        assert code == 2 and "Traceback" not in err, err[-2000:]
        assert f"--stage-dir {stage} holds files hftrain did not stage" in err, err[-2000:]
        assert tree_digest(out.parent) == before and (mine / "notes.txt").read_text() == "keep me"


@pytest.mark.launches
def test_a_stage_of_its_own_is_replaced_and_a_stage_with_added_files_is_not(pushed_run, tmp_path, capsys):
    out, _ = pushed_run
    stage = tmp_path / "stage"
    beside = tmp_path / "stage.partial"  # a folder of the user's that an older stage path (DIR.partial) would remove
    beside.mkdir()
    (beside / "data.txt").write_text("mine")
    for _ in range(2):  # a new folder, then the stage it wrote itself: replaced
        code, err = _cli_dry_run(out, stage, capsys)
        assert code == 0, err[-2000:]
        assert "model.safetensors" in staged_files(stage) and STAGE_MARKER in os.listdir(stage)
    assert (beside / "data.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["stage", "stage.partial"]
    (stage / "my-notes.md").write_text("added by hand")
    code, err = _cli_dry_run(out, stage, capsys)
    assert code == 2 and "holds files added after hftrain staged it (my-notes.md)" in err, err
    assert (stage / "my-notes.md").read_text() == "added by hand"


@pytest.mark.launches
def test_a_stage_that_fails_validation_leaves_the_previous_stage(pushed_run, tmp_path, monkeypatch):
    out, _ = pushed_run
    stage = tmp_path / "stage"
    push(str(out), HubSection(repo_id="me/ok"), dry_run=True, stage_dir=str(stage))
    before = {f: (stage / f).read_bytes() for f in os.listdir(stage)}
    monkeypatch.setattr("hftrain.hub.push.validate_folder", lambda *a, **k: ["model.safetensors: broken"])
    with pytest.raises(HubError, match="model.safetensors: broken"):
        push(str(out), HubSection(repo_id="me/ok"), dry_run=True, stage_dir=str(stage))
    assert {f: (stage / f).read_bytes() for f in os.listdir(stage)} == before
    assert sorted(os.listdir(tmp_path)) == ["stage"]  # the failed attempt's own folder is gone
