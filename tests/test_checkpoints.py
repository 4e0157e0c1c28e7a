"""Atomic checkpoints, in one process: an interrupted save leaves nothing that resume would pick, resume picks the
newest complete checkpoint, and a disk that fills during a save fails it cleanly (on a small tmpfs)."""

import json
import os
import shutil
import subprocess

import pytest
import yaml

from hftrain import checkpoints
from hftrain.checkpoints import CheckpointError, checkpoint_problem, newest_complete, resolve_resume
from hftrain.checkpoints.manifest import MANIFEST, write_manifest

from .conftest import DEMO_TRAIN, PY, run
from .exactness import beyond, within


def make_trainer(model_dir, out, lora=None, **training):
    from hftrain.data import build_datasets
    from hftrain.modeling import load_model, load_tokenizer
    from hftrain.methods import load_recipe
    from hftrain.launch.setup import training_arguments
    from hftrain.methods.sft import SFTTrainer

    recipe = load_recipe(None, raw={
        "model": {"name_or_path": model_dir, "dtype": "float32", **({"lora": lora} if lora else {})},
        "data": {"sources": [{"path": DEMO_TRAIN}], "max_length": 32},
        "training": {"output_dir": str(out), "max_steps": 4, "save_steps": 2, "per_device_train_batch_size": 4,
                     "learning_rate": 1e-3, "logging_steps": 1, "report_to": "none", "seed": 0,
                     "disable_tqdm": True, "save_total_limit": 3, **training},
    })
    args = training_arguments(recipe)
    tokenizer = load_tokenizer(recipe.model)
    data = build_datasets(recipe.data, tokenizer, seed=args.seed)
    return SFTTrainer(model=load_model(recipe.model), args=args, train_dataset=data.train,
                      processing_class=tokenizer, data_collator=data.collator)


def final_weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    """An uninterrupted 4-step run (checkpoints at 2 and 4) and its final weights."""
    out = tmp_path_factory.mktemp("ref") / "out"
    t = make_trainer(tiny_model_dir, out)
    t.train()
    return out, final_weights(t)


def test_checkpoints_are_published_complete(reference):
    out, _ = reference
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]  # no staging folder left behind
    for step in (2, 4):
        assert checkpoint_problem(str(out / f"checkpoint-{step}")) is None
    assert newest_complete(str(out)) == str(out / "checkpoint-4")


def test_interrupted_save_leaves_nothing_resume_would_pick(tmp_path, tiny_model_dir, reference, monkeypatch):
    """A failure inside the save of checkpoint-4 (after the weights, before the optimizer state): resume=true
    then picks checkpoint-2, and finishing from it gives the uninterrupted run's weights."""
    from transformers import Trainer

    out = tmp_path / "out"
    t = make_trainer(tiny_model_dir, out)

    def boom(self, output_dir):
        if output_dir.endswith("checkpoint-4"):
            assert os.path.isfile(os.path.join(output_dir, "model.safetensors"))  # midway: weights written
            raise RuntimeError("simulated crash during the save")
        return orig(self, output_dir)

    orig = Trainer._save_optimizer_and_scheduler
    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", boom)
    with pytest.raises(CheckpointError, match=r"saving checkpoint-4 into .*_incomplete/checkpoint-4 failed: "
                                              r"RuntimeError: simulated crash.*checkpoint-2, is intact"):
        t.train()
    monkeypatch.undo()
    assert not os.path.exists(out / "checkpoint-4")
    assert not os.path.exists(out / checkpoints.STAGING)  # the partial save was removed
    assert newest_complete(str(out)) == str(out / "checkpoint-2")

    t2 = make_trainer(tiny_model_dir, out, resume_from_checkpoint=True)
    t2.train(resume_from_checkpoint=True)
    assert t2.state.global_step == 4
    within("checkpoints.resume_vs_uninterrupted.weights", final_weights(t2), reference[1], label="interrupted save")


