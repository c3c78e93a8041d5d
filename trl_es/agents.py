"""Agent rollouts as GRPOTrainer runs them: ``tools=``, ``environment_factory=`` and ``rollout_func=``.

Ported from TRL 1.16's ``grpo_trainer.py`` (tool and environment set-up, resets, ``_tool_call_loop``,
``_get_tool_suffix_ids``) with ``trl.chat_template_utils``, less what only a gradient needs (logprobs, token masks,
images). An :class:`AgentRollout` call is one member's rollout; every member's resets draw the same random numbers
(:func:`task_seeds`, :func:`common_random_numbers`), so members are compared on the same tasks.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import os
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from torch import nn
from transformers.utils import get_json_schema
from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)
from trl.data_utils import is_conversational

from .generation import generate_completions
from .rollout import Rollout, RolloutResult, await_all, ended_ids, terminated


__all__ = [
    "AgentRollout",
    "Agents",
    "Environments",
    "MemberVLLMGeneration",
    "bind_rollout_func",
    "check_agent_arguments",
    "check_rollout_output",
    "common_random_numbers",
    "environment_placeholder_dataset",
    "prepare_tool_calling",
    "task_seeds",
    "tool_counts",
    "tool_metrics",
    "tool_suffix_ids",
    "warn_experimental",
    "warn_member_independent_rollouts",
]

EMPTY_PROMPT = [{"role": "user", "content": ""}]  # GRPO's prompt when an environment owns the data


def prepare_tool_calling(processing_class, tools: Sequence[Callable]):
    """Make ``processing_class`` parse tool calls, as GRPOTrainer does when ``tools`` (or an environment) is given.

    Returns:
        `tuple`: ``(processing_class, chat_template)``: the tokenizer, with TRL's response schema when it had none;
        TRL's prefix-preserving training template, or ``None`` when the tokenizer's is one.

    Raises:
        ValueError: if the chat template cannot render tool calls, or TRL does not recognise it (no response schema).
    """
    if not tools:
        return processing_class, None
    if not supports_tool_calling(processing_class):
        raise ValueError("The provided chat template does not support tool calling. The template must be able to "
                         "render a full tool-calling conversation (user -> assistant with tool_calls -> tool).")
    has_template = getattr(processing_class, "response_template", None) is not None
    if not has_template and getattr(processing_class, "response_schema", None) is None:
        processing_class = add_response_schema(processing_class)  # ValueError for a template TRL does not know
    chat_template = None
    if not is_chat_template_prefix_preserving(processing_class):
        chat_template = get_training_chat_template(processing_class)
    return processing_class, chat_template


class Environments:
    """GRPOTrainer's ``environment_factory``: one instance per rollout row, pooled and reset.

    An instance defines ``reset(**row) -> str | None``; an optional ``get_reward()`` (sync or async) is a reward
    function named after the class; its other public methods are tools.

    Args:
        environment_factory (`Callable` or `dict[str, Callable]`): A factory, or the dataset's ``environment`` column
            mapped to factories.
        tools (`Sequence[Callable]`): The standalone tools, offered with every environment's.

    Raises:
        ValueError: if an instance's class has no ``reset``.
    """

    def __init__(self, environment_factory, tools: Sequence[Callable] = ()):
        self.multi = isinstance(environment_factory, dict)
        self.factories = dict(environment_factory) if self.multi else {None: environment_factory}
        self._pools = threading.local()  # per thread (one per vLLM server): concurrent calls never share instances
        self.tools: dict = {}  # environment name -> the tools its prompts are rendered with
        self.reward_funcs: list[Callable] = []  # one per environment class with get_reward
        self.standalone_tools = list(tools)
        for name, factory in self.factories.items():  # one instance each now: its tools and reward are known
            instance = factory()
            if not callable(getattr(type(instance), "reset", None)):
                raise ValueError("Each environment instance returned by `environment_factory` must define a callable "
                                 "`reset`.")
            self.pool[name].append(instance)
            self.tools[name] = self.tools_of(instance)
            env_type = type(instance)
            owned = [f.env_type for f in self.reward_funcs]  # one reward function per environment class
            if callable(getattr(env_type, "get_reward", None)) and env_type not in owned:
                self.reward_funcs.append(_environment_reward(env_type))

    @property
    def pool(self) -> dict:
        """Environment name -> this thread's instances, reused across calls."""
        if not hasattr(self._pools, "pool"):  # construct once, reset often
            self._pools.pool = {name: [] for name in self.factories}
        return self._pools.pool

    def tools_of(self, instance) -> list[Callable]:
        """The standalone tools and ``instance``'s public methods but ``reset`` and ``get_reward``, bound to it."""
        methods = inspect.getmembers(type(instance), predicate=inspect.isfunction)  # the class: no properties run
        return self.standalone_tools + [getattr(instance, m) for m, _ in methods
                                        if m not in ("reset", "get_reward") and not m.startswith("_")]

    def names(self, rows: Sequence[dict]) -> list:
        """The environment of each row (``None`` for a single factory).

        Raises:
            ValueError: a row's ``environment`` is not one of the factories' names.
        """
        if not self.multi:
            return [None] * len(rows)
        names = [row.get("environment") for row in rows]
        for name in set(names):
            if name not in self.factories:
                raise ValueError(f"Example has `environment={name!r}`, which is not among the environments passed to "
                                 f"`environment_factory`. Expected one of: {list(self.factories)}.")
        return names

    def instances(self, names: Sequence) -> list:
        """One pooled instance per row, created only when a call needs more of an environment than exist."""
        cursor: dict = {}
        out = []
        for name in names:  # the k-th row of an environment gets its k-th pooled instance
            index = cursor.get(name, 0)
            if index == len(self.pool[name]):
                self.pool[name].append(self.factories[name]())
            cursor[name] = index + 1
            out.append(self.pool[name][index])
        return out

    def reset(self, instances: Sequence, rows: Sequence[dict], prompts: list, seeds: Sequence[int]) -> list:
        """``reset(**row)`` each of :meth:`instances` under its row's seed (:func:`common_random_numbers`).

        Returns:
            `list`: New conversational prompts, each with its observation appended to the last message.

        Raises:
            ValueError: for a prompt that is not a message list.
            TypeError: for an observation that is not a string, a list of parts or ``None``.
        """
        out = []
        for instance, row, prompt, seed in zip(instances, rows, prompts, seeds, strict=True):
            # a dict factory's routing column is not the environment's
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else dict(row)
            if not isinstance(prompt, list):
                raise ValueError("environment_factory needs conversational prompts (lists of messages) as in GRPO: "
                                 f"the observation of reset() is appended to the last message; got {prompt!r:.80}.")
            with common_random_numbers(seed):
                observation = instance.reset(**kwargs)
            if observation is not None and not isinstance(observation, (str, list)):
                raise TypeError(f"{type(instance).__name__}.reset() must return a string (appended to the last user "
                                f"message), a list of content parts, or None; got {type(observation).__name__}.")
            if observation is not None:
                content = prompt[-1]["content"]  # string and parts: both sides made alike
                if isinstance(observation, list) and isinstance(content, str):
                    content = [{"type": "text", "text": content}]
                if isinstance(observation, str) and isinstance(content, list):
                    observation = [{"type": "text", "text": observation}]
                prompt = prompt[:-1] + [{**prompt[-1], "content": content + observation}]  # a new dict: rows untouched
            out.append(prompt)
        return out


