"""hftrain deletes only what it made (issue 33, point 1). Every call in the package that removes or replaces a path
(shutil.rmtree, os.remove/unlink/rmdir/removedirs, os.replace/rename, shutil.move, transformers'
rotate_checkpoints) is listed below with why the path is hftrain's own and the test that proves it. The first test
finds every such call by walking the package's syntax trees: a new call site, or one more call in a function, fails
it until it is reviewed and added here with its proof; a site that is gone must be struck off. The other tests are
the proofs that no other test file gives."""

import ast
import os
from collections import Counter

import pytest

from hftrain import checkpoints, fileio
from hftrain.errors import CheckpointError

from .conftest import REPO

PACKAGE = os.path.join(REPO, "hftrain")
DELETERS = {("shutil", "rmtree"), ("shutil", "move"), ("os", "remove"), ("os", "unlink"), ("os", "rmdir"),
            ("os", "removedirs"), ("os", "replace"), ("os", "rename")}
# Called by name (from-imports) or on a Path: removals all the same.
BARE = {"rmtree", "remove", "unlink", "rmdir", "removedirs", "rotate_checkpoints"}

# (file, function, call) -> (calls, what is removed and why it is hftrain's, tests that prove it)
REMOVALS = {
    ("hftrain/outdir.py", "claim", "shutil.rmtree"): (
        1, "training.overwrite_output_dir: the previous run's checkpoint-<digits> and _incomplete folders, under the "
           "lock, only once the folder is known to hold an hftrain run (finished or unfinished)",
        ["tests/test_outdir.py::test_overwrite_clears_the_previous_run_and_keeps_other_files",
         "tests/test_outdir.py::test_overwrite_removes_numbered_checkpoints_only"]),
    ("hftrain/outdir.py", "claim", "os.remove"): (
        1, "training.overwrite_output_dir: the previous run's run_info.json and hftrain_checkpoint.json",
        ["tests/test_outdir.py::test_overwrite_clears_the_previous_run_and_keeps_other_files"]),
    ("hftrain/outdir.py", "_give_up", "os.remove"): (
        1, "a refused claim: the lock file this claim created (O_EXCL)",
        ["tests/test_outdir.py::test_a_refused_claim_removes_the_lock_file_and_folder_it_made",
         "tests/test_outdir.py::test_claim_checks_the_folder_again_under_the_lock"]),
    ("hftrain/outdir.py", "_give_up", "os.rmdir"): (
        1, "a refused claim: the output_dir this claim created, only when empty",
        ["tests/test_claim.py::test_home_written_as_tilde_is_refused",
         "tests/test_removals.py::test_a_refused_claim_removes_only_the_empty_folder_it_made"]),
    ("hftrain/launch/op_cache.py", "release_abandoned_build_locks", "os.remove"): (
        1, "a ZeRO run: torch's build lock `<op>/lock` in DeepSpeed's op cache (hftrain's own folder under "
           "~/.cache/hftrain unless TORCH_EXTENSIONS_DIR names another), only where no build holds it: no process "
           "working in the op's folder, and on a local disk older than a minute, on a shared one it and the folder's "
           "last write older than 15 min; judged again under hftrain's own file lock",
        ["tests/test_op_cache.py::test_on_a_local_disk_a_lock_no_process_builds_under_is_released_after_a_minute",
         "tests/test_op_cache.py::test_on_a_shared_disk_only_a_lock_and_folder_both_quiet_for_15_min_are_released",
         "tests/test_op_cache.py::test_a_lock_whose_folder_a_process_works_in_is_kept"]),
    ("hftrain/fileio.py", "atomic_write", "os.replace"): (
        1, "the file being written, replaced by its complete new version",
        ["tests/test_removals.py::test_atomic_write_removes_only_its_own_temporary_file"]),
    ("hftrain/fileio.py", "atomic_write", "os.remove"): (
        1, "a failed write: its own temporary file (created O_EXCL under a random name)",
        ["tests/test_removals.py::test_atomic_write_removes_only_its_own_temporary_file"]),
    ("hftrain/fileio.py", "save_figure", "os.replace"): (
        1, "the figure being written, replaced by its complete new version",
        ["tests/test_removals.py::test_save_figure_removes_only_its_own_temporary_file"]),
    ("hftrain/fileio.py", "save_figure", "os.remove"): (
        1, "a failed figure: its own temporary file (created O_EXCL under a random name)",
        ["tests/test_removals.py::test_save_figure_removes_only_its_own_temporary_file"]),
    ("hftrain/data/cache.py", "in_cache", "os.remove"): (
        1, "a full datasets cache: the tmp* files that appeared in the cache folder during this preparation (absent "
           "before it, written since it began: datasets' and the JSON reader's partial files); a job writing into the "
           "same cache folder at that moment is the one case it cannot tell apart",
        ["tests/test_bad_input.py::test_a_full_datasets_cache_is_named_and_left_clean"]),
    ("hftrain/data/cache.py", "damaged", "os.remove"): (
        1, "a damaged cache entry of hftrain's (a file missing, truncated or unreadable): the files its meta lists "
           "and the meta file, only names in the cache folder itself that begin with tokens- or rows-",
        ["tests/test_data_cache.py::test_a_truncated_cache_file_is_prepared_again_not_a_traceback"]),
    ("hftrain/data/sources.py", "_write_json_rows", "os.replace"): (
        1, "the rows file of this cache key, replaced by its complete version (written as tmp-<pid>-<name> beside it)",
        ["tests/test_data_cache.py::test_an_unchanged_file_is_not_read_again_a_changed_one_is"]),
    ("hftrain/data/sources.py", "_write_json_rows", "os.remove"): (
        1, "a failed read: its own tmp-<pid>-<name> file",
        ["tests/test_data_cache.py::test_every_format_refuses_a_row_over_the_cap_naming_it"]),
    ("hftrain/checkpoints/world_size.py", "to_universal", "shutil.rmtree"): (
        3, "inside a checkpoint hftrain wrote (its hftrain_checkpoint.json says ZeRO on another world size): the "
           "staging folder _<tag>_universal.partial (hftrain's name) before and after a failed conversion, and a "
           "<tag>_universal left by an interrupted conversion (latest_universal does not name it)",
        ["tests/test_removals.py::test_universal_conversion_removes_only_its_own_folders",
         "tests/test_resume.py::test_zero_checkpoint_resumes_on_another_world_size_through_a_universal_checkpoint"]),
    ("hftrain/checkpoints/world_size.py", "to_universal", "os.rename"): (
        1, "its staging folder to <tag>_universal (after the leftover of its name was removed)",
        ["tests/test_removals.py::test_universal_conversion_removes_only_its_own_folders"]),
    ("hftrain/fileio.py", "publish", "shutil.rmtree"): (
        1, "checkpoint-N of this run saved again (a resumed run re-saving a step): replaced by the new save",
        ["tests/test_removals.py::test_publish_replaces_only_the_checkpoint_of_the_same_step"]),
    ("hftrain/fileio.py", "publish", "os.rename"): (
        1, "the staged checkpoint into place",
        ["tests/test_checkpoints.py::test_checkpoints_are_published_complete"]),
    ("hftrain/fileio.py", "publish_into", "shutil.rmtree"): (
        1, "the final save: a folder of output_dir with the name of an entry the final save wrote (replaced by it)",
        ["tests/test_removals.py::test_publish_into_replaces_only_the_entries_it_moves"]),
    ("hftrain/fileio.py", "publish_into", "os.replace"): (
        1, "the final save: each file it wrote replaces its previous version",
        ["tests/test_removals.py::test_publish_into_replaces_only_the_entries_it_moves"]),
    ("hftrain/fileio.py", "publish_into", "os.rmdir"): (
        1, "the final save's staging folder, emptied by the moves",
        ["tests/test_removals.py::test_publish_into_replaces_only_the_entries_it_moves"]),
    ("hftrain/fileio.py", "remove_staging_root", "os.rmdir"): (
        1, "output_dir/_incomplete, only when empty",
        ["tests/test_removals.py::test_publish_into_replaces_only_the_entries_it_moves"]),
    ("hftrain/artifacts.py", "save_final", "shutil.rmtree"): (
        2, "output_dir/_incomplete/final: a leftover of an interrupted final save, and the partial save of a failed "
           "one",
        ["tests/test_checkpoints.py::test_final_save_on_a_full_disk_leaves_no_half_file",
         "tests/test_removals.py::test_a_leftover_staged_save_is_replaced_and_nothing_else"]),
    ("hftrain/checkpoints/mixin.py", "StagedCheckpointMixin._save_checkpoint", "shutil.rmtree"): (
        2, "output_dir/_incomplete/checkpoint-N: a leftover of an interrupted save of the same step, and the partial "
           "save of a failed one",
        ["tests/test_checkpoints.py::test_interrupted_save_leaves_nothing_resume_would_pick",
         "tests/test_checkpoints.py::test_disk_full_during_save_fails_cleanly",
         "tests/test_removals.py::test_a_leftover_staged_save_is_replaced_and_nothing_else"]),
    ("hftrain/checkpoints/mixin.py", "StagedCheckpointMixin._publish", "shutil.rmtree"): (
        1, "output_dir/_incomplete/checkpoint-N: the partial save of one whose layout, manifest or rename failed",
        ["tests/test_checkpoints.py::test_disk_full_during_save_fails_cleanly"]),
    ("hftrain/checkpoints/mixin.py", "StagedCheckpointMixin._publish", "rotate_checkpoints"): (
        1, "transformers' save_total_limit: the oldest checkpoint-N of this run's output_dir, after the new one is "
           "published (a previous run's checkpoints are refused by the claim, or removed with overwrite_output_dir)",
        ["tests/test_checkpoints.py::test_checkpoints_are_published_complete"]),
    ("hftrain/hub/stage.py", "stage_folder", "shutil.rmtree"): (
        1, "the temporary stage this call made (tempfile.mkdtemp), after a failure",
        ["tests/test_hub.py::test_a_stage_that_fails_validation_leaves_the_previous_stage"]),
    ("hftrain/hub/stage.py", "_publish_stage", "os.rmdir"): (
        1, "an empty --stage-dir (rmdir: empty only)",
        ["tests/test_hub.py::test_cli_dry_run_needs_no_token_and_a_push_without_one_stages_nothing"]),
    ("hftrain/hub/stage.py", "_publish_stage", "os.rename"): (
        3, "the temporary stage to --stage-dir; an earlier stage of hftrain's (its marker lists exactly its files) "
           "into a folder made for it",
        ["tests/test_hub.py::test_a_stage_of_its_own_is_replaced_and_a_stage_with_added_files_is_not"]),
    ("hftrain/hub/stage.py", "_publish_stage", "shutil.rmtree"): (
        1, "the folder made (mkdtemp) to hold an earlier stage of hftrain's, checked just before",
        ["tests/test_hub.py::test_a_stage_of_its_own_is_replaced_and_a_stage_with_added_files_is_not",
         "tests/test_hub.py::test_a_dry_run_never_deletes_a_folder_it_did_not_stage"]),
}