def test_resume_skips_half_written_checkpoints_with_a_warning(tmp_path, reference):
    out = tmp_path / "out"
    shutil.copytree(reference[0], out)
    # A checkpoint-6 cut short before trainer_state.json, a checkpoint-8 with truncated weights (both without
    # the manifest hftrain writes last, as the plain Trainer or an older hftrain leaves them), a kill-9
    # leftover in the staging folder, and a checkpoint from a foreign tool without weights.
    shutil.copytree(out / "checkpoint-4", out / "checkpoint-6")
    os.remove(out / "checkpoint-6" / "trainer_state.json")
    shutil.copytree(out / "checkpoint-4", out / "checkpoint-8")
    for n in (6, 8):
        os.remove(out / f"checkpoint-{n}" / MANIFEST)
    w = out / "checkpoint-8" / "model.safetensors"
    os.truncate(w, os.path.getsize(w) // 2)
    shutil.copytree(out / "checkpoint-4", out / checkpoints.STAGING / "checkpoint-10")
    os.makedirs(out / "checkpoint-12")
    (out / "checkpoint-12" / "trainer_state.json").write_text("{}")
    warnings = []
    assert resolve_resume(True, str(out), warn=warnings.append) == str(out / "checkpoint-4")
    text = "\n".join(warnings)
    assert f"ignoring {out / checkpoints.STAGING}: a save that was interrupted" in text
    assert f"skipping incomplete checkpoint {out / 'checkpoint-12'}: " in text and "holds no weights" in text
    assert f"skipping incomplete checkpoint {out / 'checkpoint-8'}: " in text and "truncated" in text
    assert f"{out / 'checkpoint-6'} has no trainer_state.json (the save did not finish)" in text
    # transformers alone would pick the highest number, whatever is inside:
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-12")


def test_resume_path_errors_name_the_key_and_the_fix(tmp_path, reference):
    with pytest.raises(CheckpointError, match=r"resume_from_checkpoint is true but .* holds no complete"):
        resolve_resume(True, str(tmp_path))
    bad = tmp_path / "checkpoint-4"
    shutil.copytree(reference[0] / "checkpoint-4", bad)
    with open(bad / "model.safetensors", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(CheckpointError, match=r"cannot resume from .*checkpoint-4: checkpoint-4/model.safetensors: "
                                              r"100 bytes, the manifest says \d+ \(the file changed after the save\)"):
        resolve_resume(str(bad), str(tmp_path))
    os.remove(bad / MANIFEST)  # unverified: the completeness checks still catch it
    with pytest.raises(CheckpointError, match=r"cannot resume from .*checkpoint-4: .*model.safetensors: truncated"):
        resolve_resume(str(bad), str(tmp_path))
    assert resolve_resume(None, str(tmp_path)) is None
    # After an elastic restart with nothing saved yet, training starts from scratch.
    assert resolve_resume(None, str(tmp_path / "none"), restarted=True) is None


def tree_size(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.fixture
def tiny_fs(tmp_path, reference):
    """A tmpfs with room for one and a half checkpoints (unmounted afterwards)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    size = tree_size(reference[0] / "checkpoint-2") * 3 // 2
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()})")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)  # a file object still referenced by a traceback


@pytest.mark.launches
def test_disk_full_during_save_fails_cleanly(tiny_fs, tiny_model_dir, reference):
    """output_dir on a filesystem with room for one checkpoint only: the second save fails with a clear error,
    checkpoint-2 stays intact and resumable, and nothing half-written is picked on resume."""
    size2 = tree_size(reference[0] / "checkpoint-2")
    out = tiny_fs / "out"
    t = make_trainer(tiny_model_dir, out)
    free = shutil.disk_usage(tiny_fs).free
    assert size2 < free < 2 * size2, f"the test needs room for one checkpoint ({size2} B), has {free} B"
    with pytest.raises(CheckpointError) as e:
        t.train()
    msg = str(e.value)
    assert f"into {out / checkpoints.STAGING / 'checkpoint-4'} failed: no space left on the device of {out}" in msg
    assert f"the last complete checkpoint, {out / 'checkpoint-2'}, is intact" in msg
    assert "Free space or point training.output_dir at a larger disk" in msg
    assert "resume with training.resume_from_checkpoint=true" in msg
    assert sorted(os.listdir(out)) == ["checkpoint-2"]  # the partial save was removed
    assert newest_complete(str(out)) == str(out / "checkpoint-2")
    # The surviving checkpoint equals the uninterrupted run's checkpoint-2, file for file.
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        with open(out / "checkpoint-2" / name, "rb") as a, open(reference[0] / "checkpoint-2" / name, "rb") as b:
            assert a.read() == b.read(), name


def test_layout_decides_what_can_resume_exactly(tmp_path, reference):
    from hftrain.checkpoints import LAYOUT, layout, layout_problems, needs_universal

    ck = tmp_path / "checkpoint-2"
    shutil.copytree(reference[0] / "checkpoint-2", ck)
    # written by the save, with the quantisation of the base the run trained against (none here)
    assert json.load(open(ck / LAYOUT)) == {**layout(1, 4, 1, "ddp"), "quantization": None}
    assert layout_problems(str(ck), layout(1, 4, 1, None)) == []
    assert layout_problems(str(ck), layout(2, 2, 1, "ddp")) == []  # same global batch on 2 ranks
    assert layout_problems(str(ck), layout(2, 1, 2, "ddp")) == []
    (p,) = layout_problems(str(ck), layout(2, 4, 1, "ddp"))
    assert "trained with 4 examples per step" in p and "this run takes 8" in p and "product is 4" in p
    (p,) = layout_problems(str(ck), layout(1, 4, 1, "zero3"))
    assert "written by strategy 'ddp', this run is 'zero3'" in p
    assert not needs_universal(str(ck), layout(2, 2, 1, "ddp"))
    (ck / LAYOUT).write_text(json.dumps(layout(2, 2, 1, "zero3")))
    assert layout_problems(str(ck), layout(2, 2, 1, "zero3_offload")) == []  # same format, same world
    assert not needs_universal(str(ck), layout(2, 2, 1, "zero3_offload"))
    # ZeRO on another world size: resharded through a universal checkpoint ...
    assert layout_problems(str(ck), layout(1, 4, 1, "zero3_offload")) == []
    assert needs_universal(str(ck), layout(1, 4, 1, "zero3")) and needs_universal(str(ck), layout(4, 1, 1, "zero3"))
    # ... except with the optimizer on NVMe, whose per-rank swap files DeepSpeed copies back as they are.
    (p,) = layout_problems(str(ck), layout(1, 4, 1, "zero_infinity"))
    assert "written by 2 ranks, this run has 1, and with the optimizer on NVMe (zero_infinity)" in p
    (ck / LAYOUT).write_text(json.dumps(layout(2, 2, 1, "zero_infinity")))
    (p,) = layout_problems(str(ck), layout(1, 4, 1, "zero3"))
    assert "Resume with 2 processes, or with strategy.name: zero3_offload" in p


def test_launch_checks_resume_against_the_world_it_will_start(tmp_path, reference, tiny_model_dir, capsys):
    """`hftrain launch` runs in one process but starts strategy.num_processes: the layout check uses that."""
    from hftrain.checkpoints import LAYOUT, layout
    from hftrain.cli import main

    out = tmp_path / "out"
    shutil.copytree(reference[0] / "checkpoint-2", out / "checkpoint-2")
    (out / "checkpoint-2" / LAYOUT).write_text(json.dumps(layout(2, 2, 1, "ddp")))
    write_manifest(str(out / "checkpoint-2"))  # as if a 2-rank run had saved it
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({"model": {"name_or_path": tiny_model_dir},
                                   "data": {"sources": [{"path": DEMO_TRAIN}]},
                                   "training": {"output_dir": str(out), "per_device_train_batch_size": 2,
                                                "resume_from_checkpoint": True}}))
    assert main(["launch", str(rec), "--dry-run"]) == 0
    with pytest.raises(SystemExit) as e:
        main(["launch", str(rec), "--dry-run", "strategy.num_processes=1"])
    assert e.value.code == 2 and "trained with 4 examples per step" in capsys.readouterr().err


@pytest.mark.launches
def test_final_save_on_a_full_disk_leaves_no_half_file(tmp_path, tiny_model_dir, reference):
    """The final model is written aside and moved in file by file: a disk too small for model.safetensors fails
    the save with the no-space message, and output_dir holds no partial weights."""
    from hftrain.methods import load_recipe
    from hftrain.artifacts import save_final

    small = tmp_path / "small"
    small.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()})")
    try:
        out = small / "out"
        t = make_trainer(tiny_model_dir, out, max_steps=1, save_strategy="no")
        t.train()
        recipe = load_recipe(None, raw={"model": {"name_or_path": tiny_model_dir}, "data": {"sources": [{"path": "d"}]},
                                        "training": {"output_dir": str(out)}})
        with pytest.raises(CheckpointError) as e:
            save_final(t, recipe, recipe.strategy, t.processing_class, {})
        assert (f"into {out / checkpoints.STAGING / 'final'} failed: no space left on the device of {out}"
                in str(e.value))
        assert not os.path.exists(out / "model.safetensors") and not os.path.exists(out / checkpoints.STAGING)
    finally:
        if subprocess.run(["umount", str(small)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(small)], check=False)


def test_lora_output_loads_from_another_directory(tmp_path, monkeypatch, tiny_model_dir):
    """A LoRA run on a base given by a relative path: adapter_config.json of the final save and of the checkpoints
    names the base by its absolute path, so AutoPeftModelForCausalLM loads them from any directory."""
    from peft import AutoPeftModelForCausalLM

    from hftrain.modeling import resolved_name_or_path

    shutil.copytree(tiny_model_dir, tmp_path / "models" / "base")
    monkeypatch.chdir(tmp_path)
    trainer = make_trainer("models/base", tmp_path / "out", lora={"r": 4}, max_steps=2, save_steps=2)
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for saved in (tmp_path / "out", tmp_path / "out" / "checkpoint-2"):
        with open(saved / "adapter_config.json", encoding="utf-8") as fh:
            assert json.load(fh)["base_model_name_or_path"] == str(tmp_path / "models" / "base")
        model = AutoPeftModelForCausalLM.from_pretrained(str(saved))
        assert type(model).__name__ == "PeftModelForCausalLM"
    assert resolved_name_or_path("someone/some-model") == "someone/some-model"  # a Hub id stays a Hub id


# -- verified checkpoints: the manifest ----------------------------------------------------------------------------
def flip_byte(path, at: int = -5):
    with open(path, "r+b") as fh:
        fh.seek(at, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_manifest_lists_every_file_with_size_and_sha256(reference, tmp_path):
    import hashlib

    from hftrain.checkpoints.manifest import files_of, manifest_problems, read_manifest

    ck = reference[0] / "checkpoint-4"
    files = read_manifest(str(ck))
    on_disk = sorted(os.listdir(ck))
    assert sorted(files) == [n for n in on_disk if n != MANIFEST]
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            checkpoints.LAYOUT} <= files.keys()  # written last: the layout file and trainer_state are in it
    for name, e in files.items():
        data = (ck / name).read_bytes()
        assert e == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert manifest_problems(str(ck)) == []
    # Subfolders (DeepSpeed's global_stepN/, FSDP's optimizer_0/) are listed by relative path and verified.
    d = tmp_path / "checkpoint-9"
    (d / "global_step9").mkdir(parents=True)
    (d / "global_step9" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"a" * 100)
    (d / "latest").write_text("global_step9")
    write_manifest(str(d))
    assert files_of(str(d)) == ["global_step9/zero_pp_rank_0_mp_rank_00_optim_states.pt", "latest"]
    assert manifest_problems(str(d)) == []
    flip_byte(d / "global_step9" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert manifest_problems(str(d)) == ["checkpoint-9/global_step9/zero_pp_rank_0_mp_rank_00_optim_states.pt: "
                                         "sha256 differs from the manifest (the file changed after the save)"]


@pytest.fixture
def two_checkpoints(tmp_path, reference):
    out = tmp_path / "out"
    for n in (2, 4):
        shutil.copytree(reference[0] / f"checkpoint-{n}", out / f"checkpoint-{n}")
    return out


def test_damaged_newest_checkpoint_is_refused_by_name_never_skipped(two_checkpoints):
    out = two_checkpoints
    assert resolve_resume(True, str(out)) == str(out / "checkpoint-4")  # negative control: untouched, accepted
    flip_byte(out / "checkpoint-4" / "optimizer.pt")
    with pytest.raises(CheckpointError) as e:
        resolve_resume(True, str(out))
    msg = str(e.value)
    assert msg.startswith(f"cannot resume from {out / 'checkpoint-4'}: checkpoint-4/optimizer.pt: sha256 differs "
                          "from the manifest (the file changed after the save). Resume from another checkpoint: set "
                          f"training.resume_from_checkpoint to its path (complete, still to be verified: "
                          f"{out / 'checkpoint-2'})"), msg
    assert msg.endswith("set training.resume_weights_only: true)")  # only the optimizer state is damaged
    # The older checkpoint, named explicitly, is verified and taken; weights only takes the damaged one.
    assert resolve_resume(str(out / "checkpoint-2"), str(out)) == str(out / "checkpoint-2")
    assert resolve_resume(True, str(out), weights_only=True) == str(out / "checkpoint-4")
    # Damaged weights are refused with weights_only too, and without the weights-only hint.
    flip_byte(out / "checkpoint-4" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"checkpoint-4/model.safetensors: sha256 differs") as e:
        resolve_resume(True, str(out), weights_only=True)
    assert "resume_weights_only" not in str(e.value)


def test_missing_added_or_resized_files_are_named(two_checkpoints):
    ck = two_checkpoints / "checkpoint-4"
    os.remove(ck / "scheduler.pt")
    (ck / "notes.txt").write_text("hello")
    with open(ck / "rng_state.pth", "ab") as fh:
        fh.write(b"x")
    with pytest.raises(CheckpointError) as e:
        resolve_resume(str(ck), str(two_checkpoints))
    msg = str(e.value)
    # An added file is refused too: the Trainer picks files by their presence (another weights format, an
    # rng_state_N.pth, an optimizer folder) and nothing in a published checkpoint is hftrain's but what it wrote.
    assert "checkpoint-4/notes.txt: not in the manifest (added after the save)" in msg
    assert "checkpoint-4/scheduler.pt: missing (the manifest lists it: it was deleted after the save)" in msg
    assert "checkpoint-4/rng_state.pth: " in msg and "bytes, the manifest says" in msg


def test_unverified_checkpoint_is_accepted_with_one_line_and_parsed_defensively(two_checkpoints):
    import torch

    ck = two_checkpoints / "checkpoint-4"
    os.remove(ck / MANIFEST)
    lines = []
    assert resolve_resume(True, str(two_checkpoints), warn=lines.append) == str(ck)
    assert lines == [f"hftrain: {ck} has no {MANIFEST}: it was written by hftrain (it holds hftrain_checkpoint.json) "
                     "and its manifest was deleted after the save; its files cannot be verified (only checked complete "
                     "and readable)"]
    # The run verifies twice (its preflight, then its set-up, which prints): the second, answered from the cache of
    # verified checkpoints, says the same (it said nothing before: the run resumed without a word).
    again = []
    assert resolve_resume(True, str(two_checkpoints), warn=again.append) == str(ck)
    assert again == lines
    # An RNG file torch refuses to load safely: named, and torch's advice (weights_only=False) is not passed on.
    torch.save({"python": object}, ck / "rng_state.pth")
    with pytest.raises(CheckpointError) as e:
        resolve_resume(str(ck), str(two_checkpoints), warn=lambda m: None)
    assert f"{ck / 'rng_state.pth'}: not an RNG state torch can load safely (UnpicklingError)" in str(e.value)
    assert "weights_only" not in str(e.value)
    torch.save({"a": torch.zeros(1)}, ck / "rng_state.pth")
    with pytest.raises(CheckpointError, match="rng_state.pth: not an RNG state written by the Trainer"):
        resolve_resume(str(ck), str(two_checkpoints), warn=lambda m: None)
    shutil.copy(two_checkpoints / "checkpoint-2" / "rng_state.pth", ck / "rng_state.pth")
    (ck / checkpoints.LAYOUT).write_text('{"world_size": "2"}')
    with pytest.raises(CheckpointError, match=r"hftrain_checkpoint.json: not an hftrain layout \(needs world_size"):
        resolve_resume(str(ck), str(two_checkpoints), warn=lambda m: None)
    with pytest.raises(CheckpointError, match=r"hftrain_checkpoint.json: not an hftrain layout"):
        checkpoints.read_layout(str(ck))  # not silently None when the file exists
    os.remove(ck / checkpoints.LAYOUT)
    assert checkpoints.read_layout(str(ck)) is None  # absent: written by another tool, nothing to compare
    os.remove(ck / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"optimizer.pt: missing \(the optimizer state\); set "
                                              r"training.resume_weights_only: true"):
        resolve_resume(str(ck), str(two_checkpoints), warn=lambda m: None)
    assert resolve_resume(str(ck), str(two_checkpoints), warn=lambda m: None, weights_only=True) == str(ck)


def test_rng_file_damaged_after_the_check_is_named_by_the_trainer(tmp_path, tiny_model_dir, reference):
    """SFTTrainer._load_rng_state: what changed between the check and the load is named, torch's advice is not."""
    ck = tmp_path / "checkpoint-4"
    shutil.copytree(reference[0] / "checkpoint-4", ck)
    (ck / "rng_state.pth").write_bytes(b"garbage")
    t = make_trainer(tiny_model_dir, tmp_path / "out")
    with pytest.raises(CheckpointError) as e:
        t._load_rng_state(str(ck))
    assert str(e.value) == (f"cannot resume from {ck}: rng_state.pth cannot be loaded safely (UnpicklingError); "
                            "resume from another checkpoint")


def test_resume_weights_only_needs_a_resume_and_no_deepspeed():
    from hftrain.methods import parse_recipe

    def problems(**training):
        _, found = parse_recipe(None, raw={"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d"}]},
                                           "strategy": {"name": training.pop("strategy", "ddp")}, "training": training})
        return [p for p in found if "training.resume_weights_only" in p]

    assert problems(resume_weights_only=True, resume_from_checkpoint=True) == []
    assert problems(resume_weights_only=True, resume_from_checkpoint=True, strategy="fsdp") == []
    assert problems(resume_weights_only=False, strategy="zero3") == []
    (p,) = problems(resume_weights_only=True)
    assert "training.resume_weights_only: is set but training.resume_from_checkpoint is not" in p
    (p,) = problems(resume_weights_only=True, resume_from_checkpoint=True, strategy="zero2")
    assert "training.resume_weights_only: cannot be used with strategy.name: zero2" in p


