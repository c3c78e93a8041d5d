"""Reward scoring: TRL-style reward functions and reward models applied to completions, their outputs checked.

GRPOTrainer's contract: ``f(prompts, completions, completion_ids, **columns)`` returns a ``float`` or ``None`` ("not
applicable") per completion; ``async def`` functions are awaited together after the sync ones. A function sees the
completion in the prompt's format, a reward model sees prompt + completion.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import logging
import math
import numbers
import threading
from collections.abc import Sequence

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel
from trl.data_utils import apply_chat_template, is_conversational

from .names import reward_func_names


__all__ = ["RewardScorer", "async_reward_loop", "await_all", "is_async_reward_func"]

logger = logging.getLogger(__name__)


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