def _environment_reward(env_type: type) -> Callable:
    """GRPO's reward function of an environment class with ``get_reward``: ``None`` for another class's rows."""
    # async when get_reward is: the scorer awaits it with the other async rewards
    if inspect.iscoroutinefunction(env_type.get_reward):

        async def get_reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is env_type else None for e in environments]

    else:

        def get_reward(environments, **kwargs):
            return [e.get_reward() if type(e) is env_type else None for e in environments]

    get_reward.__name__ = get_reward.__qualname__ = env_type.__name__  # the reward's name in the metrics
    get_reward.env_type = env_type
    return get_reward


def task_seeds(seed: int, step: int, row_ids: Sequence[int], num_generations: int) -> list[int]:
    """The seed of each rollout's ``reset``: a 31-bit hash of ``seed``, ``step``, the row id and the generation.

    Returns:
        `list[int]`: ``len(row_ids) * num_generations`` seeds in ``[0, 2**31)``, a row's generations consecutive.
    """
    # never the member or the process: every member gets the same tasks; the generation gives a prompt's copies
    # different ones, as in GRPO
    out = []
    for row_id in row_ids:
        for generation in range(num_generations):
            text = f"es-task\x00{seed}\x00{step}\x00{int(row_id)}\x00{generation}"
            out.append(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF)
    return out


