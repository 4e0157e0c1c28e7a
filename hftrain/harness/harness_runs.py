"""lm-evaluation-harness on one model folder, offline: a full model, or a LoRA run's adapter on its base (the harness's
own `peft=` argument). The model's own code is never run unless asked (trust_remote_code off)."""

from __future__ import annotations

import json
import os

from ..errors import ModelError

NOT_FIGURES = ("alias", "name", "sample_len")


def model_arguments(folder: str, device: str, trust_remote_code: bool = False) -> dict:
    """The harness's `hf` model arguments for a model folder (an adapter folder: its base as `pretrained`)."""
    dtype = "float32" if device == "cpu" else "auto"
    arguments = {"pretrained": folder, "dtype": dtype, "trust_remote_code": trust_remote_code}
    adapter = os.path.join(folder, "adapter_config.json")
    if os.path.isfile(adapter):
        with open(adapter, encoding="utf-8") as f:
            base = json.load(f).get("base_model_name_or_path")
        if not base or not os.path.isdir(base):
            raise ModelError(f"{adapter}: base_model_name_or_path {base!r} is not a local folder; evaluate the run's "
                             "merged model (hub.merge_lora: its merged/ folder) instead")
        arguments.update(pretrained=base, peft=folder)
    elif not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelError(f"{folder}: not a model folder (no config.json or adapter_config.json)")
    return arguments


def task_manager(tasks: list[str], include_paths: list[str]):
    """The harness's TaskManager for these tasks: the given task folders alone when they hold every task asked for
    (indexing the harness's own ~14,000 task files takes 12-15 s here), else with its own tasks too."""
    from lm_eval.tasks import TaskManager  # optional and heavy (`pip install lm-eval`): only `hftrain eval` needs it

    if include_paths:
        own = TaskManager(include_path=include_paths, include_defaults=False)
        if set(tasks) <= set(own.all_tasks):
            return own
    return TaskManager(include_path=include_paths or None)


def harness_results(folder: str, tasks: list[str], manager, limit: int | None, batch_size: int, device: str,
                    chat_template: bool, trust_remote_code: bool = False) -> dict:
    """{"figures": {task: {"metric,filter": value}}, "higher_is_better": {task: {metric: bool}}} of one model, the tasks
    found through `manager` (task_manager)."""
    import lm_eval  # optional and heavy (`pip install lm-eval`): only `hftrain eval` needs it

    result = lm_eval.simple_evaluate(
        model="hf", model_args=model_arguments(folder, device, trust_remote_code), tasks=tasks,
        task_manager=manager, limit=limit, batch_size=batch_size, device=device,
        apply_chat_template=chat_template, log_samples=False)
    figures = {task: {k: v for k, v in values.items() if k not in NOT_FIGURES and "_stderr" not in k}
               for task, values in result["results"].items()}
    return {"figures": figures, "higher_is_better": result.get("higher_is_better", {})}
