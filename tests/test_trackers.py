"""Trackers (hftrain/trackers/): `training.report_to` checked before anything loads, and a run's whole record in one
tracker run, read back: MLflow on a real tracking server the test starts (127.0.0.1, a port the OS picks, SQLite
store), through MLflow's own client; W&B in offline mode, from the run files it writes. In both: the resolved recipe,
every logged step once from rank 0 of a 2-process run, hftrain's before/after figures, the same run again after a
resume, and no token anywhere."""

import json
import os
import re
import glob
import signal
import socket
import struct
import subprocess
import time

import pytest
import yaml

from hftrain.errors import RecipeError
from hftrain.launch import check_recipe
from hftrain.trackers.names import installed

from .conftest import DEMO_EVAL, DEMO_TRAIN, PY, run
from .support import free_port
from .test_bad_input import W

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402  (after the skip: MLflow is a test extra)

SERVER_START_S = 120
TOKEN = "hf_TrackerCanaryAbcdefghijklmnopqrstuv"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 and a port the OS picks (read from its log), its job runner off; ended by its
    process group."""
    folder = tmp_path_factory.mktemp("mlflow")
    log = open(folder / "server.log", "w+")
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    server = subprocess.Popen([os.path.join(os.path.dirname(PY), "mlflow"), "server", "--host", "127.0.0.1",
                               "--port", "0", "--workers", "1",
                               "--backend-store-uri", f"sqlite:///{folder / 'store.db'}",
                               "--artifacts-destination", str(folder / "artifacts")],
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{_port_when_up(server, folder / 'server.log')}"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()


def _port_when_up(server, log_path) -> int:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        said = re.search(r"running on http://127\.0\.0\.1:(\d+)", log_path.read_text())
        if said:
            return int(said.group(1))
        if server.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"mlflow server did not come up:\n{log_path.read_text()[-3000:]}")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def problems(w: W, report_to, monkeypatch, **env) -> list[str]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        check_recipe(w.recipe(lambda t: t["training"].update(report_to=report_to)))
    except RecipeError as e:
        return e.problems
    return []


def test_check_says_every_report_to_problem_before_anything_loads(tmp_path, tiny_model_dir, monkeypatch,
                                                                  mlflow_server):
    w = W(str(tmp_path), tiny_model_dir)
    assert problems(w, ["tensorboard", "mlflow"], monkeypatch, MLFLOW_TRACKING_URI=mlflow_server) == []
    assert problems(w, "none", monkeypatch) == [] and problems(w, ["none"], monkeypatch) == []
    [unknown] = problems(w, ["tensorboard", "nosuch"], monkeypatch)
    assert "training.report_to: 'nosuch' is not a tracker transformers reports to; one of: " in unknown
    [in_list] = problems(w, ["tensorboard", "none"], monkeypatch)
    assert "'none' is not a tracker" in in_list and "(alone, not in a list)" in in_list
    [every] = problems(w, "all", monkeypatch)
    assert "'all' turns on every tracker installed here (" in every and "mlflow" in every
    # MLflow's server down: named without the credentials in its URI.
    down = f"http://someone:{TOKEN}@127.0.0.1:{_closed_port()}"
    [no_server] = problems(w, ["mlflow"], monkeypatch, MLFLOW_TRACKING_URI=down)
    assert "'mlflow': MLFLOW_TRACKING_URI=http://127.0.0.1:" in no_server and "does not answer" in no_server
    assert TOKEN not in no_server and "someone" not in no_server


def test_check_names_a_tracker_not_installed_and_wandb_without_a_login(tmp_path, tiny_model_dir, monkeypatch):
    w = W(str(tmp_path), tiny_model_dir)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    found = problems(w, ["wandb", "clearml"], monkeypatch)
    if "wandb" not in installed():
        assert any("'wandb' is not installed here: pip install wandb" in p for p in found)
    else:
        assert any("'wandb' has no login here" in p for p in found)
        assert problems(w, ["wandb"], monkeypatch, WANDB_MODE="offline") == []
    assert any("'clearml' is not installed here" in p for p in found) and len(found) == 2


def recipe(tmp_path, model_dir, out, **training) -> str:
    tree = {"model": {"name_or_path": model_dir, "dtype": "float32"},
            "data": {"sources": [{"path": DEMO_TRAIN}], "eval_sources": [{"path": DEMO_EVAL}], "max_length": 48},
            "eval": {"exact_match": 8, "max_new_tokens": 12},
            "strategy": {"name": "ddp", "num_processes": 2, "main_process_port": free_port()},
            "training": {"output_dir": str(out), "max_steps": 4, "per_device_train_batch_size": 2,
                         "learning_rate": 3e-3, "logging_steps": 1, "save_steps": 2, "eval_strategy": "steps",
                         "eval_steps": 2, "seed": 0, "disable_tqdm": True,
                         "report_to": ["tensorboard", "mlflow", "wandb"], **training}}
    p = tmp_path / "recipe.yaml"
    p.write_text(yaml.safe_dump(tree))
    return str(p)


WANDB_BLOCK = 32768


def wandb_records(path: str) -> list:
    """The protobuf Records of an offline W&B run file (wandb 0.31 ships no Python reader of it): a 7-byte header,
    then LevelDB's log format, blocks of 32 KiB holding chunks of a 4-byte checksum, a 2-byte length, a 1-byte kind
    (1 whole, 2 first, 3 middle, 4 last) and the data."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, out = open(path, "rb").read(), 7, b"", []
    while position + 7 <= len(data):
        room = WANDB_BLOCK - position % WANDB_BLOCK
        _, length, kind = struct.unpack("<IHB", data[position:position + 7]) if room >= 7 else (0, 0, 0)
        if length == 0 and kind == 0:  # the rest of a block, padded
            position += room
            continue
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def item_key(item) -> str:
    """A history, summary or config item's name ("train/loss": a key, or its nested parts)."""
    return item.key or "/".join(item.nested_key)