@contextmanager
def common_random_numbers(seed: int):
    """Seed Python's ``random``, NumPy's global generator and torch's CPU generator with ``seed`` (``>= 0``) for the
    block, and restore their states after it (CUDA generators untouched)."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.random.default_generator.manual_seed(seed)  # not torch.manual_seed: it would reseed CUDA too
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


def check_rollout_output(output, num_rows: int) -> dict:
    """Check a ``rollout_func`` result: ``prompt_ids`` and ``completion_ids``, ``num_rows`` id lists each.

    Returns:
        `dict`: The other keys (extra reward keyword arguments), each a list of ``num_rows`` values.

    Raises:
        ValueError: a required key is missing, or a list has another length than ``num_rows``.
    """
    if not isinstance(output, dict):
        raise ValueError(f"rollout_func must return a dict, got {type(output).__name__}.")
    missing = sorted({"prompt_ids", "completion_ids"} - output.keys())
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
    for key in ("prompt_ids", "completion_ids"):
        if len(output[key]) != num_rows:
            raise ValueError(f"rollout_func returned {len(output[key])} {key} for {num_rows} prompts (one per prompt, "
                             "the prompts repeated num_generations times).")
    extra = {}
    for key, value in output.items():
        if key in ("prompt_ids", "completion_ids", "logprobs", "logprob_token_ids", "env_mask"):  # ES needs no logprobs
            continue
        if isinstance(value, list):
            if len(value) != num_rows:
                raise ValueError(f"rollout_func's extra field {key!r} has {len(value)} values for {num_rows} prompts.")
            extra[key] = value
        else:
            extra[key] = [value] * num_rows  # a scalar reaches every row, as GRPO broadcasts it
    return extra


def tool_suffix_ids(processing_class, tool_messages: list[dict], chat_template, chat_template_kwargs: dict) -> list:
    """The token ids that follow an assistant turn when ``tool_messages`` are appended (GRPO's
    ``_get_tool_suffix_ids``).

    Raises:
        ValueError: if the template does not render the prefix as a prefix of the whole.
    """
    # rendered on a dummy conversation, with and without the tool turn
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    kwargs = dict(tokenize=True, chat_template=chat_template, return_dict=False, **chat_template_kwargs)
    prefix = processing_class.apply_chat_template(dummy, add_generation_prompt=False, **kwargs)
    full = processing_class.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, **kwargs)
    eos = [i for i, token in enumerate(prefix) if token == processing_class.eos_token_id]
    if eos:  # Qwen-style templates put "\n" after the end-of-turn token
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("Unexpected tokenization: the EOS-trimmed prefix IDs are not a prefix of the full IDs.")
    return full[len(prefix):]


def _tool_dicts(tools: Sequence[Callable]) -> tuple[dict, dict]:  # by name, sync apart from async (gathered)
    sync, async_ = {}, {}
    for tool in tools:
        (async_ if inspect.iscoroutinefunction(tool) else sync)[tool.__name__] = tool
    return sync, async_


def _run_tool_calls(tool_calls: list[dict], sync_tools: dict, async_tools: dict) -> tuple[list, int]:
    """Run one assistant turn's calls; an unknown name or an exception is the result ``{"error": ...}``.

    Returns:
        `tuple`: ``[(name, result), ...]``, sync results first, then the async ones (GRPO's order); the failures.
    """
    results, pending, failures = [], [], 0
    for call in tool_calls:
        if call.get("type") != "function":  # GRPO runs function calls only
            failures += 1
            results.append((call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call.get('type')}"}))
            continue
        name, arguments = call["function"]["name"], call["function"].get("arguments") or {}
        try:
            if name in sync_tools:
                results.append((name, sync_tools[name](**arguments)))
            elif name in async_tools:
                pending.append((name, async_tools[name](**arguments)))
            else:
                raise ValueError(f"Tool {name} not found.")
        except Exception as error:  # the model called it wrongly: the error is the tool's answer
            failures += 1
            results.append((name, {"error": str(error)}))
    if pending:
        outputs = await_all([c for _, c in pending], return_exceptions=True)  # concurrently, as GRPO's gather
        for (name, _), result in zip(pending, outputs, strict=True):
            if isinstance(result, Exception):
                failures += 1
                result = {"error": str(result)}
            results.append((name, result))
    return results, failures


@dataclass
class AgentRollout(Rollout):
    """A :class:`~trl_es.rollout.Rollout` with GRPO's agent features: a multi-turn tool loop, environments,
    ``rollout_func``; one call is one member's rollout."""

    tools: list | None = None  # the standalone tools
    environments: Environments | None = None
    rollout_func: Callable | None = None  # prompts -> dict, bound to the trainer: generates instead of the engine
    chat_template: str | None = None  # from prepare_tool_calling
    max_tool_calling_iterations: int | None = None  # None: no limit
    max_completion_length: int = 256  # a whole multi-turn completion's budget, tool tokens included
    seed: int = 0  # keys task_seeds
    max_model_len: int | None = None  # the engine's context (default the model's max_position_embeddings)

    def __call__(self, model: nn.Module, rows: Sequence[dict], num_members: int = 1,
                 reward_kwargs: dict | None = None, row_ids: Sequence[int] | None = None,
                 **generate_kwargs) -> RolloutResult:
        """Roll ``model`` out on ``rows`` (each repeated ``num_generations`` times) and score it.

        Args:
            model (`nn.Module`): The model as it is; every turn of the tool loop generates with it.
            rows (`Sequence[dict]`): Dataset rows (``prompt`` optional with environments).
            num_members (`int`): Must be 1.
            reward_kwargs (`dict`, *optional*): Extra reward keyword arguments; ``trainer_state.global_step`` keys
                :func:`task_seeds`.
            row_ids (`Sequence[int]`, *optional*): One id per row for :func:`task_seeds` (default: the positions).
            **generate_kwargs (`Any`): Passed to ``model.generate``.

        Returns:
            `RolloutResult`: the multi-turn completions as messages, the prompts after ``reset``, the tool counts.

        Raises:
            ValueError: ``num_members != 1``, a bad ``rollout_func`` output, an unknown ``environment``.
        """
        if num_members != 1:  # the tool loop regenerates a subset of rows, which stacked members cannot share
            raise ValueError("tools, environment_factory and rollout_func roll out one member per call "
                             f"(num_members=1), got {num_members}.")
        start = time.perf_counter()
        reward_kwargs = dict(reward_kwargs or {})
        tok = self.processing_class
        state = reward_kwargs.get("trainer_state")
        step = int(getattr(state, "global_step", 0) or 0)  # keys the environments' random numbers
        row_ids = list(range(len(rows))) if row_ids is None else list(row_ids)
        if len(row_ids) != len(rows):
            raise ValueError(f"row_ids has {len(row_ids)} ids for {len(rows)} rows.")
        rows = [row for row in rows for _ in range(self.num_generations)]  # one rollout per (row, generation)
        n = len(rows)
        if self.environments is not None:  # each row's environment is reset for this member: no state crosses members
            prompts = [copy.deepcopy(row.get("prompt", EMPTY_PROMPT)) for row in rows]
            names = self.environments.names(rows)
            instances = self.environments.instances(names)
            seeds = task_seeds(self.seed, step, row_ids, self.num_generations)  # the same for every member
            prompts = self.environments.reset(instances, rows, prompts, seeds)
            row_tools = [self.environments.tools_of(instance) for instance in instances]  # bound to the row's
            reward_kwargs["environments"] = instances
        else:
            prompts = [copy.deepcopy(row["prompt"]) for row in rows]
            row_tools = [list(self.tools or [])] * n
        conversational = is_conversational({"prompt": prompts[0]})
        if self.tools and not conversational and self.rollout_func is None:
            raise ValueError("tools need conversational prompts (lists of messages) as in GRPO: the tools are rendered "
                             "by the chat template and their calls parsed from the assistant turn; got the plain-text "
                             f"prompt {prompts[0]!r:.80}.")
        chat_kwargs = dict(self.chat_template_kwargs or {})
        extra: dict = {}
        if self.rollout_func is not None:  # it generates instead of the engine
            output = self.rollout_func(copy.deepcopy(prompts))
            extra = check_rollout_output(output, n)
            prompt_ids = [list(ids) for ids in output["prompt_ids"]]
            completion_ids = [list(ids) for ids in output["completion_ids"]]
        else:
            if conversational:
                prompt_ids = [tok.apply_chat_template(p, tools=t or None, chat_template=self.chat_template,
                                                      add_generation_prompt=True, tokenize=True, return_dict=False,
                                                      **chat_kwargs)
                              for p, t in zip(prompts, row_tools, strict=True)]
            else:
                prompt_ids = tok(text=prompts)["input_ids"]  # plain text: with the tokenizer's special tokens
            completion_ids = self._generate(model, prompt_ids, **generate_kwargs)
        # TRL parses tool calls only with a response template or schema
        parse = conversational and (getattr(tok, "response_template", None) is not None
                                    or getattr(tok, "response_schema", None) is not None)
        if parse:
            messages = [[parse_response(tok, ids, prefix=prompt_ids[j], tools=row_tools[j])]
                        for j, ids in enumerate(completion_ids)]
        elif conversational:
            messages = [[{"role": "assistant", "content": text}]
                        for text in tok.batch_decode(completion_ids, skip_special_tokens=True)]
        else:
            messages = tok.batch_decode(completion_ids, skip_special_tokens=True)
        tool_tokens, calls, failures = [0] * n, 0, 0  # tool tokens are not the model's: left out of the lengths
        if any(row_tools) and conversational:
            calls, failures = self._tool_call_loop(model, prompt_ids, completion_ids, messages, row_tools, tool_tokens,
                                                   **generate_kwargs)
        # rollout_func's extra fields are reward keyword arguments; the prompt as after reset
        score_rows = [{**row, **{k: v[j] for k, v in extra.items()}, "prompt": prompts[j]}
                      for j, row in enumerate(rows)]
        per_func, invalid = self.scorer.score(score_rows, messages, completion_ids, **reward_kwargs)
        ends = ended_ids(self.generation_config, model, tok)
        return RolloutResult(
            rewards_per_func=per_func,
            invalid=invalid,
            rewards=self.scorer.weighted(per_func),
            completions=tok.batch_decode(completion_ids, skip_special_tokens=True),
            completion_ids=completion_ids,
            prompts=prompts,
            reward_completions=messages,
            completion_lengths=[len(ids) - t for ids, t in zip(completion_ids, tool_tokens, strict=True)],
            prompt_lengths=[len(ids) for ids in prompt_ids],
            terminated=terminated(completion_ids, ends),
            tool_calls=calls,
            tool_failures=failures,
            seconds=time.perf_counter() - start,
        )

    def _generate(self, model, prompt_ids: list[list[int]], **generate_kwargs) -> list[list[int]]:
        """One completion per token-id prompt, cut after its end-of-turn id."""
        out = generate_completions(model, self.processing_class, prompt_ids, self.generation_config, 1,
                                   engine=self.engine, **generate_kwargs)
        return out.ids

    def _tool_call_loop(self, model, prompt_ids, completion_ids, messages, row_tools, tool_tokens,
                        **generate_kwargs) -> tuple[int, int]:
        """GRPO's ``_tool_call_loop``: run the calls, append the tool turn, regenerate the rows that called, until none
        calls or ``max_tool_calling_iterations``. Updates ``completion_ids``, ``messages`` and ``tool_tokens`` in place.

        Returns:
            `tuple[int, int]`: Tool calls made and calls failed.
        """
        tok = self.processing_class
        chat_kwargs = dict(self.chat_template_kwargs or {})
        limit = sys.maxsize if self.max_tool_calling_iterations is None else self.max_tool_calling_iterations
        # a tool turn that would reach the context ends the row
        max_model_len = self.max_model_len or getattr(getattr(model, "config", None), "max_position_embeddings",
                                                      None) or sys.maxsize
        dicts = [_tool_dicts(tools) for tools in row_tools]
        calls, failures, iteration = 0, 0, 0
        pending = [j for j, m in enumerate(messages) if m[0].get("tool_calls")]  # the rows whose last turn called
        tool_calls = {j: messages[j][0]["tool_calls"] for j in pending}
        while pending and iteration < limit:
            extended = {}  # row -> prompt + completion + tool turn ids (no re-tokenization)
            for j in pending:
                results, failed = _run_tool_calls(tool_calls[j], *dicts[j])
                calls, failures = calls + len(tool_calls[j]), failures + failed
                # a tool's answer is text unless it returned content parts
                turn = [{"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
                        for name, result in results]
                ids = prompt_ids[j] + completion_ids[j] + tool_suffix_ids(tok, turn, self.chat_template, chat_kwargs)
                if len(ids) - len(prompt_ids[j]) > self.max_completion_length or len(ids) >= max_model_len:
                    continue  # the tool result does not fit: the row ends as it was (GRPO's rollback)
                messages[j].extend(turn)
                extended[j] = ids
            pending = list(extended)
            if not pending:
                break
            new_ids = self._generate(model, [extended[j] for j in pending], **generate_kwargs)  # the rows that called
            next_pending = []
            for j, ids in zip(pending, new_ids, strict=True):
                used = len(extended[j]) - len(prompt_ids[j])
                ids = ids[: max(0, self.max_completion_length - used)]  # the budget counts the tool tokens
                tool_tokens[j] += len(extended[j]) - len(prompt_ids[j]) - len(completion_ids[j])
                completion_ids[j] = extended[j][len(prompt_ids[j]):] + ids
                if not ids:
                    continue  # truncated away: nothing to parse
                turn = parse_response(tok, ids, prefix=extended[j], tools=row_tools[j])
                messages[j].append(turn)
                if turn.get("tool_calls"):
                    tool_calls[j] = turn["tool_calls"]
                    next_pending.append(j)
            pending = next_pending
            iteration += 1
        return calls, failures


def check_agent_arguments(tools, rollout_func, environment_factory) -> None:
    """Refuse agent arguments of the wrong kind before any work, naming the argument.

    Raises:
        TypeError: ``tools`` is not a list of callables, ``rollout_func`` not callable, ``environment_factory`` not a
            callable or a dict of them.
        ValueError: a tool without a JSON schema (``transformers.utils.get_json_schema``).
    """
    if tools is not None:
        if not isinstance(tools, (list, tuple)) or not all(callable(t) for t in tools):
            raise TypeError(f"tools must be a list of callables (functions with type hints and a docstring), got "
                            f"{tools!r:.80}.")
        for tool in tools:
            try:
                get_json_schema(tool)
            except Exception as error:
                raise ValueError(f"tool {getattr(tool, '__name__', tool)!r} has no JSON schema (GRPO's tools need "
                                 f"type hints and a Google-style docstring for every argument): {error}") from error
    if rollout_func is not None and not callable(rollout_func):
        raise TypeError(f"rollout_func must be callable as rollout_func(prompts, trainer), got {rollout_func!r:.80}.")
    if environment_factory is not None:
        factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
        for factory in factories:
            if not callable(factory):
                raise TypeError("environment_factory must be a class or a callable returning a new environment (or a "
                                f"dict of them), got {factory!r:.80}: pass the class, not an instance.")


def tool_counts(rollout: RolloutResult) -> torch.Tensor:
    """``[tool calls, failed calls, rollouts]`` of an :class:`AgentRollout` result, ``(3,)`` float64."""
    return torch.tensor([rollout.tool_calls, rollout.tool_failures, len(rollout.completions)], dtype=torch.float64)


def tool_metrics(counts: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """GRPO's ``tools/call_frequency`` (calls per rollout) and ``tools/failure_frequency`` (failed / calls, 0 without
    calls) from :func:`tool_counts` summed over calls and processes."""
    calls, failures, rollouts = counts.tolist()
    return {f"{prefix}tools/call_frequency": calls / max(rollouts, 1.0),
            f"{prefix}tools/failure_frequency": failures / calls if calls else 0.0}


def warn_experimental(rollout_func, environment_factory) -> None:
    """GRPOTrainer's warnings for its experimental ``rollout_func`` and ``environment_factory``."""
    if os.environ.get("TRL_EXPERIMENTAL_SILENCE", "0") == "1":
        return
    for name, value in (("rollout_func", rollout_func), ("environment_factory", environment_factory)):
        if value is not None:
            warnings.warn(f"You are using '{name}', which is an experimental feature. This API may change or be "
                          "removed at any time without prior notice. Silence this warning by setting environment "
                          "variable TRL_EXPERIMENTAL_SILENCE=1.", UserWarning, stacklevel=4)  # at the trainer's call


def environment_placeholder_dataset(environments: Environments, args):
    """GRPO's training data when an environment owns it: ``prompt_batch_size`` rows of an empty user prompt.

    Raises:
        ValueError: for a dict factory (its rows need an ``environment`` column), or without ``max_steps``.
    """
    if environments.multi:
        raise ValueError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                         "`environment` column to route each example to its environment. Provide a dataset, or pass a "
                         "single environment factory.")
    if args.max_steps <= 0:
        raise ValueError("When training without a `train_dataset` (the environment owns the data and returns the "
                         "prompt from `reset()`), `max_steps` must be set to a positive value to define the training "
                         "length. Set it via `ESConfig(max_steps=...)`.")
    return Dataset.from_dict({"prompt": [EMPTY_PROMPT] * args.prompt_batch_size})  # cycled; reset gives each task


class MemberVLLMGeneration:
    """GRPOTrainer's ``trainer.vllm_generation`` for a ``rollout_func`` under ``use_vllm=True``: :meth:`generate` runs
    on the trainer's vLLM engine, which holds the member being rolled out (``trainer.model`` stays unperturbed).

    Args:
        trainer (`ESTrainer`): Its engine, model, tokenizer and generation config are read at each call.
    """

    def __init__(self, trainer):
        self._trainer = trainer

    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None) -> tuple:
        """GRPO's ``VLLMGeneration.generate``: one completion per token-id row (rows already repeated), decoded with
        the trainer's generation config by the member's weights; ``num_generations`` and ``profiler`` are unused.

        Returns:
            `tuple`: ``(prompt_ids, completion_ids, None, None)``, ``list[list[int]]`` each (cut after the first stop
            token, kept); no logprobs.

        Raises:
            ValueError: ``images`` given (text only), or ``prompts`` not token-id lists.
        """
        if images is not None and any(image is not None for image in images):
            raise ValueError("trainer.vllm_generation.generate: images are not supported by ESTrainer (text only).")
        if not all(isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p) for p in prompts):
            raise ValueError("trainer.vllm_generation.generate takes token ids (list[list[int]]), as GRPO's does; "
                             "render and tokenize the prompts first (apply_chat_template(..., tokenize=True)).")
        trainer = self._trainer
        prompt_ids = [list(p) for p in prompts]
        # the engine holds the member's weights or adapter (with vllm_mode="server", the server scoring it)
        model = trainer.accelerator.unwrap_model(trainer.model)
        out = generate_completions(model, trainer.processing_class, prompt_ids, trainer.generation_config, 1,
                                   engine=trainer.generation_engine)
        return prompt_ids, out.ids, None, None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"trainer.vllm_generation.{name} is not available in ESTrainer: only "
                             "trainer.vllm_generation.generate(prompt_ids, None, num_generations) generates with the "
                             "member being rolled out (TRL's llm or vllm_client would see the unperturbed or another "
                             "member's weights).")


