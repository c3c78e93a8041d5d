"""Build the embedded-model cache from a chosen rank of a torch.distributed (gloo) job; the other ranks wait.

    torchrun --nproc_per_node 2 build_embedded_cache.py --builder 1 0 --out result_dir

The GGUF de-quantization is replaced by a tiny Llama (the cache logic is what is tested). For each ``--builder`` rank
in turn (one launch, a fresh cache each: ``$TRL_ES_CACHE/builder<rank>``), the builder rank calls
``embedded_model_path()`` while torch.distributed is up; after a barrier every rank calls it again (it must find a
usable cache and not rebuild) and loads the model from it. Rank 0 writes ``result_dir/builder<rank>.json``.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tiny import build_llama, build_tokenizer  # noqa: E402

from trl_es import models  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--builder", type=int, nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = build_tokenizer()
    cache_root = os.environ["TRL_ES_CACHE"]
    builds = []

    def fake_gguf():
        builds.append(rank)
        return build_llama(tokenizer, seed=1), tokenizer

    models._load_gguf = fake_gguf
    for builder in args.builder:
        os.environ["TRL_ES_CACHE"] = os.path.join(cache_root, f"builder{builder}")
        builds.clear()
        if rank == builder:
            models.embedded_model_path()
        dist.barrier()
        path = models.embedded_model_path()
        model, _ = models.load_model_and_tokenizer(None)
        expected = build_llama(tokenizer, seed=1).state_dict()
        equal = all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)
        report = {"rank": rank, "builds": len(builds), "path": path, "files": sorted(os.listdir(path)), "equal": equal}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, report)
        if rank == 0:
            with open(os.path.join(args.out, f"builder{builder}.json"), "w") as f:
                json.dump(gathered, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
