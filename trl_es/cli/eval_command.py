"""``trl-es eval``: greedy accuracy, sampled pass@k and per-reward-function means on one split, graded with the
run's settings (:data:`trl_es.cli.RUN_FILE`) unless a flag or a recipe says otherwise."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from trl import ModelConfig

from ..analysis.protocol import PAPER_PROTOCOL
from ..arguments import TrlESParser
from ..files import write_json
from ..trainer.es.es_config import ESConfig
from .arguments import DEFAULT_MAX_NEW_TOKENS, EvalArguments, TaskArguments
from .loading import load_model_and_tokenizer
from .run_file import read_run_settings
from .splits import task_splits


def _split_config(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--config PATH`` (as TRL's ``TrlParser`` reads it), and ``PATH``."""
    argv = list(argv)
    if "--config" not in argv:
        return argv, None
    index = argv.index("--config")
    if index + 1 >= len(argv):
        raise ValueError("--config needs a path to a YAML recipe.")
    path = argv[index + 1]
    del argv[index : index + 2]
    return argv, path


def _given_flags(dataclass_types, argv: list[str]) -> set[str]:
    """The destinations of the flags written in ``argv`` (whatever their value)."""
    probe = TrlESParser(dataclass_types)  # a parser without defaults: only the flags written stay
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    namespace, _ = probe.parse_known_args(argv)
    return set(vars(namespace))


#: EvalArguments setting -> the ESConfig key (in a recipe or trl_es_run.json) it is read from.
_EVAL_SETTING_SOURCES = {
    "max_new_tokens": "max_completion_length",
    "sample_temperature": "temperature",
    "top_p": "top_p",
    "generation_kwargs": "generation_kwargs",
    "chat_template_kwargs": "chat_template_kwargs",
}
#: Without a flag, recipe or run value: the papers' sampling protocol (T = 0.6, top-p 0.95; trl_es.analysis.protocol).
_EVAL_DEFAULTS = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "sample_temperature": PAPER_PROTOCOL.temperature,
                  "top_p": PAPER_PROTOCOL.top_p}
_TASK_SETTINGS = ("task", "task_seed", "num_train_prompts", "num_validation_prompts", "num_eval_prompts",
                  "countdown_json")


