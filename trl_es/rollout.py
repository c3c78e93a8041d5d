"""The rollout: a model and prompt rows in, completions and their rewards out (no trainer involved).

Shared by the trainers (one member's rollout in an ES iteration, the held-out evaluation), ``trl-es eval`` and the
diagnostics. Prompts come in TRL's dataset formats, rewards with TRL's signature.

Reward functions follow TRL's GRPOTrainer contract: ``f(prompts, completions, completion_ids, **columns)`` returns one
``float`` (or ``None``, "not applicable") per completion; extra dataset columns arrive as keyword arguments, one value
per completion. A function may be ``async def`` (or return an awaitable): as in GRPOTrainer, the async functions of a
rollout are awaited together (``asyncio.gather``, concurrently) on an event loop in a daemon thread, after the sync
ones, and their outputs are checked the same way. Rewards see the completion only (never prompt + completion), in the
same format as the prompt (a string, or ``[{"role": "assistant", "content": ...}]`` for conversational prompts).
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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig, PreTrainedModel
from trl.data_utils import apply_chat_template, is_conversational, maybe_apply_chat_template

from .generation import GenerationEngine, eos_token_ids, generate_completions, prompt_add_special_tokens, stop_token_ids


logger = logging.getLogger(__name__)

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


def is_async_reward_func(func) -> bool:
    """Whether calling ``func`` returns a coroutine, as TRL's ``is_async_callable`` tells it: an ``async def``
    function, a ``functools.partial`` of one, or an instance whose ``__call__`` is ``async def``.

    Args:
        func (`Callable`): A reward function.

    Returns:
        `bool`: ``True`` for an async reward function.
    """
    while isinstance(func, functools.partial):
        func = func.func
    call = getattr(func, "__call__", None)  # noqa: B004 (an instance whose __call__ is async)
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(call)


_ASYNC_LOOP: asyncio.AbstractEventLoop | None = None
_ASYNC_LOOP_LOCK = threading.Lock()


def _shutdown_async_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)


def async_reward_loop() -> asyncio.AbstractEventLoop:
    """The event loop async reward functions run on: one per process, running forever in a daemon thread (started at
    the first call, stopped at exit), as GRPOTrainer does; so it works also where the caller is itself inside a
    running loop (a notebook).

    Returns:
        `asyncio.AbstractEventLoop`: The running loop.
    """
    global _ASYNC_LOOP
    with _ASYNC_LOOP_LOCK:
        if _ASYNC_LOOP is None or _ASYNC_LOOP.is_closed() or not _ASYNC_LOOP.is_running():
            loop, ready = asyncio.new_event_loop(), threading.Event()

            def run():
                asyncio.set_event_loop(loop)
                ready.set()
                loop.run_forever()

            thread = threading.Thread(target=run, name="trl_es-async-rewards", daemon=True)
            thread.start()
            ready.wait()
            atexit.register(_shutdown_async_loop, loop, thread)
            _ASYNC_LOOP = loop
        return _ASYNC_LOOP


def await_all(awaitables: list, return_exceptions: bool = False) -> list:
    """Run ``awaitables`` concurrently (``asyncio.gather``) on :func:`async_reward_loop`; their results in order.

    Args:
        awaitables (`list`): Coroutines or futures (async reward functions' or tools' calls).
        return_exceptions (`bool`): Return an awaitable's exception as its result (the tool loop's errors) instead
            of raising it.

    Raises:
        Exception: without ``return_exceptions``, the first exception of an awaitable (the others are cancelled).
    """
    async def _one(awaitable):
        return await awaitable

    async def _gather():
        tasks = [asyncio.ensure_future(_one(a)) for a in awaitables]
        try:
            return await asyncio.gather(*tasks, return_exceptions=return_exceptions)
        except BaseException:
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
    """Scores completions with TRL-style reward functions and reward models.

    Args:
        reward_funcs (`Callable | PreTrainedModel | str | list`): A callable (sync or ``async def``), a reward model
            (``PreTrainedModel`` for sequence classification, or its id/path), or a list of them.
        reward_weights (`list[float]` or `None`): One weight per function; default all 1 (as GRPO).
        reward_processing_classes (`PreTrainedTokenizerBase | list | None`): Tokenizers of the reward models (loaded
            from the model path when ``None``).
        model_init_kwargs (`dict`, *optional*): For reward models given by id/path, passed whole as GRPOTrainer passes
            ``args.model_init_kwargs`` (so without a ``dtype`` transformers' ``"auto"``); its ``revision`` also loads
            their tokenizers.
        trust_remote_code (`bool`): Passed to the reward models' and their tokenizers' loads (GRPO's option).
        chat_template_kwargs (`dict`, *optional*): Passed to the reward tokenizers' chat templates for conversational
            prompts (GRPO's ``args.chat_template_kwargs``, e.g. ``{"enable_thinking": False}``).

    Raises:
        ValueError: if ``reward_weights`` has the wrong length, or no reward function is given.
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
                func = AutoModelForSequenceClassification.from_pretrained(
                    func, num_labels=1, **{"trust_remote_code": trust_remote_code, **(model_init_kwargs or {})})
                loaded.add(id(func))
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
                revision = (model_init_kwargs or {}).get("revision") if id(func) in loaded else None
                cls = AutoTokenizer.from_pretrained(func.config._name_or_path, revision=revision,
                                                    trust_remote_code=trust_remote_code)
            if cls is not None and cls.pad_token_id is None:
                cls.pad_token = cls.eos_token
            if isinstance(func, PreTrainedModel):
                func.config.pad_token_id = cls.pad_token_id
                func.eval()
            self.processing_classes.append(cls)
        self._warned_all_none = False  # GRPO's all-None warning is shown once (_warn_all_none)

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

        Reward models and sync functions run one after the other, in order; the functions whose call returns an
        awaitable (``async def``) are then awaited together, concurrently (``asyncio.gather`` on
        :func:`async_reward_loop`), as GRPOTrainer does. Their outputs are checked as the sync ones'.

        Returns:
            `(rewards, invalid)`: ``rewards`` of shape ``(len(completions), num_funcs)``, float32, NaN for ``None``
            and invalid values; ``invalid`` of the same shape, bool.

        Raises:
            ValueError / TypeError: if a function (sync or async) returns the wrong number of values or non-numbers;
                any exception a function raises (an async one's through ``asyncio.gather``; the others are then
                cancelled).
        """
        n = len(completions)
        prompts = [row["prompt"] for row in rows]
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
        except BaseException:
            _close_awaitables(a for _, a in pending)
            raise
        if pending:  # as GRPOTrainer: the async functions run concurrently (asyncio.gather) on a daemon loop
            outputs = await_all([a for _, a in pending])
            for (i, _), output in zip(pending, outputs, strict=True):
                rewards[:, i], invalid[:, i] = _checked_rewards(output, self.names[i], n)
        invalid |= torch.isinf(rewards)
        model_columns = [i for i, f in enumerate(self.reward_funcs) if isinstance(f, nn.Module)]
        for i in model_columns:
            invalid[:, i] |= torch.isnan(rewards[:, i])
        rewards[invalid] = math.nan
        self._warn_all_none(rewards, invalid, rows, completions)
        return rewards, invalid

    def _warn_all_none(self, rewards: torch.Tensor, invalid: torch.Tensor, rows: Sequence[dict],
                       completions: Sequence) -> None:
        """GRPOTrainer's warning when every reward function returned ``None`` for a completion (its text; once per
        scorer here: ES scores every member on the same prompts, so it would repeat population_size times)."""
        if self._warned_all_none:
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


def mask_truncated_rewards(out: dict) -> dict:
    """``mask_truncated_completions``: leave the completions that did not end (no EOS or pad id last: cut at
    ``max_completion_length``) out of the fitness, by setting their weighted reward to NaN (as a completion whose
    rewards are all ``None``). ``rewards_per_func`` is kept: the per-function metrics count every completion.

    Args:
        out (`dict`): A :func:`score_model` result (``rewards``: ``(n,)`` float32; ``terminated``: ``n`` bools).

    Returns:
        `dict`: ``out``, with ``rewards`` replaced (in place of the dict, a new tensor).
    """
    terminated = torch.tensor(out["terminated"], dtype=torch.bool)
    out["rewards"] = torch.where(terminated, out["rewards"], torch.full_like(out["rewards"], math.nan))
    return out


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
        length), ``completions`` (texts), ``completion_ids``, ``num_tokens`` (completion tokens generated),
        ``terminated`` (`list[bool]`, one per completion: it ended with a stop id (EOS) or the pad id, as
        GRPOTrainer tells a terminated completion from a clipped one) and ``prompt_lengths`` (`list[int]`, one per
        completion: its prompt's tokens as the engines tokenize it: with the tokenizer's special tokens for
        plain-text prompts, without for chat-templated ones, as GRPOTrainer; no padding).
    """
    prompts = prompt_texts(rows, processing_class, chat_template_kwargs)
    special = prompt_add_special_tokens([row["prompt"] for row in rows[:1]])  # plain text: BOS as in GRPO
    texts, ids = generate_completions(model, processing_class, prompts, generation_config, num_generations,
                                      engine=engine, num_row_groups=num_row_groups, add_special_tokens=special,
                                      **generate_kwargs)
    repeated_rows = [row for row in rows for _ in range(num_generations)]
    completions = completions_for_rewards(texts, repeated_rows)
    per_func, invalid = scorer.score(repeated_rows, completions, ids, **(reward_kwargs or {}))
    ends = ended_ids(generation_config, model, processing_class)
    lengths = [len(p) for p in processing_class(text=list(prompts), add_special_tokens=special)["input_ids"]]
    return {
        "rewards_per_func": per_func,
        "invalid": invalid,
        "rewards": scorer.weighted(per_func),
        "completions": texts,
        "completion_ids": ids,
        "num_tokens": sum(len(i) for i in ids),
        "terminated": terminated(ids, ends),
        "prompt_lengths": [length for length in lengths for _ in range(num_generations)],
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
        `list[dict]`: Per block: ``rewards_per_func``, ``invalid``, ``rewards``, ``completions``, ``completion_ids``,
        ``terminated``, ``prompt_lengths``, ``completion_lengths``, ``messages``, ``prompts`` (slices; the last five
        when ``out`` has them), ``num_tokens`` (the block's completion tokens) and ``seconds`` (the call's, shared
        equally).

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
            "num_tokens": sum(out["completion_lengths"][block]) if "completion_lengths" in out else sum(
                len(ids) for ids in out["completion_ids"][block]),
            "seconds": out.get("seconds", 0.0) / num_groups,
        })
        for key in ("terminated", "prompt_lengths", "completion_lengths", "messages", "prompts"):
            if key in out:
                parts[-1][key] = out[key][block]
    return parts