def _call_name(node: ast.Call) -> str | None:
    fn = node.func
    if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and (fn.value.id, fn.attr) in DELETERS:
        return f"{fn.value.id}.{fn.attr}"
    if isinstance(fn, ast.Attribute) and fn.attr in ("unlink", "rmdir", "rmtree"):
        return f"<object>.{fn.attr}"  # pathlib.Path.unlink / rmdir, or an aliased module
    if isinstance(fn, ast.Name) and fn.id in BARE:
        return fn.id
    return None


def removal_sites() -> Counter:
    """(file, enclosing function, call) -> number of such calls, over every module of the package."""
    found: Counter = Counter()
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, REPO).replace(os.sep, "/")
            scope: list[str] = []

            class Visitor(ast.NodeVisitor):
                def visit_FunctionDef(self, node):
                    scope.append(node.name)
                    self.generic_visit(node)
                    scope.pop()

                visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

                def visit_Call(self, node):
                    call = _call_name(node)
                    if call:
                        found[(rel, ".".join(scope) or "<module>", call)] += 1
                    self.generic_visit(node)

            with open(path, encoding="utf-8") as fh:
                Visitor().visit(ast.parse(fh.read(), path))
    return found


def test_every_removal_in_the_package_is_reviewed_and_proven():
    found = removal_sites()
    listed = Counter({site: n for site, (n, _, _) in REMOVALS.items()})
    new = {f"{f}:{fn}: {call} x{n}": n - listed[(f, fn, call)] for (f, fn, call), n in found.items()
           if n > listed[(f, fn, call)]}
    assert not new, ("removals not reviewed (add each to REMOVALS with why the path is hftrain's own, created by "
                     f"this run, and a test that proves it): {new}")
    gone = [site for site in listed if found[site] < listed[site]]
    assert not gone, f"REMOVALS lists calls that are no longer there (strike them off): {gone}"