def parse_eval_arguments(argv: list[str]):
    """Parse ``trl-es eval`` arguments and resolve every setting: flag, then recipe, then run file, then default.

    A ``--config`` recipe may be a training recipe: its ``ESConfig`` generation keys map to the eval settings
    (``max_completion_length`` -> ``max_new_tokens``, ``temperature`` -> ``sample_temperature`` when ``> 0``, ...),
    its other ``ESConfig`` keys are ignored. The run file is :func:`read_run_settings` of ``--model_name_or_path``.

    Returns:
        (`tuple[TaskArguments, EvalArguments, ModelConfig, dict]`): The resolved arguments and, per setting,
            ``{"value": ..., "source": "flag" | "recipe" | "run" | "default"}``.

    Raises:
        ValueError: On bad flags (naming them), or recipe keys that are neither eval arguments nor ESConfig fields.
    """
    import yaml

    dataclass_types = (TaskArguments, EvalArguments, ModelConfig)
    parser = TrlESParser(dataclass_types, prog="trl-es eval")
    argv, config_path = _split_config(argv)
    recipe = {}
    if config_path is not None:
        with open(config_path, encoding="utf-8") as f:
            recipe = yaml.safe_load(f) or {}
        if not isinstance(recipe, dict):
            raise ValueError(f"Config file {config_path} must contain a YAML mapping.")
        for key, value in (recipe.pop("env", None) or {}).items():  # as TrlParser
            os.environ[key] = str(value)
    known = {action.dest for action in parser._actions}
    es_fields = {f.name for f in dataclasses.fields(ESConfig)}  # a training recipe's keys are accepted
    unknown = sorted(k for k in recipe if k not in known and k not in es_fields)
    if unknown:
        raise ValueError(
            f"--config {config_path}: {unknown} are neither trl-es eval arguments nor ESConfig fields."
        )
    # the recipe's eval keys as defaults: a flag overrides
    parser.set_defaults_with_config(**{k: v for k, v in recipe.items() if k in known})
    given = _given_flags(dataclass_types, argv)
    task_args, eval_args, model_args = parser.parse_args_into_dataclasses(argv)
    run = read_run_settings(model_args.model_name_or_path)  # trl_es_run.json of the trained model, if any

    settings = {}
    for name in _TASK_SETTINGS:  # the parsed value already holds a flag's or the recipe's value
        if name in given:
            source = "flag"
        elif name in recipe:
            source = "recipe"
        elif name in run:
            source = "run"
            setattr(task_args, name, run[name])
        else:
            source = "default"
        settings[name] = {"value": getattr(task_args, name), "source": source}
    for name, es_key in _EVAL_SETTING_SOURCES.items():
        value = getattr(eval_args, name)
        source = "flag" if name in given else "recipe" if name in recipe else None
        for origin, values in (("recipe", recipe), ("run", run)):  # the ESConfig key, e.g. max_completion_length
            candidate = values.get(es_key)
            if source is not None or candidate is None:
                continue
            if name in ("sample_temperature", "top_p") and not values.get("temperature", 0) > 0:
                continue  # trained with greedy decoding: sample with the default protocol (its top_p never applied)
            value, source = candidate, origin
        if source is None:  # no flag, recipe or run value: the papers' protocol
            value, source = _EVAL_DEFAULTS.get(name), "default"
        setattr(eval_args, name, value)
        settings[name] = {"value": value, "source": source}
    TaskArguments.__post_init__(task_args)
    EvalArguments.__post_init__(eval_args)  # checks (and JSON-decodes) the resolved values
    return task_args, eval_args, model_args, settings