def wandb_run_files(folder) -> list[list]:
    """Each offline run's records under WANDB_DIR `folder`, in the order they ran."""
    return [wandb_records(f) for f in sorted(glob.glob(os.path.join(folder, "wandb", "offline-run-*", "*.wandb")))]


def history(client, run_id, key) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def everything_stored(client, run) -> str:
    """Every param, tag, metric name and artifact text of a run, as one string."""
    texts = [json.dumps(run.data.params), json.dumps(run.data.tags), json.dumps(sorted(run.data.metrics))]
    for folder in ("", *[a.path for a in client.list_artifacts(run.info.run_id) if a.is_dir]):
        for a in client.list_artifacts(run.info.run_id, folder or None):
            if not a.is_dir:
                with open(client.download_artifacts(run.info.run_id, a.path), encoding="utf-8") as f:
                    texts.append(f.read())
    return "\n".join(texts)


@pytest.mark.launches
def test_a_two_process_run_and_its_resume_land_in_one_tracker_run(tmp_path, tiny_model_dir, mlflow_server):
    out = tmp_path / "out"
    env = {"MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_EXPERIMENT_NAME": f"two-ranks-{tmp_path.name}",
           "HF_TOKEN": TOKEN, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), "WANDB_PROJECT": "two",
           "WANDB_SILENT": "true"}
    (tmp_path / "wandb").mkdir()
    r = run([PY, "-m", "hftrain.cli", "launch", recipe(tmp_path, tiny_model_dir, out)], env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    first_recipe = (out / "recipe.yaml").read_text()
    r2 = run([PY, "-m", "hftrain.cli", "launch", recipe(tmp_path, tiny_model_dir, out), "training.max_steps=6",
              "training.resume_from_checkpoint=true"], env=env, timeout=600)
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert "Changing param values is not allowed" not in r2.stdout + r2.stderr

    client = MlflowClient(mlflow_server)
    [tracked] = client.search_runs([client.get_experiment_by_name(env["MLFLOW_EXPERIMENT_NAME"]).experiment_id])
    assert tracked.info.status == "FINISHED"
    runs = json.loads((out / "trackers.json").read_text())
    assert runs["mlflow"] == {"tracking_uri": mlflow_server, "run_id": tracked.info.run_id}
    # Every step's loss once (rank 0 alone reports), the values the run's own log holds, across the resume.
    state = json.loads((out / "trainer_state.json").read_text())
    logged = [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 6]
    tracked_loss = history(client, tracked.info.run_id, "loss")
    assert [s for s, _ in tracked_loss] == [s for s, _ in logged]
    assert [v for _, v in tracked_loss] == pytest.approx([v for _, v in logged], rel=1e-6)
    # hftrain's before/after figures, as run_info.json has them; the final evaluation in this run.
    info = json.loads((out / "run_info.json").read_text())["metrics"]
    figures = {k: v for k, v in info.items() if k.startswith(("initial_", "final_"))}
    assert {"initial_exact_match", "final_exact_match", "initial_eval_loss", "final_eval_loss"} <= set(figures)
    assert {k: tracked.data.metrics[k] for k in figures} == pytest.approx(figures, rel=1e-6)
    assert tracked.data.metrics["eval_loss"] == pytest.approx(info["final_eval_loss"], rel=1e-6)
    # The resolved recipe of the first start as params and artifact; the resume's recipe beside it.
    params = tracked.data.params
    assert params["recipe.model.name_or_path"] == tiny_model_dir and params["recipe.training.max_steps"] == "4"
    assert params["max_steps"] == "4"  # transformers' own params, kept from the first start
    with open(client.download_artifacts(tracked.info.run_id, "recipe.yaml"), encoding="utf-8") as f:
        assert f.read() == first_recipe
    resumed = client.download_artifacts(tracked.info.run_id, "resumed-from-checkpoint-4/recipe.yaml")
    assert yaml.safe_load(open(resumed))["training"]["max_steps"] == 6
    assert TOKEN not in everything_stored(client, tracked)
    check_wandb(tmp_path / "wandb", runs["wandb"], logged, figures, yaml.safe_load(first_recipe))


def check_wandb(folder, recorded, logged, figures, first_recipe):
    """W&B: one offline run per launch (rank 0 alone), both the same run; the steps, figures and recipe as above."""
    pieces = wandb_run_files(folder)
    assert len(pieces) == 2 and recorded["project"] == "two"
    for records in pieces:
        [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert (run.run_id, run.project) == (recorded["run_id"], "two")
    config = [{item_key(u): json.loads(u.value_json) for u in r.run.config.update}
              for records in pieces for r in records if r.WhichOneof("record_type") == "run"]
    assert config[0]["recipe"] == first_recipe and config[0]["recipe"]["training"]["max_steps"] == 4
    steps = [{item_key(i): json.loads(i.value_json) for i in r.history.item} for records in pieces for r in records
             if r.WhichOneof("record_type") == "history"]
    tracked = [(h["train/global_step"], h["train/loss"]) for h in steps if "train/loss" in h]
    assert [s for s, _ in tracked] == [s for s, _ in logged]
    assert [v for _, v in tracked] == pytest.approx([v for _, v in logged], rel=1e-6)
    summary = {item_key(u): json.loads(u.value_json) for r in pieces[-1] if r.WhichOneof("record_type") == "summary"
               for u in r.summary.update}
    assert {k: summary[k] for k in figures} == pytest.approx(figures, rel=1e-6)
    for path in glob.glob(os.path.join(folder, "**", "*"), recursive=True):
        if os.path.isfile(path):
            assert TOKEN.encode() not in open(path, "rb").read(), path


def test_without_hftrains_run_the_final_evaluation_starts_a_second_mlflow_run(tmp_path, tiny_model_dir,
                                                                              mlflow_server, monkeypatch):
    """The control: transformers' MLflowCallback alone ends its run with train(), so an evaluation after it (as every
    hftrain run does) lands in a run of its own, the split the test above would see without trackers/runs.py."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"control-{tmp_path.name}")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = [{"input_ids": [2, 10, 20, 30], "labels": [2, 10, 20, 30]}] * 4
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2,
                             report_to=["mlflow"], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows)
    trainer.train()
    trainer.evaluate()
    mlflow.end_run()
    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name(f"control-{tmp_path.name}").experiment_id])
    assert len(runs) == 2
