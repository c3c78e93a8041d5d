"""The rollout: a model and prompt rows in, completions and their rewards out, as a
:class:`~trl_es.rewards.RolloutResult` (no trainer involved).

Shared by the trainers (a member's rollout, the evaluation), ``trl-es eval`` and the diagnostics.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import GenerationConfig
from trl.data_utils import is_conversational, maybe_apply_chat_template

from .generation import GenerationEngine, eos_token_ids, generate_completions, prompt_add_special_tokens, stop_token_ids
from .rewards import RewardScorer, RolloutResult


__all__ = ["Rollout", "RolloutResult", "build_generation_config", "completions_for_rewards", "ended_ids",
           "prompt_texts", "score_model", "terminated", "validate_dataset"]


def validate_dataset(dataset, field_name: str = "train_dataset", prompt_required: bool = True) -> None:
    """Check that ``dataset`` (map-style or iterable) has rows and a ``prompt`` column; ``None`` passes.

    ``prompt_required=False`` when an environment supplies the prompt (GRPO's ``environment_factory``).

    Raises:
        ValueError: naming ``field_name``, for an empty dataset or one without ``prompt``.
    """
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns and prompt_required:  # declared columns, when there are any
        raise ValueError(
            f"{field_name} must have a 'prompt' column (TRL's standard or conversational prompt format); "
            f"found columns {list(columns)}."
        )
    if not hasattr(dataset, "__len__"):  # an iterable (streaming) dataset: its first row is read
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"{field_name} is an empty iterable dataset: ES needs at least one prompt.")
        if not isinstance(first, dict) or ("prompt" not in first and prompt_required):
            found = sorted(first) if isinstance(first, dict) else type(first).__name__
            raise ValueError(f"{field_name} must yield rows with a 'prompt' field (TRL's standard or conversational "
                             f"prompt format); its first row has {found}.")
        return
    if len(dataset) == 0:
        raise ValueError(f"{field_name} is empty: ES needs at least one prompt.")


def prompt_texts(rows: Sequence[dict], processing_class, chat_template_kwargs: dict | None = None) -> list[str]:
    """One prompt string per row; conversational prompts go through the tokenizer's chat template.

    Raises:
        ValueError: for a row without ``prompt``.
    """
    for row in rows:
        if "prompt" not in row:
            raise ValueError(f"Dataset row without a 'prompt' field: keys {sorted(row)}.")
    kwargs = chat_template_kwargs or {}
    return [maybe_apply_chat_template({"prompt": row["prompt"]}, processing_class, **kwargs)["prompt"] for row in rows]


def build_generation_config(
    processing_class,
    max_completion_length: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generation_kwargs: dict | None = None,
    model_generation_config: GenerationConfig | None = None,
) -> GenerationConfig:
    """GRPOTrainer's ``GenerationConfig``: greedy at ``temperature == 0`` (the ES reference's decoding), else sampling.

    Args:
        processing_class (`PreTrainedTokenizerBase`): The tokenizer.
        max_completion_length (`int`): ``max_new_tokens``.
        temperature (`float`): ``0``: greedy (sampling at 1.0 if ``generation_kwargs`` set ``do_sample=True``);
            ``> 0``: sampling at this temperature, with ``top_p`` and ``top_k=0``.
        top_p (`float`): Nucleus mass when sampling.
        generation_kwargs (`dict`, *optional*): Any ``GenerationConfig`` field, applied last.
        model_generation_config (`GenerationConfig`, *optional*): The model's; its EOS ids end completions too.

    Returns:
        `GenerationConfig`: ``eos_token_id`` an int (one id) or a list of ints.

    Raises:
        ValueError: from ``GenerationConfig`` for inconsistent settings.
    """
    eos = eos_token_ids(processing_class, model_generation_config)  # the tokenizer's and the model's, as GRPO
    pad = processing_class.pad_token_id  # the tokenizer's pads the prompts; else the model's, else the first EOS
    if pad is None:
        pad = getattr(model_generation_config, "pad_token_id", None)
    if pad is None and eos:
        pad = eos[0]
    # set explicitly, as GRPO: generate() fills unset values from the model's generation_config (a shipped
    # repetition_penalty=3.0 or do_sample=True); min_p and what GRPO leaves unset still come from there
    kwargs = {
        "max_new_tokens": max_completion_length,
        "pad_token_id": pad,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "do_sample": temperature > 0,
        "repetition_penalty": 1.0,  # GRPO's default, explicit: a model's own penalty must not apply
    }
    if bool((generation_kwargs or {}).get("do_sample", temperature > 0)):  # sampling values only when sampling
        kwargs.update(temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=0)  # 1.0: GRPO's
    kwargs.update(generation_kwargs or {})  # eos_token_id too
    return GenerationConfig(**kwargs)


def completions_for_rewards(texts: Sequence[str], rows: Sequence[dict]) -> list:
    """Completions in the prompt's format: a string, or ``[{"role": "assistant", "content": text}]``."""
    return [
        [{"role": "assistant", "content": text}] if is_conversational({"prompt": row["prompt"]}) else text
        for text, row in zip(texts, rows, strict=True)
    ]


