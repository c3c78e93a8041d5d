"""``trl-es analyze``: the ES-vs-GRPO diagnostics (drift, off-task KL, functional sparsity, mode connectivity) of one
or two checkpoints, as a JSON report and PNG plots."""

from __future__ import annotations

import os

from ..arguments import TrlESParser
from .arguments import AnalyzeArguments, TaskArguments
from .splits import task_splits


def analyze(argv: list[str]) -> dict:
    """``trl-es analyze``: :func:`trl_es.analysis.analyze` of one or two checkpoints, rewards on the test split."""
    from ..analysis import analyze as run_analysis
    from ..models import resolve_model_path
    from ..rollout import RewardScorer, build_generation_config, score_model

    parser = TrlESParser((AnalyzeArguments, TaskArguments), prog="trl-es analyze")
    analyze_args, task_args = parser.parse_args_and_config(argv)
    if analyze_args.model_a is None:
        raise ValueError("trl-es analyze needs --model_a (a trained checkpoint).")
    base_path = resolve_model_path(analyze_args.base_model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    task, splits = task_splits(task_args)
    held_out = splits["test"]
    rows = [held_out[i] for i in range(len(held_out))]
    scorer = RewardScorer(task.reward_funcs[-1:])  # the answer reward only: the task's last

    def reward_fn(model) -> float:
        config = build_generation_config(tokenizer, analyze_args.max_new_tokens,
                                         model_generation_config=getattr(model, "generation_config", None))
        # greedy; None rewards skipped
        return float(score_model(model, tokenizer, rows, scorer, config).rewards.nanmean())

    # Off-task prompts for the KL: another task's prompts (arithmetic <-> countdown).
    off_task = "countdown" if task_args.task != "countdown" else "arithmetic"
    from ..tasks import get_task

    kl_rows = get_task(off_task).build_dataset(analyze_args.num_kl_prompts, seed=1)  # seed 1: not the task's own rows
    report = run_analysis(
        base_path, resolve_model_path(analyze_args.model_a),
        resolve_model_path(analyze_args.model_b) if analyze_args.model_b else None,
        tokenizer=tokenizer, prompts=[r["prompt"] for r in kl_rows], reward_fn=reward_fn,
        output_dir=analyze_args.analysis_dir, max_new_tokens=analyze_args.max_new_tokens,
    )
    print(f"wrote {os.path.join(analyze_args.analysis_dir, 'report.json')}")
    return report
