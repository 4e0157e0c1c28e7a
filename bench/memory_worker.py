"""One rank of bench/memory.py: recipes/sft.py's pieces, with the resident set size read around them.

    accelerate launch --config_file accelerate_configs/<s>.yaml bench/memory_worker.py MODEL_DIR OUT STEPS NVME
"""

import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hftrain import distributed, engine  # noqa: E402
from hftrain.data import build_datasets  # noqa: E402
from hftrain.modeling import load_model, load_tokenizer  # noqa: E402
from hftrain.recipe import load_recipe  # noqa: E402
from hftrain.trainer import HFTrainer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main(model_dir: str, out: str, steps: str, nvme: str) -> None:
    overrides = [f"model.name_or_path={model_dir}", f"data.sources.0.path={REPO}/data/demo/train.jsonl",
                 "data.max_length=64", f"training.output_dir={out}", f"training.max_steps={steps}",
                 "training.per_device_train_batch_size=2", "training.save_strategy=no", "training.report_to=none",
                 "training.disable_tqdm=true", "training.logging_steps=1"]
    if engine.launcher_strategy() == "zero_infinity":
        overrides.append(f"strategy.nvme_path={nvme}")
    recipe = load_recipe(None, overrides, raw={})
    strategy = engine.resolve_strategy(recipe)
    args = recipe.training_arguments(**engine.training_arguments_kwargs(strategy))
    engine.after_training_arguments(strategy)
    tokenizer = load_tokenizer(recipe.model)
    data = build_datasets(recipe.data, tokenizer)
    gc.collect()
    before = rss()
    model = load_model(recipe.model)
    trainer = HFTrainer(model=model, args=args, train_dataset=data.train, processing_class=tokenizer,
                        data_collator=data.collator)
    trainer.train()
    gc.collect()
    report = {"rss_before_model": before, "rss_after_train": rss(), "peak_rss": rss("VmHWM"),
              "engine": engine.describe(trainer, strategy)}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"mem_rank{distributed.rank()}.json"), "w") as fh:
        json.dump(report, fh)
    del trainer, model
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
