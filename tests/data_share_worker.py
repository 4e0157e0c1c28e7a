"""One rank of test_data_cache's rank-sharing test: build the data of one source in a 2-process group and write what
this rank read and tokenised itself, and what it got (or the error it stopped with).

    torchrun --nproc_per_node 2 tests/data_share_worker.py MODEL_DIR DATA.jsonl OUT_DIR DATASETS_CACHE

DATASETS_CACHE is set as datasets' cache folder here, at run time (hftrain reads `datasets.config.HF_DATASETS_CACHE`
when it prepares a source), not as HF_DATASETS_CACHE in the environment: datasets reads that variable at import, so
the launch could not be forked from the suite's preloaded interpreter (tests/forked.py).
"""

import json
import os
import sys

import torch.distributed as dist


def main(model_dir: str, path: str, out: str, datasets_cache: str) -> None:
    import datasets

    datasets.config.HF_DATASETS_CACHE = datasets_cache
    dist.init_process_group("gloo")
    from hftrain.config import DataSection, DataSource, ModelSection
    from hftrain.data import rows, sources
    from hftrain.data.build import build_datasets
    from hftrain.errors import DataError
    from hftrain.modeling import load_tokenizer

    seen = {"read": 0, "tokenised": 0}
    read, tokenise = sources._write_json_rows, rows.RowExamples.__call__

    def counting_read(*a):
        seen["read"] += 1
        return read(*a)

    def counting_tokenise(self, batch, indices):
        seen["tokenised"] += len(indices)
        return tokenise(self, batch, indices)

    sources._write_json_rows, rows.RowExamples.__call__ = counting_read, counting_tokenise
    result = {"rank": dist.get_rank()}
    try:
        data = build_datasets(DataSection(sources=[DataSource(path=path)], max_length=16),
                              load_tokenizer(ModelSection(name_or_path=model_dir)))
        result.update(n=len(data.train), first=data.train[0]["input_ids"],
                      files=sorted(f["filename"] for f in data.train.cache_files))
    except DataError as e:
        result["error"] = str(e)
    result.update(seen)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