def tree_digest(path) -> dict:
    import hashlib

    return {os.path.relpath(os.path.join(d, f), path): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, fs in os.walk(path) for f in fs}


@pytest.mark.launches
def test_flipped_optimizer_byte_stops_the_resume_then_weights_only_trains_on(tmp_path, tiny_model_dir):
    """End to end, `python recipes/sft.py`: a byte flipped in checkpoint-4/optimizer.pt makes the resume exit 2 naming
    the file, writing nothing; with training.resume_weights_only it trains on from checkpoint-4's weights with a fresh
    optimizer and schedule (Adam's step count and the scheduler restart: 2 steps after the resume, not 6)."""
    import torch

    out = tmp_path / "out"
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({
        "model": {"name_or_path": tiny_model_dir, "dtype": "float32"},
        "data": {"sources": [{"path": DEMO_TRAIN}], "max_length": 32},
        "training": {"output_dir": str(out), "max_steps": 4, "save_steps": 2, "save_total_limit": 5,
                     "per_device_train_batch_size": 4, "learning_rate": 1e-3, "logging_steps": 1,
                     "report_to": "none", "disable_tqdm": True, "seed": 0}}))
    r = run([PY, "recipes/sft.py", str(rec)], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    flip_byte(out / "checkpoint-4" / "optimizer.pt")
    before = tree_digest(out)
    resume = [PY, "recipes/sft.py", str(rec), "training.max_steps=6", "training.resume_from_checkpoint=true"]
    r = run(resume, timeout=600)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr and r.stderr.count("hftrain: error:") == 1, r.stderr[-3000:]
    assert "checkpoint-4/optimizer.pt: sha256 differs from the manifest (the file changed after the save)" in r.stderr
    assert f"set training.resume_from_checkpoint to its path (complete, still to be verified: {out / 'checkpoint-2'})" \
        in r.stderr
    assert tree_digest(out) == before  # nothing written: no checkpoint-6, the final weights untouched

    r = run([*resume, "training.resume_weights_only=true"], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"hftrain: resuming the weights only from {out / 'checkpoint-4'} (training.resume_weights_only)" in r.stdout
    assert r.stdout.count("{'loss': ") == 2, r.stdout[-3000:]  # steps 5 and 6
    optimizer = torch.load(out / "checkpoint-6" / "optimizer.pt", weights_only=True)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {2.0}  # 6.0 had the damaged state been loaded
    assert torch.load(out / "checkpoint-6" / "scheduler.pt", weights_only=True)["last_epoch"] == 2
    assert json.load(open(out / "checkpoint-6" / "trainer_state.json"))["global_step"] == 6
    assert resolve_resume(True, str(out)) == str(out / "checkpoint-6")  # its own manifest verifies


@pytest.mark.parametrize("weights_only", [False, True])
def test_resume_weights_only_starts_the_optimizer_fresh(weights_only, tmp_path, tiny_model_dir, reference):
    """From checkpoint-2 to step 4: Adam's step count and the schedule continue (4) or restart (2); the weights
    and the step come from the checkpoint either way."""
    out = tmp_path / "out"
    shutil.copytree(reference[0] / "checkpoint-2", out / "checkpoint-2")
    t = make_trainer(tiny_model_dir, out, resume_from_checkpoint=True, resume_weights_only=weights_only)
    t.train(resume_from_checkpoint=True)
    assert t.state.global_step == 4
    steps = {float(s["step"]) for s in t.optimizer.state.values()}
    assert steps == ({2.0} if weights_only else {4.0})
    assert t.lr_scheduler.last_epoch == (2 if weights_only else 4)
    if not weights_only:
        within("checkpoints.resume_vs_uninterrupted.weights", final_weights(t), reference[1], label="full resume")
    else:  # the control: Adam's state and the schedule started afresh (the weights only) end elsewhere
        beyond("checkpoints.resume_vs_uninterrupted.weights", final_weights(t), reference[1], label="weights only")