def ended_ids(generation_config: GenerationConfig, model: nn.Module, processing_class) -> set[int]:
    """The ids a terminated (not clipped) completion ends with, as GRPOTrainer: the stop ids and the pad id."""
    ends = set(stop_token_ids(generation_config, model, processing_class))
    pad = generation_config.pad_token_id
    pad = processing_class.pad_token_id if pad is None else pad
    if pad is not None:
        ends.add(int(pad))
    return ends


def terminated(completion_ids: Sequence[list[int]], ends: set[int]) -> list[bool]:
    """Per completion: it is not empty and its last id is one of ``ends`` (:func:`ended_ids`)."""
    return [bool(ids) and int(ids[-1]) in ends for ids in completion_ids]


def score_model(
    model: nn.Module,
    processing_class,
    rows: Sequence[dict],
    scorer: RewardScorer,
    generation_config: GenerationConfig,
    num_generations: int = 1,
    chat_template_kwargs: dict | None = None,
    reward_kwargs: dict | None = None,
    engine: GenerationEngine | None = None,
    num_members: int = 1,
    **generate_kwargs,
) -> RolloutResult:
    """One model's rollout: ``num_generations`` completions for each of ``rows``, scored (:class:`Rollout`'s arguments).

    Returns:
        `RolloutResult`: ``len(rows) * num_generations`` completions, a row's consecutive; ``seconds`` 0.
    """
    prompts = prompt_texts(rows, processing_class, chat_template_kwargs)
    special = prompt_add_special_tokens([row["prompt"] for row in rows[:1]])  # plain text: BOS as in GRPO
    texts, ids = generate_completions(model, processing_class, prompts, generation_config, num_generations,
                                      engine=engine, num_row_groups=num_members, add_special_tokens=special,
                                      **generate_kwargs)
    repeated_rows = [row for row in rows for _ in range(num_generations)]  # a row's completions consecutive
    completions = completions_for_rewards(texts, repeated_rows)
    per_func, invalid = scorer.score(repeated_rows, completions, ids, **(reward_kwargs or {}))
    ends = ended_ids(generation_config, model, processing_class)  # terminated vs clipped, as GRPO
    # the engines' tokenization: special tokens for plain text, none for chat-templated prompts (as GRPO), no padding
    lengths = [len(p) for p in processing_class(text=list(prompts), add_special_tokens=special)["input_ids"]]
    return RolloutResult(
        rewards_per_func=per_func,
        invalid=invalid,
        rewards=scorer.weighted(per_func),
        completions=texts,
        completion_ids=ids,
        prompts=[row["prompt"] for row in repeated_rows],
        reward_completions=completions,
        completion_lengths=[len(i) for i in ids],
        prompt_lengths=[length for length in lengths for _ in range(num_generations)],
        terminated=terminated(ids, ends),
    )


@dataclass
class Rollout:
    """``rollout(model, rows) -> RolloutResult``: :func:`score_model` with the settings bound; no trainer, no
    perturbation (an ES population applies its members around the call)."""

    processing_class: Any  # the tokenizer
    scorer: RewardScorer
    generation_config: GenerationConfig
    num_generations: int = 1  # completions per prompt row
    chat_template_kwargs: dict | None = None
    engine: GenerationEngine | None = None  # None: the plain eager engine

    def __call__(self, model: nn.Module, rows: Sequence[dict], num_members: int = 1,
                 reward_kwargs: dict | None = None, **generate_kwargs) -> RolloutResult:
        """Generate for ``rows`` (``num_members`` equal consecutive blocks of stacked members) with ``model`` as it is,
        and score; ``reward_kwargs`` go to the reward functions, ``generate_kwargs`` to ``model.generate``.

        Returns:
            `RolloutResult`: with ``seconds`` the wall-clock of the call.
        """
        start = time.perf_counter()
        out = score_model(model, self.processing_class, rows, self.scorer, self.generation_config,
                          self.num_generations, self.chat_template_kwargs, reward_kwargs, engine=self.engine,
                          num_members=num_members, **generate_kwargs)
        out.seconds = time.perf_counter() - start
        return out