def evaluate(argv: list[str]) -> dict:
    """``trl-es eval``: greedy accuracy, sampled pass@1 and pass@k (Chen et al. 2021), per-reward-function means.

    One split (``--split``, default test) graded as training did (:func:`parse_eval_arguments`), else with the papers'
    protocol (:data:`trl_es.analysis.PAPER_PROTOCOL`); a completion is correct when the last reward is above 0.5.

    Returns:
        `dict`: The metrics (printed, and written to ``--output_file``), with ``settings``: each resolved setting's
            value and where it came from.

    Raises:
        ValueError: On bad arguments, ``pass_k`` above the number of samples, or an empty split.
    """
    import torch
    from accelerate import PartialState
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    from ..analysis import mean_pass_at_k, sample_policy
    from ..generation import EagerEngine
    from ..rollout import RewardScorer, build_generation_config, score_model

    task_args, eval_args, model_args, settings = parse_eval_arguments(argv)
    num_samples = eval_args.num_samples or 1  # 0 means one sample
    if max(eval_args.pass_k) > num_samples:
        raise ValueError(
            f"pass_k values must be <= num_samples ({eval_args.num_samples}; 0 means one sample), got "
            f"{eval_args.pass_k}; raise --num_samples."
        )
    task, splits = task_splits(task_args)
    dataset = splits[eval_args.split]  # default test: what reports read
    if len(dataset) == 0:
        raise ValueError(f"The {eval_args.split} split is empty; set its size (num_*_prompts) >= 1.")
    state = PartialState()
    model, tokenizer = load_model_and_tokenizer(model_args, training=False)  # a quantized base is scored as is
    model.to(state.device)
    scorer = RewardScorer(task.reward_funcs)
    answer = len(scorer.names) - 1  # the answer reward: > 0.5 = correct
    rows = [dataset[i] for i in range(len(dataset))]
    common = {"top_p": eval_args.top_p, "generation_kwargs": eval_args.generation_kwargs,
              "model_generation_config": model.generation_config}  # its end-of-turn ids end completions
    greedy = build_generation_config(tokenizer, eval_args.max_new_tokens, 0.0, **common)
    sampled = build_generation_config(tokenizer, eval_args.max_new_tokens, eval_args.sample_temperature, **common)
    engine = EagerEngine(share_prompt_prefix=True)  # training's engine: a shared prefix is computed once
    local = []  # per prompt: greedy rewards per function, sampled rewards per function (n rows), correct samples
    entropy = [0.0, 0]  # this process's token entropy sum (nats) and tokens, over its sampled completions
    with state.split_between_processes(list(range(len(rows)))) as mine:  # each process grades its own prompts
        shown = state.is_main_process
        greedy_rows = []
        bar = tqdm(total=len(mine), unit="completion", disable=not shown, desc=f"{eval_args.split}: greedy completions")
        with bar, torch.random.fork_rng(devices=[state.device] if state.device.type == "cuda" else []):
            if greedy.do_sample:  # generation_kwargs={"do_sample": True}: seeded as the sampled pass
                torch.manual_seed(task_args.task_seed + state.process_index)
            for first in range(0, len(mine), eval_args.batch_size):
                batch = [rows[i] for i in mine[first : first + eval_args.batch_size]]
                out = score_model(model, tokenizer, batch, scorer, greedy, 1, eval_args.chat_template_kwargs,
                                  engine=engine)
                greedy_rows.extend(out.rewards_per_func.tolist())
                bar.update(len(out.completions))
        if mine:  # the sampled pass that evaluate_policy runs (shared prefix, token entropy), seeded per process
            out = sample_policy(model, tokenizer, [rows[i] for i in mine], scorer, sampled, num_samples,
                                eval_args.sample_batch_size, seed=task_args.task_seed + state.process_index,
                                chat_template_kwargs=eval_args.chat_template_kwargs, progress=shown)
            for j, samples in enumerate(out["rewards_per_func"].tolist()):
                local.append((greedy_rows[j], samples, out["correct"][j]))
            entropy = [out["token_entropy_sum"], out["token_entropy_tokens"]]
    results = gather_object(local)  # every process's prompts, in process order
    entropy_sum, entropy_tokens = (sum(values) for values in zip(*gather_object([entropy]), strict=True))
    metrics = {
        "task": task.name, "split": eval_args.split, "num_prompts": len(results), "num_samples": num_samples,
        "sample_temperature": eval_args.sample_temperature, "top_p": eval_args.top_p,
        "max_new_tokens": eval_args.max_new_tokens,
        "accuracy_greedy": sum(g[answer] > 0.5 for g, _, _ in results) / len(results),
        "token_entropy": entropy_sum / entropy_tokens if entropy_tokens else None,
        "token_entropy_tokens": entropy_tokens,
    }
    for k in sorted({1, *eval_args.pass_k}):  # pass@1 always: the sampled accuracy
        metrics[f"pass@{k}"] = mean_pass_at_k(num_samples, [c for _, _, c in results], k)
    for f, name in enumerate(scorer.names):
        greedy_values = [g[f] for g, _, _ in results if g[f] == g[f]]  # NaN (None rewards) skipped
        sampled_values = [s[f] for _, samples, _ in results for s in samples if s[f] == s[f]]
        # each reward function under its distinct name
        metrics[f"greedy_rewards/{name}/mean"] = sum(greedy_values) / len(greedy_values) if greedy_values else None
        metrics[f"sampled_rewards/{name}/mean"] = (
            sum(sampled_values) / len(sampled_values) if sampled_values else None
        )
    metrics["settings"] = settings
    if state.is_main_process:
        print(
            f"{task.name} {eval_args.split} split, {len(results)} prompts: greedy accuracy "
            f"{metrics['accuracy_greedy']:.3f} | sampled pass@1 {metrics['pass@1']:.3f} "
            f"(temperature {eval_args.sample_temperature:g}, {num_samples} sample(s) per prompt, "
            f"max_new_tokens {eval_args.max_new_tokens})"
        )
        print(json.dumps(metrics, indent=2))
        if eval_args.output_file:
            write_json(eval_args.output_file, metrics)
    return metrics
