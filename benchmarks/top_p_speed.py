"""Top-p per decoding step: transformers' ``TopPLogitsWarper`` (a sort of every row's vocabulary) against
:class:`trl_es.generation.top_p.CandidateTopPLogitsWarper` (a top-k of ``--candidates``), and the bare ``torch.sort``
/ ``torch.topk`` they are built on; then the draw that follows: transformers' ``softmax`` + ``torch.multinomial`` of
the truncated scores (``transformers_draw``) against :class:`trl_es.generation.sampling.CandidateSampler`, which
truncates and draws in one (``candidate_sampler``, what ``sample_policy`` runs); seconds per step, one scores tensor
of ``--rows x --vocab`` float32.

Scores: random logits scaled so that the T = 0.6 softmax is peaked like a trained LM's (``--scale``), so the nucleus
sits inside the candidates (no fallback; the count of fallback rows is printed). Each variant runs once untimed, then
the median of ``--repeats`` is reported. The table in docs/benchmarks.md ("Sampling per decoding step"):

    python benchmarks/top_p_speed.py --threads 1 --output_file runs/top_p_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import TopPLogitsWarper

from trl_es.files import write_json
from trl_es.generation.sampling import CandidateSampler
from trl_es.generation.top_p import CandidateTopPLogitsWarper


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128, help="Rows per step (prompts x samples).")
    parser.add_argument("--vocab", type=int, default=49152, help="Vocabulary size (SmolLM2: 49,152).")
    parser.add_argument("--candidates", type=int, default=256)
    parser.add_argument("--top_p", type=float, default=0.95)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--scale", type=float, default=4.0, help="Logit standard deviation.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output_file", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(args.rows, args.vocab, generator=generator) * args.scale
    ids = torch.zeros(args.rows, 1, dtype=torch.long)
    candidate = CandidateTopPLogitsWarper(args.top_p, args.temperature, args.candidates)
    hf = TopPLogitsWarper(args.top_p)
    sampler = CandidateSampler(args.temperature, args.top_p, args.candidates)
    truncated = candidate(ids, scores) / args.temperature  # what transformers' sampling step draws from
    variants = {
        "torch_sort": lambda: torch.sort(scores, dim=-1, descending=True),
        "torch_topk": lambda: torch.topk(scores, args.candidates, dim=-1),
        "transformers_top_p": lambda: hf(ids, scores / args.temperature),
        "candidate_top_p": lambda: candidate(ids, scores),
        "transformers_draw": lambda: torch.multinomial(truncated.softmax(dim=-1), num_samples=1),
        "candidate_sampler": lambda: sampler(ids, scores),
    }
    result = {"threads": torch.get_num_threads(), "settings": vars(args), "seconds_per_step": {}}
    for name, fn in variants.items():
        fn()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        result["seconds_per_step"][name] = statistics.median(times)
        print(f"{name}: {statistics.median(times):.4f} s per step (median of {args.repeats})", flush=True)
    kept_hf = ~torch.isinf(hf(ids, scores / args.temperature))
    kept_candidate = ~torch.isinf(candidate(ids, scores))
    result["same_kept_sets"] = bool(torch.equal(kept_hf, kept_candidate))
    result["fallback_rows_per_step"] = candidate.fallback_rows / (args.repeats + 3)  # warm-up, repeats, 2 more
    drawn = sampler(ids, scores).argmax(dim=-1)
    result["candidate_sampler_draws_in_nucleus"] = bool(kept_hf.gather(1, drawn[:, None]).all())
    result["mean_kept_tokens"] = float(kept_hf.sum(dim=-1).float().mean())
    print(json.dumps(result, indent=2))
    if args.output_file:
        write_json(args.output_file, result)
    return result


if __name__ == "__main__":
    main()
