"""The rollout: a model and prompt rows in, completions and their rewards out (no trainer involved).

Shared by the trainers (one member's rollout in an ES iteration, the held-out evaluation), ``trl-es eval`` and the
diagnostics. Prompts come in TRL's dataset formats, rewards with TRL's signature.

Reward functions follow TRL's GRPOTrainer contract: ``f(prompts, completions, completion_ids, **columns)`` returns one
``float`` (or ``None``, "not applicable") per completion; extra dataset columns arrive as keyword arguments, one value
per completion. Rewards see the completion only (never prompt + completion), in the same format as the prompt
(a string, or ``[{"role": "assistant", "content": ...}]`` for conversational prompts).
"""

from __future__ import annotations

import inspect
import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig, PreTrainedModel
from trl.data_utils import is_conversational, maybe_apply_chat_template

from .generation import GenerationEngine, generate_completions

def validate_dataset(dataset, field_name: str = "train_dataset") -> None:
    """Raise a clear error if ``dataset`` is empty or has no ``prompt`` column.

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
    if columns is not None and "prompt" not in columns:
        raise ValueError(
            f"{field_name} must have a 'prompt' column (TRL's standard or conversational prompt format); "
            f"found columns {list(columns)}."
        )
    if not hasattr(dataset, "__len__"):  # an iterable (streaming) dataset
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"{field_name} is an empty iterable dataset: ES needs at least one prompt.")
        if not isinstance(first, dict) or "prompt" not in first:
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
) -> GenerationConfig:
    """A ``GenerationConfig``: greedy when ``temperature == 0`` (the ES reference's decoding), sampling otherwise."""
    pad = processing_class.pad_token_id if processing_class.pad_token_id is not None else processing_class.eos_token_id
    kwargs = {
        "max_new_tokens": max_completion_length,
        "pad_token_id": pad,
        "eos_token_id": processing_class.eos_token_id,
        "do_sample": temperature > 0,
    }
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
    kwargs.update(generation_kwargs or {})
    return GenerationConfig(**kwargs)


def _is_nan_number(value) -> bool:
    try:
        return math.isnan(float(value))
    except (TypeError, ValueError):
        return False


def _as_float(value, name: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or isinstance(value, numbers.Real):
        return float(value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():  # numpy scalars, numpy.bool_ too
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    raise TypeError(
        f"Reward function {name!r} returned {value!r} of type {type(value).__name__}; expected a number (int/float) "
        "or None for each completion."
    )


class RewardScorer:
    """Scores completions with TRL-style reward functions and reward models.

    Args:
        reward_funcs (`Callable | PreTrainedModel | str | list`): A callable, a reward model (``PreTrainedModel`` for sequence classification, or its id/path),
            or a list of them.
        reward_weights (`list[float]` or `None`): One weight per function; default all 1 (as GRPO).
        reward_processing_classes (`PreTrainedTokenizerBase | list | None`): Tokenizers of the reward models (loaded from the model path when ``None``).

    Raises:
        ValueError: if ``reward_weights`` has the wrong length, or no reward function is given.
    """

    def __init__(self, reward_funcs, reward_weights=None, reward_processing_classes=None, model_init_kwargs=None):
        if reward_funcs is None or (isinstance(reward_funcs, list) and not reward_funcs):
            raise ValueError("reward_funcs must be a callable, a reward model, or a non-empty list of them.")
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        self.reward_funcs: list = []
        for func in funcs:
            if isinstance(func, str):
                func = AutoModelForSequenceClassification.from_pretrained(func, num_labels=1, **(model_init_kwargs or {}))
            if not (callable(func) or isinstance(func, nn.Module)):
                raise TypeError(f"reward_funcs entries must be callables or reward models, got {type(func).__name__}.")
            self.reward_funcs.append(func)
        from .reward_names import reward_func_names  # distinct names: metrics are kept per function

        self.names = reward_func_names(self.reward_funcs)
        if reward_weights is None:
            reward_weights = [1.0] * len(self.reward_funcs)
        if len(reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(reward_weights)} entries but there are {len(self.reward_funcs)} reward "
                "functions; give one weight per reward function."
            )
        if not all(math.isfinite(float(w)) for w in reward_weights):
            raise ValueError(f"reward_weights must be finite numbers, got {list(reward_weights)}.")
        self.weights = torch.tensor([float(w) for w in reward_weights], dtype=torch.float32)
        classes = reward_processing_classes
        if classes is not None and not isinstance(classes, list):
            classes = [classes]
        classes = classes or [None] * len(self.reward_funcs)
        if len(classes) != len(self.reward_funcs):
            raise ValueError("reward_processing_classes must have one entry per reward function.")
        self.processing_classes = []
        for func, cls in zip(self.reward_funcs, classes, strict=True):
            if isinstance(func, PreTrainedModel) and cls is None:
                cls = AutoTokenizer.from_pretrained(func.config._name_or_path)
            if cls is not None and cls.pad_token_id is None:
                cls.pad_token = cls.eos_token
            if isinstance(func, PreTrainedModel):
                func.config.pad_token_id = cls.pad_token_id
                func.eval()
            self.processing_classes.append(cls)

    def __call__(
        self, rows: Sequence[dict], completions: Sequence, completion_ids: Sequence[list[int]], **extra
    ) -> torch.Tensor:
        """Score completions; ``rows[j]`` is the dataset row of completion ``j`` (repeat rows for several generations).

        Returns:
            `torch.Tensor`: Shape ``(len(completions), num_funcs)``, float32; NaN where a function returned ``None``
            or a non-finite number (see :meth:`score`, which tells the two apart).

        Raises:
            ValueError / TypeError: if a function returns the wrong number of values or non-numbers.
        """
        return self.score(rows, completions, completion_ids, **extra)[0]

    def score(
        self, rows: Sequence[dict], completions: Sequence, completion_ids: Sequence[list[int]], **extra
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score completions and flag invalid rewards.

        ``None`` means "not applicable" (skipped, as in GRPO). A returned number that is NaN, +inf or -inf (from a
        function, or a reward model's logit) is *invalid*: it is replaced by NaN in the rewards and flagged, so the
        caller can tell the user and keep it out of the weights (``ESTrainer`` ranks the member worst).

        Returns:
            `(rewards, invalid)`: ``rewards`` of shape ``(len(completions), num_funcs)``, float32, NaN for ``None``
            and invalid values; ``invalid`` of the same shape, bool.

        Raises:
            ValueError / TypeError: if a function returns the wrong number of values or non-numbers.
        """
        n = len(completions)
        prompts = [row["prompt"] for row in rows]
        columns = {k: [row[k] for row in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
        rewards = torch.zeros(n, len(self.reward_funcs), dtype=torch.float32)
        invalid = torch.zeros(n, len(self.reward_funcs), dtype=torch.bool)
        for i, (func, cls, name) in enumerate(zip(self.reward_funcs, self.processing_classes, self.names, strict=True)):
            if isinstance(func, nn.Module):
                rewards[:, i] = self._score_with_model(func, cls, prompts, completions)
                continue
            output = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **extra)
            if inspect.isawaitable(output):
                raise TypeError(f"Reward function {name!r} is async; ESTrainer calls reward functions synchronously.")
            output = list(output) if output is not None else None
            if output is None or len(output) != n:
                got = "None" if output is None else len(output)
                raise ValueError(
                    f"Reward function {name!r} returned {got} rewards, but {n} were expected (one per completion)."
                )
            rewards[:, i] = torch.tensor([_as_float(v, name) for v in output], dtype=torch.float32)
            # None was mapped to NaN above; a NaN that came back as a number is invalid, not "not applicable"
            returned_nan = torch.tensor([v is not None and not isinstance(v, bool) and _is_nan_number(v)
                                         for v in output], dtype=torch.bool)
            invalid[:, i] = returned_nan
        invalid |= torch.isinf(rewards)
        model_columns = [i for i, f in enumerate(self.reward_funcs) if isinstance(f, nn.Module)]
        for i in model_columns:
            invalid[:, i] |= torch.isnan(rewards[:, i])
        rewards[invalid] = math.nan
        return rewards, invalid

    @torch.no_grad()
    def _score_with_model(self, model, tokenizer, prompts, completions) -> torch.Tensor:
        # As GRPOTrainer: a reward model scores the prompt + completion pair (it judges the answer in context).
        if is_conversational({"prompt": prompts[0]}):
            texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions, strict=True)]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        device = next(model.parameters()).device
        inputs = {k: v.to(device) for k, v in inputs.items()}
        return model(**inputs).logits[:, 0].float().cpu()

    def weighted(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """``sum_f w_f * r_f`` per completion, skipping ``None`` (NaN) rewards as GRPO does; NaN if all are ``None``.

        Summed in float64, so finite float32 rewards never overflow into an infinite weighted reward.

        Returns:
            `torch.Tensor`: Shape ``(num_completions,)``, float64.
        """
        weighted = (rewards_per_func.double() * self.weights.double()[None, :]).nansum(dim=1)
        all_nan = torch.isnan(rewards_per_func).all(dim=1)
        return torch.where(all_nan, torch.full_like(weighted, math.nan), weighted)


def completions_for_rewards(texts: Sequence[str], rows: Sequence[dict]) -> list:
    """Completions in the prompt's format: a string, or ``[{"role": "assistant", "content": text}]``."""
    return [
        [{"role": "assistant", "content": text}] if is_conversational({"prompt": row["prompt"]}) else text
        for text, row in zip(texts, rows, strict=True)
    ]


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
    num_row_groups: int = 1,
    **generate_kwargs,
) -> dict:
    """Generate for ``rows`` and score: the whole rollout of one (possibly perturbed) model on a prompt batch.

    Args:
        engine (`GenerationEngine` or `None`): How to generate (default: the plain eager engine).
        num_row_groups (`int`): The rows form this many equal consecutive blocks (stacked population members).
        **generate_kwargs (`Any`): Passed to ``model.generate`` (e.g. ``synced_gpus=True``).

    Returns:
        `dict`: ``rewards_per_func`` (``(len(rows) * num_generations, F)`` float32, NaN for ``None`` and invalid
        rewards), ``invalid`` (same shape, bool: a non-finite number was returned), ``rewards`` (weighted, same
        length), ``completions`` (texts), ``completion_ids``, ``num_tokens`` (completion tokens generated).
    """
    prompts = prompt_texts(rows, processing_class, chat_template_kwargs)
    texts, ids = generate_completions(model, processing_class, prompts, generation_config, num_generations,
                                      engine=engine, num_row_groups=num_row_groups, **generate_kwargs)
    repeated_rows = [row for row in rows for _ in range(num_generations)]
    completions = completions_for_rewards(texts, repeated_rows)
    per_func, invalid = scorer.score(repeated_rows, completions, ids, **(reward_kwargs or {}))
    return {
        "rewards_per_func": per_func,
        "invalid": invalid,
        "rewards": scorer.weighted(per_func),
        "completions": texts,
        "completion_ids": ids,
        "num_tokens": sum(len(i) for i in ids),
    }



@dataclass
class Rollout:
    """One rollout as a plain callable: ``rollout(model, rows) -> scored completions``, with the settings fixed once.

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

    def __call__(self, model: nn.Module, rows: Sequence[dict], num_row_groups: int = 1,
                 reward_kwargs: dict | None = None, **generate_kwargs) -> dict:
        """Generate for ``rows`` with ``model`` as it is and score the completions.

        Args:
            model (`nn.Module`): The (possibly perturbed) model.
            rows (`Sequence[dict]`): Dataset rows with a ``prompt``; ``num_row_groups`` equal consecutive blocks
                when stacked population members share the call.
            num_row_groups (`int`): See ``rows``.
            reward_kwargs (`dict`, *optional*): Extra keyword arguments of the reward functions (TRL's
                ``trainer_state``, ``log_metric``, ...).
            **generate_kwargs (`Any`): Passed to ``model.generate``.

        Returns:
            `dict`: :func:`score_model`'s result plus ``seconds`` (wall-clock of the call).
        """
        start = time.perf_counter()
        out = score_model(model, self.processing_class, rows, self.scorer, self.generation_config,
                          self.num_generations, self.chat_template_kwargs, reward_kwargs, engine=self.engine,
                          num_row_groups=num_row_groups, **generate_kwargs)
        out["seconds"] = time.perf_counter() - start
        return out


def split_row_groups(out: dict, num_groups: int) -> list[dict]:
    """Cut a :class:`Rollout` result over ``num_groups`` equal consecutive row blocks (one per stacked member).

    Returns:
        `list[dict]`: Per block: ``rewards_per_func``, ``invalid``, ``rewards``, ``completions``, ``completion_ids``
        (slices), ``num_tokens`` (the block's completion tokens) and ``seconds`` (the call's, shared equally).

    Raises:
        ValueError: if the completions do not split into ``num_groups`` equal blocks.
    """
    total = len(out["completions"])
    if num_groups < 1 or total % num_groups:
        raise ValueError(f"{total} completions do not split into {num_groups} equal row groups.")
    width = total // num_groups
    parts = []
    for k in range(num_groups):
        block = slice(k * width, (k + 1) * width)
        parts.append({
            "rewards_per_func": out["rewards_per_func"][block],
            "invalid": out["invalid"][block],
            "rewards": out["rewards"][block],
            "completions": out["completions"][block],
            "completion_ids": out["completion_ids"][block],
            "num_tokens": sum(len(ids) for ids in out["completion_ids"][block]),
            "seconds": out.get("seconds", 0.0) / num_groups,
        })
    return parts
