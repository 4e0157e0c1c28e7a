"""`hftrain push`: a finished run's output_dir validated, its model card written and uploaded to the Hub."""

from __future__ import annotations

from ..hub.push import push
from ..hub.run_settings import run_recipe, settings_for_run
from ..methods import load_recipe


def _push(ns) -> int:
    recipe = load_recipe(run_recipe(ns.output_dir))
    hub = settings_for_run(recipe, repo_id=ns.repo_id, private=ns.private or None, revision=ns.revision,
                           commit_message=ns.commit_message, merge_lora=ns.merge_lora or None, license=ns.license)
    push(ns.output_dir, hub, dry_run=ns.dry_run, stage_dir=ns.stage_dir,
         trust_remote_code=recipe.model.trust_remote_code)
    return 0


def add_push_command(sub) -> None:
    pu = sub.add_parser("push", allow_abbrev=False,
                        help="Validate a finished run's output_dir, write its model card and upload it to the Hub.")
    pu.add_argument("output_dir", help="the run's training.output_dir")
    pu.add_argument("--repo-id", dest="repo_id", help="your-name/model-name (default: the run's hub.repo_id)")
    pu.add_argument("--private", action="store_true", help="create the repository private")
    pu.add_argument("--revision", help="branch to push to, created if missing (default: main)")
    pu.add_argument("--commit-message", dest="commit_message")
    pu.add_argument("--merge-lora", dest="merge_lora", action="store_true",
                    help="LoRA runs: push output_dir/merged (model.lora.merge) instead of the adapter")
    pu.add_argument("--license", help="license id for the card's metadata, e.g. apache-2.0")
    pu.add_argument("--stage-dir", dest="stage_dir", help="where to write the upload (default: OUTPUT_DIR/hub_upload)")
    pu.add_argument("--dry-run", action="store_true",
                    help="validate and write the exact folder that would be uploaded, print its files; needs no token")
    pu.set_defaults(fn=_push)
