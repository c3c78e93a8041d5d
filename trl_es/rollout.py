"""The rollout: a model and prompt rows in, completions and their rewards out, as one :class:`RolloutResult` (no
trainer involved).

- :class:`RolloutResult`: a rollout's completions with their rewards, in named fields; made here and by
  :class:`trl_es.agents.AgentRollout`, read by :class:`trl_es.es.fitness.MemberScores`, the completion logs and
  ``ESTrainer.evaluate``.
- Reward scoring (:class:`RewardScorer`): TRL-style reward functions and reward models applied to completions, their
  outputs checked. GRPOTrainer's contract: ``f(prompts, completions, completion_ids, **columns)`` returns a ``float``
  or ``None`` ("not applicable") per completion; ``async def`` functions are awaited together after the sync ones. A
  function sees the completion in the prompt's format, a reward model sees prompt + completion.
- The rollout (:class:`Rollout`, :func:`score_model`): generate, then score.

Shared by the trainers (a member's rollout, the evaluation), ``trl-es eval`` and the diagnostics.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import functools
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig, PreTrainedModel
from trl.data_utils import apply_chat_template, is_conversational, maybe_apply_chat_template

from .generation import GenerationEngine, eos_token_ids, generate_completions, prompt_add_special_tokens, stop_token_ids
from .rewards.names import reward_func_names


__all__ = ["RewardScorer", "Rollout", "RolloutResult", "async_reward_loop", "await_all", "build_generation_config",
           "completions_for_rewards", "ended_ids", "is_async_reward_func", "prompt_texts", "score_model", "terminated",
           "validate_dataset"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------- the result
@dataclass
class RolloutResult:
    """``n`` completions (a prompt row's ``num_generations`` consecutive) with their rewards.

    Attributes:
        rewards_per_func (`torch.Tensor`): ``(n, F)`` float32; NaN for ``None`` and invalid values.
        invalid (`torch.Tensor`): ``(n, F)`` bool: a returned NaN or +-inf.
        rewards (`torch.Tensor`): ``(n,)`` float64, ``RewardScorer.weighted``; NaN when a completion has none.
        completions, completion_ids (`list[str]`, `list[list[int]]`): Texts and token ids, tool turns included.
        prompts, reward_completions (`list`): Per completion, the prompt and completion the rewards saw (text or
            messages).
        completion_lengths, prompt_lengths (`list[int]`): Per completion, the model's tokens (no tool turns) and
            the prompt's (no padding).
        terminated (`list[bool]`): Per completion, it ended with a stop (EOS) or pad id.
        tool_calls, tool_failures (`int`): Tool calls made and failed (agent rollouts; else 0).
        seconds (`float`): Wall-clock seconds of the call.
    """

    rewards_per_func: torch.Tensor
    invalid: torch.Tensor
    rewards: torch.Tensor
    completions: list[str]
    completion_ids: list[list[int]]
    prompts: list  # an environment's prompt after reset
    reward_completions: list  # messages for conversational prompts: an agent's whole multi-turn completion
    completion_lengths: list[int]
    prompt_lengths: list[int]  # as the engines tokenize the prompt
    terminated: list[bool]  # GRPOTrainer's test for a completion not clipped at max_completion_length
    tool_calls: int = 0
    tool_failures: int = 0
    seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        """Completion tokens the model generated."""
        return sum(self.completion_lengths)

    def mask_truncated(self) -> RolloutResult:
        """``mask_truncated_completions``: a copy whose ``rewards`` are NaN where not :attr:`terminated`."""
        # rewards_per_func is kept: the per-function metrics count every completion
        ended = torch.tensor(self.terminated, dtype=torch.bool)
        return dataclasses.replace(self, rewards=torch.where(ended, self.rewards, torch.full_like(self.rewards,
                                                                                                  math.nan)))

    def split_member_rows(self, num_members: int) -> list[RolloutResult]:
        """One result per stacked member, from ``num_members`` equal consecutive blocks of rows; ``seconds`` split.

        Raises:
            ValueError: if the completions do not split into ``num_members`` equal blocks.
        """
        total = len(self.completions)
        if num_members < 1 or total % num_members:
            raise ValueError(f"{total} completions do not split into the rows of {num_members} members.")
        if num_members == 1:
            return [self]
        width = total // num_members  # completions per member
        parts = []
        for k in range(num_members):
            rows = slice(k * width, (k + 1) * width)
            parts.append(RolloutResult(  # tool counts left at 0: agent rollouts have one member a call
                **{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)
                   if f.name not in ("tool_calls", "tool_failures", "seconds")},
                seconds=self.seconds / num_members,
            ))
        return parts


# ------------------------------------------------------------------------------------------------------ reward scoring
def _is_nan_number(value) -> bool:  # a returned NaN, told apart from None's NaN
    try:
        return math.isnan(float(value))
    except (TypeError, ValueError):
        return False


def _as_float(value, name: str) -> float:
    if value is None:  # "not applicable": NaN, skipped by weighted()
        return math.nan
    if isinstance(value, bool) or isinstance(value, numbers.Real):
        return float(value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():  # numpy scalars, numpy.bool_ too
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:  # a 0-d or one-element tensor, on any device
        return float(value.item())
    raise TypeError(
        f"Reward function {name!r} returned {value!r} of type {type(value).__name__}; expected a number (int/float) "
        "or None for each completion."
    )


def is_async_reward_func(func) -> bool:
    """Whether calling ``func`` returns a coroutine (TRL's ``is_async_callable``): an ``async def``, a partial of one,
    or an instance with an ``async def __call__``."""
    while isinstance(func, functools.partial):
        func = func.func
    call = getattr(func, "__call__", None)  # noqa: B004 (an instance whose __call__ is async)
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(call)


_ASYNC_LOOP: asyncio.AbstractEventLoop | None = None
_ASYNC_LOOP_LOCK = threading.Lock()


def _shutdown_async_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    # at exit: the loop runs in another thread, so it is stopped through its own queue
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)


def async_reward_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for async rewards, run forever in a daemon thread (GRPOTrainer's), started on first use.
    """
    global _ASYNC_LOOP
    with _ASYNC_LOOP_LOCK:
        # a closed or stopped loop (after _shutdown_async_loop) is replaced by a fresh one
        if _ASYNC_LOOP is None or _ASYNC_LOOP.is_closed() or not _ASYNC_LOOP.is_running():
            loop, ready = asyncio.new_event_loop(), threading.Event()

            def run():
                asyncio.set_event_loop(loop)
                ready.set()
                loop.run_forever()

            # a thread of its own: works also when the caller runs inside a loop (a notebook)
            thread = threading.Thread(target=run, name="trl_es-async-rewards", daemon=True)
            thread.start()
            ready.wait()
            atexit.register(_shutdown_async_loop, loop, thread)
            _ASYNC_LOOP = loop
        return _ASYNC_LOOP


def await_all(awaitables: list, return_exceptions: bool = False) -> list:
    """The results, in order, of ``awaitables`` gathered on :func:`async_reward_loop`; with ``return_exceptions`` an
    exception is returned as its result.

    Raises:
        Exception: without ``return_exceptions``, the first exception of an awaitable (the others are cancelled).
    """
    async def _one(awaitable):  # any awaitable into a coroutine, which ensure_future wraps as a task
        return await awaitable

    async def _gather():
        tasks = [asyncio.ensure_future(_one(a)) for a in awaitables]
        try:
            return await asyncio.gather(*tasks, return_exceptions=return_exceptions)
        except BaseException:  # the first exception cancels the other awaitables
            for task in tasks:
                task.cancel()
            raise

    return asyncio.run_coroutine_threadsafe(_gather(), async_reward_loop()).result()


def _close_awaitables(awaitables) -> None:
    for awaitable in awaitables:  # never awaited: close coroutines, so Python does not warn about them
        if inspect.iscoroutine(awaitable):
            awaitable.close()


def _checked_rewards(output, name: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One function's output as ``(rewards, returned_nan)``: ``(n,)`` float32 (NaN for ``None``) and ``(n,)`` bool.

    Raises:
        ValueError: if ``output`` is ``None`` or does not have ``n`` values.
        TypeError: if a value is not a number or ``None``.
    """
    output = list(output) if output is not None else None
    if output is None or len(output) != n:
        got = "None" if output is None else len(output)
        raise ValueError(
            f"Reward function {name!r} returned {got} rewards, but {n} were expected (one per completion)."
        )
    rewards = torch.tensor([_as_float(v, name) for v in output], dtype=torch.float32)
    # None was mapped to NaN above; a NaN that came back as a number is invalid, not "not applicable"
    returned_nan = torch.tensor([v is not None and not isinstance(v, bool) and _is_nan_number(v) for v in output],
                                dtype=torch.bool)
    return rewards, returned_nan


class RewardScorer:
    """Scores completions with TRL-style reward functions and reward models (GRPOTrainer's arguments).

    Args:
        reward_funcs (`Callable | PreTrainedModel | str | list`): Callables (sync or async), sequence-classification
            reward models, their ids/paths, or a list of them.
        reward_weights (`list[float]`, *optional*): One finite weight per function; default all 1.
        reward_processing_classes (`PreTrainedTokenizerBase | list`, *optional*): The reward models' tokenizers.
        model_init_kwargs (`dict`, *optional*): Loads reward models given by id/path (its ``revision`` their
            tokenizers too).
        trust_remote_code (`bool`): For the reward models' and tokenizers' loads.
        chat_template_kwargs (`dict`, *optional*): For the reward tokenizers' chat templates.

    Raises:
        ValueError: if no reward function is given, or the weights or tokenizers are not one per function.
        TypeError: for an entry that is neither callable nor a model.
    """

    def __init__(self, reward_funcs, reward_weights=None, reward_processing_classes=None, model_init_kwargs=None,
                 trust_remote_code: bool = False, chat_template_kwargs: dict | None = None):
        if reward_funcs is None or (isinstance(reward_funcs, list) and not reward_funcs):
            raise ValueError("reward_funcs must be a callable, a reward model, or a non-empty list of them.")
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        self.reward_funcs: list = []
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        loaded = set()  # the reward models loaded here by id/path: their tokenizers take model_init_kwargs' revision
        for func in funcs:
            if isinstance(func, str):
                # model_init_kwargs passed whole, as GRPOTrainer does (no dtype: transformers' default)
                func = AutoModelForSequenceClassification.from_pretrained(
                    func, num_labels=1, **{"trust_remote_code": trust_remote_code, **(model_init_kwargs or {})})
                loaded.add(id(func))
            if not (callable(func) or isinstance(func, nn.Module)):
                raise TypeError(f"reward_funcs entries must be callables or reward models, got {type(func).__name__}.")
            self.reward_funcs.append(func)
        self.names = reward_func_names(self.reward_funcs)  # distinct names: metrics are kept per function
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
            if isinstance(func, PreTrainedModel) and cls is None:  # the model's own tokenizer
                revision = (model_init_kwargs or {}).get("revision") if id(func) in loaded else None
                cls = AutoTokenizer.from_pretrained(func.config._name_or_path, revision=revision,
                                                    trust_remote_code=trust_remote_code)
            if cls is not None and cls.pad_token_id is None:  # batched scoring pads
                cls.pad_token = cls.eos_token
            if isinstance(func, PreTrainedModel):
                func.config.pad_token_id = cls.pad_token_id  # sequence classification scores the last non-pad token
                func.eval()  # no dropout in scoring
            self.processing_classes.append(cls)
        self._warned_all_none = False  # GRPO's all-None warning is shown once (_warn_all_none)

    def __call__(
        self, rows: Sequence[dict], completions: Sequence, completion_ids: Sequence[list[int]], **extra
    ) -> torch.Tensor:
        """The rewards of :meth:`score`: ``(len(completions), num_funcs)`` float32, NaN for ``None`` and invalid."""
        return self.score(rows, completions, completion_ids, **extra)[0]

    def score(
        self, rows: Sequence[dict], completions: Sequence, completion_ids: Sequence[list[int]], **extra
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score completions, ``rows[j]`` the dataset row of completion ``j``; ``extra`` goes to every function.

        Returns:
            `(rewards, invalid)`: ``(len(completions), num_funcs)`` float32, NaN for ``None`` ("not applicable") and
            invalid values (NaN, +-inf); and the same shape, bool, true for invalid values.

        Raises:
            ValueError: if a function returns the wrong number of values.
            TypeError: for a value that is neither a number nor ``None``.
            Exception: what a function raises (the pending async calls are then closed or cancelled).
        """
        n = len(completions)
        prompts = [row["prompt"] for row in rows]
        # the other dataset columns as keyword lists, one value per completion
        columns = {k: [row[k] for row in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
        rewards = torch.zeros(n, len(self.reward_funcs), dtype=torch.float32)
        invalid = torch.zeros(n, len(self.reward_funcs), dtype=torch.bool)
        pending = []  # (column, awaitable): the async functions' calls, awaited together below
        try:
            for i, (func, cls, name) in enumerate(zip(self.reward_funcs, self.processing_classes, self.names,
                                                      strict=True)):
                if isinstance(func, nn.Module):
                    rewards[:, i] = self._score_with_model(func, cls, prompts, completions)
                    continue
                output = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                              **extra)
                if inspect.isawaitable(output):  # async def (or a sync wrapper returning a coroutine)
                    pending.append((i, output))
                    continue
                rewards[:, i], invalid[:, i] = _checked_rewards(output, name, n)
        except BaseException:  # a sync function raised: the pending coroutines never run
            _close_awaitables(a for _, a in pending)
            raise
        if pending:  # as GRPOTrainer: the async functions run concurrently (asyncio.gather) on a daemon loop
            outputs = await_all([a for _, a in pending])
            for (i, _), output in zip(pending, outputs, strict=True):
                rewards[:, i], invalid[:, i] = _checked_rewards(output, self.names[i], n)
        invalid |= torch.isinf(rewards)  # +-inf from a function or a reward model's logit
        # a reward model has no None: any NaN logit is invalid
        model_columns = [i for i, f in enumerate(self.reward_funcs) if isinstance(f, nn.Module)]
        for i in model_columns:
            invalid[:, i] |= torch.isnan(rewards[:, i])
        rewards[invalid] = math.nan  # kept out of the weights; ESTrainer ranks such a member worst
        self._warn_all_none(rewards, invalid, rows, completions)
        return rewards, invalid

    def _warn_all_none(self, rewards: torch.Tensor, invalid: torch.Tensor, rows: Sequence[dict],
                       completions: Sequence) -> None:
        """GRPOTrainer's warning when every reward function returned ``None`` for a completion."""
        if self._warned_all_none:  # once: every member scores the same prompts, it would repeat population_size times
            return
        all_none = (torch.isnan(rewards) & ~invalid).all(dim=1)
        if not all_none.any():
            return
        j = int(all_none.nonzero()[0])
        row_kwargs = {key: value for key, value in rows[j].items() if key != "prompt"}
        row_kwargs["prompt"], row_kwargs["completion"] = rows[j]["prompt"], completions[j]
        logger.warning(f"All reward functions returned None for the following kwargs:\n{row_kwargs}\nPlease ensure "
                       "that at least one reward function returns a valid reward. (ES leaves such a completion out "
                       "of its member's fitness; shown once.)")
        self._warned_all_none = True

    @torch.no_grad()
    def _score_with_model(self, model, tokenizer, prompts, completions) -> torch.Tensor:
        # As GRPOTrainer: a reward model scores the prompt + completion pair (it judges the answer in context), a
        # conversation rendered by its template with chat_template_kwargs.
        if is_conversational({"prompt": prompts[0]}):
            texts = [apply_chat_template({"messages": p + c}, tokenizer, **self.chat_template_kwargs)["text"]
                     for p, c in zip(prompts, completions, strict=True)]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                           add_special_tokens=False)
        device = next(model.parameters()).device
        inputs = {k: v.to(device) for k, v in inputs.items()}
        return model(**inputs).logits[:, 0].float().cpu()  # num_labels=1: one score per sequence

    def weighted(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """``sum_f w_f * r_f`` per completion, shape ``(num_completions,)``, float64; ``None`` (NaN) rewards skipped
        as in GRPO; NaN if all are ``None``."""
        # float64: finite float32 rewards never overflow into an infinite sum
        weighted = (rewards_per_func.double() * self.weights.double()[None, :]).nansum(dim=1)
        all_nan = torch.isnan(rewards_per_func).all(dim=1)  # nansum gives 0 there: put NaN back, "no reward"
        return torch.where(all_nan, torch.full_like(weighted, math.nan), weighted)


# --------------------------------------------------------------------------------------------------------- the rollout
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