_warned_member_independent = False


def warn_member_independent_rollouts() -> None:
    """Warn once that every member's ``rollout_func`` completions were the same (it ignores ``trainer.model``)."""
    global _warned_member_independent
    if _warned_member_independent:
        return
    warnings.warn("Every population member got the same completions from rollout_func: it does not seem to generate "
                  "with trainer.model, which holds each member's weights while rollout_func runs (an external server "
                  "that ES does not drive scores the base model for every member). ES then learns nothing but "
                  "noise; generate with trainer.model inside rollout_func (with use_vllm=True: "
                  "trainer.vllm_generation.generate).", UserWarning, stacklevel=4)  # at training_step
    _warned_member_independent = True


def _call_rollout_func(rollout_func: Callable, trainer, prompts: list) -> dict:
    return rollout_func(prompts, trainer)


def bind_rollout_func(rollout_func: Callable, trainer) -> Callable:
    """``prompts -> rollout_func(prompts, trainer)``: GRPO's call, with the member's weights in ``trainer.model``
    (with ``use_vllm=True``: in the engine behind ``trainer.vllm_generation``)."""
    return functools.partial(_call_rollout_func, rollout_func, trainer)


@dataclass(eq=False)
class Agents:
    """One trainer's GRPO agent arguments (``tools=``, ``environment_factory=``, ``rollout_func=``), made by
    :meth:`build`; GRPO's attribute names (``trainer.tools``, ``.environments``, ...) point at these fields."""

    tools: list = field(default_factory=list)  # the standalone tools, then the environments' public methods
    environments: Environments | None = None
    rollout_func: Callable | None = None  # rollout_func(prompts, trainer), unbound
    chat_template: str | None = None  # from prepare_tool_calling
    counts: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))  # tool_counts so far
    active: bool = field(init=False)  # any agent feature given: rollouts go through AgentRollout
    owns_data: bool = False  # an environment owns the data: the train dataset is placeholder rows (train_dataset)

    def __post_init__(self):
        self.active = bool(self.tools) or self.environments is not None or self.rollout_func is not None

    @classmethod
    def build(cls, processing_class, tools=None, rollout_func=None, environment_factory=None) -> tuple[Agents, Any]:
        """Check the arguments, warn for the experimental ones, make the environments and the tool-calling tokenizer.

        Returns:
            `tuple`: ``(agents, processing_class)``, the tokenizer with a response schema when there are tools.

        Raises:
            TypeError / ValueError: from :func:`check_agent_arguments` and :func:`prepare_tool_calling`.
        """
        check_agent_arguments(tools, rollout_func, environment_factory)
        warn_experimental(rollout_func, environment_factory)
        environments = Environments(environment_factory, tools or []) if environment_factory is not None else None
        all_tools = list(tools or [])
        for env_tools in (environments.tools.values() if environments else ()):  # GRPO's trainer.tools: all of them
            methods = [tool for tool in env_tools if tool not in all_tools]
            check_agent_arguments(methods, None, None)  # an environment's public methods are tools: their schemas
            all_tools += methods
        processing_class, chat_template = prepare_tool_calling(processing_class, all_tools)
        return cls(all_tools, environments, rollout_func, chat_template), processing_class

    @property
    def prompt_required(self) -> bool:
        """Datasets need a ``prompt`` column unless an environment supplies the prompt (GRPO's rule)."""
        return self.environments is None

    def reward_setup(self, reward_funcs, reward_weights, reward_processing_classes) -> tuple[list, Any, Any]:
        """The scorer's functions, weights and reward tokenizers: an environment's ``get_reward`` last, weight 1.

        Raises:
            ValueError: no reward source at all, or ``reward_weights`` not one per given function.
        """
        env_rewards = self.environments.reward_funcs if self.environments else []
        funcs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        if not funcs + env_rewards:
            raise ValueError("No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose "
                             "environment defines a `get_reward` method.")
        weights, classes = reward_weights, reward_processing_classes
        if weights is not None and env_rewards:  # an environment's get_reward gets weight 1
            if len(weights) != len(funcs):
                raise ValueError(f"reward_weights has {len(weights)} entries but there are {len(funcs)} reward "
                                 "functions; give one weight per reward function (an environment's get_reward gets "
                                 "weight 1).")
            weights = list(weights) + [1.0] * len(env_rewards)
        if classes is not None and env_rewards:  # get_reward needs no tokenizer
            classes = (classes if isinstance(classes, list) else [classes]) + [None] * len(env_rewards)
        return funcs + env_rewards, weights, classes

    def train_dataset(self, train_dataset, args):
        """``train_dataset``, or GRPO's placeholder rows when an environment owns the data
        (:func:`environment_placeholder_dataset`)."""
        self.owns_data = train_dataset is None and self.environments is not None
        if self.owns_data:
            return environment_placeholder_dataset(self.environments, args)
        return train_dataset

    def check_population(self, sharded: bool, stacked_chunks: bool) -> None:
        """Refuse what agent rollouts cannot do: they roll out one member a generate call.

        Raises:
            ValueError: under ZeRO-3 (``sharded``) or with stacked low-rank members (``stacked_chunks``).
        """
        if not self.active:
            return
        # the tool loop regenerates some rows of one member: one member a generate call
        limits = (("DeepSpeed ZeRO-3", sharded), ("stacked low-rank members (member_chunk_size > 1)", stacked_chunks))
        unsupported = [what for what, on in limits if on]
        if unsupported:
            raise ValueError(f"tools, environment_factory and rollout_func are not supported with "
                             f"{' and '.join(unsupported)} in ESTrainer yet: they roll out one member at a time "
                             "(member_chunk_size=1).")

    def rollout(self, base: Rollout, args, trainer) -> AgentRollout:
        """``base``'s settings with GRPO's agent features (``rollout_func`` bound to ``trainer``)."""
        rollout_func = bind_rollout_func(self.rollout_func, trainer) if self.rollout_func is not None else None
        return AgentRollout(**{f.name: getattr(base, f.name) for f in fields(Rollout)}, tools=self.tools,
                            environments=self.environments, rollout_func=rollout_func,
                            chat_template=self.chat_template,
                            max_tool_calling_iterations=args.max_tool_calling_iterations,
                            max_completion_length=args.max_completion_length, seed=args.seed,
                            max_model_len=getattr(base.engine, "max_model_len", None))  # vLLM's context length

    def finish_iteration(self, rollouts: Sequence[RolloutResult], num_members: int) -> None:
        """Count the tool calls of the iteration's member ``rollouts`` on this process into :attr:`counts`; warn once
        when every one of ``num_members`` members got the same ``rollout_func`` completions."""
        self.counts = torch.zeros(3, dtype=torch.float64)
        for out in rollouts:
            self.counts += tool_counts(out)
        if self.rollout_func is not None and num_members > 1:
            if len({repr(out.completion_ids) for out in rollouts}) == 1:  # hashable: one entry per distinct rollout
                warn_member_independent_rollouts()