def _test_functions(path: str) -> set[str]:
    with open(os.path.join(REPO, path), encoding="utf-8") as fh:
        return {n.name for n in ast.parse(fh.read()).body if isinstance(n, ast.FunctionDef)
                and n.name.startswith("test_")}


def test_each_removal_names_proofs_that_exist():
    missing = []
    for site, (_, why, tests) in REMOVALS.items():
        assert why and tests, site
        for test in tests:
            path, name = test.split("::")
            if name not in _test_functions(path):
                missing.append(f"{site}: {test}")
    assert not missing, missing


# -- the proofs no other test file gives -------------------------------------------------------------------------
def test_atomic_write_removes_only_its_own_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "recipe.yaml"
    mine = tmp_path / f"recipe.yaml.tmp-{os.getpid()}"  # the name the old code used for its temporary file
    mine.write_text("a file of the user's")
    fileio.atomic_write(str(target), "v1")
    assert target.read_text() == "v1" and mine.read_text() == "a file of the user's"

    def fail(*_a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        fileio.atomic_write(str(target), "v2")
    assert sorted(os.listdir(tmp_path)) == sorted(["recipe.yaml", mine.name])  # its own temporary file is gone
    assert target.read_text() == "v1" and mine.read_text() == "a file of the user's"


def test_save_figure_removes_only_its_own_temporary_file(tmp_path, monkeypatch):
    plt = fileio.pyplot()
    mine = tmp_path / "curves.png.tmp.png"  # the name the old code used for its temporary file
    mine.write_text("a file of the user's")
    fileio.save_figure(plt.figure(), str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    fig = plt.figure()
    monkeypatch.setattr(fig, "savefig", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        fileio.save_figure(fig, str(tmp_path / "curves.png"))
    assert sorted(os.listdir(tmp_path)) == ["curves.png", mine.name] and mine.read_text() == "a file of the user's"


def test_a_refused_claim_removes_only_the_empty_folder_it_made(tmp_path):
    from hftrain import outdir
    from hftrain.errors import LaunchError

    out = tmp_path / "run"
    with pytest.raises(LaunchError):
        outdir.claim(str(out), overwrite=False, resumed=False, protected={"model.name_or_path's folder": str(out)})
    assert not out.exists()  # refused before anything was made
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(LaunchError):
        outdir.claim(str(out), overwrite=False, resumed=False)
    assert os.listdir(out) == ["notes.txt"]


def _tree(folder) -> dict:
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(folder) for f in fs}


def test_publish_replaces_only_the_checkpoint_of_the_same_step(tmp_path):
    run = tmp_path / "out"
    for name, text in (("checkpoint-2/old.bin", "old save of step 2"), ("checkpoint-20/a", "step 20"),
                       ("checkpoint-2-notes/mine.txt", "mine")):
        os.makedirs(os.path.dirname(run / name), exist_ok=True)
        (run / name).write_text(text)
    staged = run / checkpoints.STAGING / "checkpoint-2"
    staged.mkdir(parents=True)
    (staged / "new.bin").write_text("new save of step 2")
    fileio.publish(str(staged), str(run / "checkpoint-2"))
    assert _tree(run) == {"checkpoint-2/new.bin": b"new save of step 2", "checkpoint-20/a": b"step 20",
                          "checkpoint-2-notes/mine.txt": b"mine"}


def test_publish_into_replaces_only_the_entries_it_moves(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "model.safetensors").write_text("checkpoint")
    (out / "model.safetensors").write_text("old final")
    (out / "notes.txt").write_text("mine")
    (out / checkpoints.STAGING / "other").mkdir(parents=True)  # another save in progress: the root stays
    staged = out / checkpoints.STAGING / "final"
    staged.mkdir()
    (staged / "model.safetensors").write_text("new final")
    (staged / "tokenizer.json").write_text("{}")
    assert fileio.publish_into(str(staged), str(out)) == ["model.safetensors", "tokenizer.json"]
    assert _tree(out) == {"checkpoint-4/model.safetensors": b"checkpoint", "model.safetensors": b"new final",
                          "notes.txt": b"mine", "tokenizer.json": b"{}"}
    assert os.listdir(out / checkpoints.STAGING) == ["other"]  # the root is removed only once empty
    os.rmdir(out / checkpoints.STAGING / "other")
    fileio.remove_staging_root(str(out / checkpoints.STAGING))
    assert not (out / checkpoints.STAGING).exists()


def test_universal_conversion_removes_only_its_own_folders(tmp_path, monkeypatch):
    """DeepSpeed's converter stood in for: a failed conversion removes its staging folder and nothing else; a
    successful one replaces a <tag>_universal left by an interrupted conversion and keeps every other file."""
    pytest.importorskip("deepspeed")
    import deepspeed.checkpoint.ds_to_universal as ds

    ck = tmp_path / "checkpoint-4"
    (ck / "global_step4").mkdir(parents=True)
    (ck / "global_step4" / "optim_states.pt").write_text("zero state")
    (ck / "latest").write_text("global_step4")
    (ck / "_global_step4_universal.partial").mkdir()  # hftrain's own leftover of an interrupted conversion
    (ck / "notes.txt").write_text("mine")
    before = _tree(ck)

    def failing(args):
        os.makedirs(args.output_folder)
        open(os.path.join(args.output_folder, "half"), "w").close()
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(ds, "main", failing)
    with pytest.raises(CheckpointError, match="conversion failed"):
        checkpoints.to_universal(str(ck))
    assert _tree(ck) == before and sorted(os.listdir(ck)) == ["global_step4", "latest", "notes.txt"]

    (ck / "global_step4_universal").mkdir()  # an interrupted conversion's result: latest_universal does not name it
    (ck / "global_step4_universal" / "stale").write_text("stale")

    def converting(args):
        os.makedirs(os.path.join(args.output_folder, "zero"))
        with open(os.path.join(args.output_folder, "zero", "fp32.pt"), "w") as fh:
            fh.write("universal")

    monkeypatch.setattr(ds, "main", converting)
    target = checkpoints.to_universal(str(ck))
    assert target == str(ck / "global_step4_universal")
    tree = _tree(ck)
    assert tree["global_step4_universal/zero/fp32.pt"] == b"universal" and "global_step4_universal/stale" not in tree
    assert {k: v for k, v in tree.items() if not k.startswith(("global_step4_universal", "latest_universal"))} == before


@pytest.mark.parametrize("what", ["checkpoint", "final"])
def test_a_leftover_staged_save_is_replaced_and_nothing_else(what, tmp_path, tiny_model_dir):
    """A save interrupted earlier left output_dir/_incomplete/<name>: the next save of that name replaces it; a file
    of the user's in output_dir and another staged folder stay."""
    from hftrain.artifacts import save_final
    from hftrain.methods import load_recipe

    from .test_checkpoints import make_trainer

    out = tmp_path / "out"
    name = "checkpoint-2" if what == "checkpoint" else "final"
    (out / checkpoints.STAGING / name).mkdir(parents=True)
    (out / checkpoints.STAGING / name / "junk").write_text("interrupted")
    (out / checkpoints.STAGING / "checkpoint-99").mkdir()
    (out / "notes.txt").write_text("mine")
    t = make_trainer(tiny_model_dir, out, max_steps=2, save_steps=2,
                     save_strategy="steps" if what == "checkpoint" else "no")
    t.train()
    if what == "final":
        recipe = load_recipe(None, raw={"model": {"name_or_path": tiny_model_dir},
                                        "data": {"sources": [{"path": "d"}]}, "training": {"output_dir": str(out)}})
        save_final(t, recipe, recipe.strategy, t.processing_class, {})
        assert (out / "model.safetensors").exists() and not (out / "junk").exists()
    else:
        assert sorted(os.listdir(out / "checkpoint-2")) and "junk" not in os.listdir(out / "checkpoint-2")
    assert (out / "notes.txt").read_text() == "mine"
    assert os.listdir(out / checkpoints.STAGING) == ["checkpoint-99"]
