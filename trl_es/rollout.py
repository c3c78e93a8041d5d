"""The rollout: a model and prompt rows in, completions and their rewards out (no trainer involved).

Shared by the trainers (one member's rollout in an ES iteration, the held-out evaluation), ``trl-es eval`` and the
diagnostics. Prompts come in TRL's dataset formats; the rewards are scored by :class:`trl_es.rewards.RewardScorer`
(TRL's reward-function contract) and returned as a :class:`trl_es.rewards.RolloutResult`.
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
    """Raise a clear error if ``dataset`` is empty or has no ``prompt`` column (``prompt_required=False``: an
    environment supplies the prompt, as GRPO's ``environment_factory`` may).

    A map-style dataset (``datasets.Dataset``, a list of rows) is checked by its columns and length. An iterable one
    (``datasets.IterableDataset``, e.g. ``load_dataset(..., streaming=True)`` or ``Dataset.to_iterable_dataset()``)
    has no length: its declared columns are checked when it has them, and its first row is read to check that the
    stream is not empty and has a ``prompt``.

    Raises:
        ValueError: naming ``field_name``.
    """
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns and prompt_required:
        raise ValueError(
            f"{field_name} must have a 'prompt' column (TRL's standard or conversational prompt format); "
            f"found columns {list(columns)}."
        )
    if not hasattr(dataset, "__len__"):  # an iterable (streaming) dataset
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
    """The prompt strings given to the model: conversational prompts go through the chat template.

    Args:
        rows (`Sequence[dict]`): Dataset rows, each with a ``prompt`` (string or list of messages).
        processing_class (`PreTrainedTokenizerBase`): The tokenizer.

    Returns:
        `list[str]`: One string per row.
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
    """A ``GenerationConfig``: greedy when ``temperature == 0`` (the ES reference's decoding), sampling otherwise.

    Completions end at every id of :func:`trl_es.generation.eos_token_ids`: the tokenizer's ``eos_token_id`` and
    the model's ``generation_config.eos_token_id`` (an int or a list, e.g. Gemma-3-it's ``<end_of_turn>``), as in
    TRL's ``GRPOTrainer``; one id stays an int. The pad id is the tokenizer's (it pads the prompts), else the
    model's, else the first EOS id. ``generation_kwargs`` (``eos_token_id`` too) win over all.

    The decoding values are set explicitly, as GRPOTrainer sets them (``generate`` fills every setting left unset
    from the model's ``generation_config``: a model shipped with ``repetition_penalty=3.0`` or ``do_sample=True``
    would otherwise decode with it): ``do_sample`` and ``repetition_penalty=1.0`` always; when the config samples
    (``temperature > 0``, or ``generation_kwargs={"do_sample": True}``) also ``temperature`` (``1.0``, GRPO's
    default, when ``temperature`` is 0), ``top_p`` and ``top_k=0``. ``min_p`` stays unset unless
    ``generation_kwargs`` give it, as GRPO leaves its ``min_p=None``. Settings GRPO does not set either (e.g.
    ``no_repeat_ngram_size``) are still filled from the model's ``generation_config``, as in GRPO.

    Args:
        processing_class (`PreTrainedTokenizerBase`): The tokenizer.
        max_completion_length (`int`): ``max_new_tokens``.
        temperature (`float`): ``0``: greedy (unless ``generation_kwargs`` set ``do_sample=True``: then sampling
            at temperature 1.0); ``> 0``: sampling at this temperature, with ``top_p`` and ``top_k=0``.
        top_p (`float`): Nucleus mass when sampling.
        generation_kwargs (`dict`, *optional*): Any ``GenerationConfig`` field, applied last.
        model_generation_config (`GenerationConfig`, *optional*): The model's ``model.generation_config``;
            ``None``: the tokenizer's EOS only.

    Returns:
        `GenerationConfig`: ``eos_token_id`` an int or a list of ints.

    Raises:
        ValueError: from ``GenerationConfig`` for inconsistent settings.
    """
    eos = eos_token_ids(processing_class, model_generation_config)
    pad = processing_class.pad_token_id
    if pad is None:
        pad = getattr(model_generation_config, "pad_token_id", None)
    if pad is None and eos:
        pad = eos[0]
    kwargs = {
        "max_new_tokens": max_completion_length,
        "pad_token_id": pad,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "do_sample": temperature > 0,
        "repetition_penalty": 1.0,  # GRPO's default, explicit: a model's own penalty must not apply
    }
    if bool((generation_kwargs or {}).get("do_sample", temperature > 0)):  # sampling values only when sampling
        kwargs.update(temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=0)
    kwargs.update(generation_kwargs or {})
    return GenerationConfig(**kwargs)


def completions_for_rewards(texts: Sequence[str], rows: Sequence[dict]) -> list:
    """Completions in the prompt's format: a string, or ``[{"role": "assistant", "content": text}]``."""
    return [
        [{"role": "assistant", "content": text}] if is_conversational({"prompt": row["prompt"]}) else text
        for text, row in zip(texts, rows, strict=True)
    ]


def ended_ids(generation_config: GenerationConfig, model: nn.Module, processing_class) -> set[int]:
    """The ids a terminated completion ends with: the stop ids (:func:`~trl_es.generation.stop_token_ids`) and the
    pad id, as GRPOTrainer tells a terminated completion from a clipped one."""
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
    """Generate ``num_generations`` completions for each of ``rows`` and score them: one model's whole rollout.

    Args:
        engine (`GenerationEngine` or `None`): How to generate (default: the plain eager engine).
        num_members (`int`): Stacked members sharing the call: ``rows`` are this many equal consecutive blocks.
        **generate_kwargs (`Any`): Passed to ``model.generate`` (e.g. ``synced_gpus=True``).

    Returns:
        `RolloutResult`: ``len(rows) * num_generations`` completions, a row's consecutive; ``seconds`` 0 (the
        :class:`Rollout` call times itself).
    """
    prompts = prompt_texts(rows, processing_class, chat_template_kwargs)
    special = prompt_add_special_tokens([row["prompt"] for row in rows[:1]])  # plain text: BOS as in GRPO
    texts, ids = generate_completions(model, processing_class, prompts, generation_config, num_generations,
                                      engine=engine, num_row_groups=num_members, add_special_tokens=special,
                                      **generate_kwargs)
    repeated_rows = [row for row in rows for _ in range(num_generations)]
    completions = completions_for_rewards(texts, repeated_rows)
    per_func, invalid = scorer.score(repeated_rows, completions, ids, **(reward_kwargs or {}))
    ends = ended_ids(generation_config, model, processing_class)
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
    """One rollout as a plain callable: ``rollout(model, rows) -> RolloutResult``, with the settings fixed once.

    :func:`score_model` with the processing class, reward scorer, generation config and engine bound: it holds no
    trainer, and knows nothing of perturbations (an ES population applies its members around the call).

    Attributes:
        processing_class: The tokenizer.
        scorer (`RewardScorer`): The reward functions and weights.
        generation_config (`GenerationConfig`): Decoding settings.
        num_generations (`int`): Completions per prompt row.
        chat_template_kwargs (`dict`, *optional*): For conversational prompts.
        engine (`GenerationEngine`, *optional*): How to generate (default: the plain eager engine).
    """

    processing_class: Any
    scorer: RewardScorer
    generation_config: GenerationConfig
    num_generations: int = 1
    chat_template_kwargs: dict | None = None
    engine: GenerationEngine | None = None

    def __call__(self, model: nn.Module, rows: Sequence[dict], num_members: int = 1,
                 reward_kwargs: dict | None = None, **generate_kwargs) -> RolloutResult:
        """Generate for ``rows`` with ``model`` as it is and score the completions.

        Args:
            model (`nn.Module`): The (possibly perturbed) model.
            rows (`Sequence[dict]`): Dataset rows with a ``prompt``; ``num_members`` equal consecutive blocks when
                stacked population members share the call.
            num_members (`int`): See ``rows``.
            reward_kwargs (`dict`, *optional*): Extra keyword arguments of the reward functions (TRL's
                ``trainer_state``, ``log_metric``, ...).
            **generate_kwargs (`Any`): Passed to ``model.generate``.

        Returns:
            `RolloutResult`: :func:`score_model`'s, with ``seconds`` the wall-clock of the call.
        """
        start = time.perf_counter()
        out = score_model(model, self.processing_class, rows, self.scorer, self.generation_config,
                          self.num_generations, self.chat_template_kwargs, reward_kwargs, engine=self.engine,
                          num_members=num_members, **generate_kwargs)
        out.seconds = time.perf_counter() - start
        return out
