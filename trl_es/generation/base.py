"""The generation-engine interface: prompt strings in, completion token ids and texts out; the engines that hold
their own copy of the weights (:class:`OwnWeightsEngine`); what an engine is built from (:class:`EngineContext`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from ..es.strategy import WeightsHost


@dataclass
class Completions:
    """The output of :meth:`GenerationEngine.generate`, one entry per row."""

    texts: list[str]  # decoded, special tokens removed
    ids: list[list[int]]  # cut after the first EOS (included, as GRPOTrainer), see stop_token_ids

    def __iter__(self):  # ``texts, ids = engine.generate(...)``
        return iter((self.texts, self.ids))


class GenerationEngine(ABC):
    """Turns prompt texts into completions; the one path to generation in trl_es.

    ``generate`` receives ``len(prompts) * num_generations`` rows; with ``num_row_groups = M`` they form ``M``
    consecutive equal blocks that may see different models (low-rank members): an engine keeps every row in its block.
    """

    name = "engine"
    max_model_len: int | None = None  # prompt + completion tokens the engine holds (None: the model's own limit)

    def describe(self) -> dict:
        """JSON-serializable facts about the engine (logged by the trainer)."""
        return {"name": self.name}

    def iteration_counts(self) -> dict[str, float]:
        """Counts of this process since the last call, logged summed over the processes once per iteration."""
        return {}

    def map_chunks(self, fn: Callable, chunks: Iterable) -> Iterator:
        """``fn(chunk)`` for each chunk of members, in order (several vLLM servers run them concurrently)."""
        return (fn(chunk) for chunk in chunks)  # lazily, one at a time

    @abstractmethod
    def _generate_ids(
        self, model: nn.Module, processing_class, texts: list[str], generation_config: GenerationConfig,
        num_row_groups: int, add_special_tokens: bool = False, **generate_kwargs,
    ) -> list[list[int]]:
        """Completion ids (before the EOS cut) for each row, in row order; the texts are tokenized with
        ``add_special_tokens`` (see :meth:`generate`)."""

    @torch.no_grad()
    def generate(
        self,
        model: nn.Module,
        processing_class,
        prompts: Sequence[str],
        generation_config: GenerationConfig,
        num_generations: int = 1,
        num_row_groups: int = 1,
        add_special_tokens: bool = False,
        **generate_kwargs,
    ) -> Completions:
        """Generate ``num_generations`` completions for each prompt (strings through the chat template, or token ids)
        with a causal LM; ``add_special_tokens`` as :func:`prompt_add_special_tokens`; ``generate_kwargs`` go to
        ``model.generate``.

        Returns:
            `Completions`: ``len(prompts) * num_generations`` texts and id lists; unpacks as ``texts, ids``.

        Raises:
            ValueError: if ``num_row_groups`` does not divide the number of rows.
        """
        texts = [p for p in prompts for _ in range(num_generations)]  # one text per row, prompt 0's first
        if num_row_groups < 1 or len(texts) % num_row_groups:
            raise ValueError(f"num_row_groups ({num_row_groups}) must divide the number of rows ({len(texts)}).")
        was_training = model.training
        model.eval()
        try:
            with standard_strided_head_input(model):  # a 16-bit CPU head: no weight copy per row at the prefill
                completion = self._generate_ids(model, processing_class, texts, generation_config, num_row_groups,
                                                add_special_tokens=add_special_tokens, **generate_kwargs)
        finally:
            model.train(was_training)
        stop = set(stop_token_ids(generation_config, model, processing_class))
        ids = [_cut_after_eos(row, stop) for row in completion]
        texts = processing_class.batch_decode(ids, skip_special_tokens=True)
        return Completions(texts, ids)


#: Weight dtypes of an output embedding that :func:`standard_strided_head_input` hooks on the CPU.
HEAD_COPY_DTYPES = (torch.bfloat16, torch.float16)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _standard_strided_input(module, args):
    """Forward pre-hook: the first argument with row-major strides (a copy only when its strides are others)."""
    # strides, not is_contiguous(): that ignores size-1 dims, and hidden[:, -1:, :] passes it yet takes the copying path
    if args and isinstance(args[0], torch.Tensor) and args[0].stride() != _contiguous_strides(args[0].shape):
        return (args[0].clone(memory_format=torch.contiguous_format), *args[1:])
    return None


@contextmanager
def standard_strided_head_input(model: nn.Module):
    """While in the block, ``model``'s output embedding (``lm_head``) reads its input with row-major strides, when its
    weight is a 16-bit tensor on the CPU (:data:`HEAD_COPY_DTYPES`); any other model is left as it is.

    The prefill slices the last position of each row (``logits_to_keep=1``: ``hidden[:, -1:, :]``, strides
    ``(seq * hidden, hidden, 1)``), and PyTorch's CPU ``linear`` of such an input with a bf16/fp16 weight expands
    the weight to one copy per row (``batch`` x the head's bytes: 1.7 GiB for 4 rows of a 151,936 x 1,536 bf16 head,
    measured with torch 2.13 on a Xeon with AVX512-BF16 and AMX; fp16 the same; none for fp32). A row-major copy of
    the slice (``batch x hidden`` values) takes the matrix-product path: the prefill's logits are then those of a
    row-major input of the same values, as every decoding step computes them (they may differ from the strided
    path's in the last bit). The hook is removed on exit.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or weight.dtype not in HEAD_COPY_DTYPES:
        yield
        return
    handle = head.register_forward_pre_hook(_standard_strided_input)
    try:
        yield
    finally:
        handle.remove()


class OwnWeightsEngine(GenerationEngine, WeightsHost):
    """An engine that computes with its own copy of the weights (vLLM): the population backends put members into it
    instead of the model, which :meth:`generate` then reads for its generation defaults only."""

    @abstractmethod
    def sync_weights(self, model: nn.Module, params, noise) -> None:
        """Load ``model``'s current weights (after an update, a loaded checkpoint, before an evaluation) and bind the
        trained tensors' masters (``params``: ``TrainedParameters``) and the ``NoiseSource`` for the members."""


@dataclass
class EngineContext:
    """The trainer's parts an engine builder (:data:`trl_es.generation.ENGINES`) reads; all optional."""

    processing_class: Any = None  # the tokenizer
    generation_config: GenerationConfig | None = None  # checked against what the engine applies
    accelerator: Any = None  # rank and world size (vLLM)
    params: Any = None  # TrainedParameters
    population: Any = None  # the PopulationBackend, before it goes into an engine that holds its weights
    seed_log: Callable[[], Any] | None = None  # the trainer's seed log, read at each sync (vLLM servers)
    sharded: bool = False  # DeepSpeed ZeRO-3: the weights are partitioned over the processes
    agents: bool = False  # tools, environments or a rollout_func regenerate rows of one member


def eos_token_ids(processing_class, model_generation_config: GenerationConfig | None = None) -> list[int]:
    """Every id that ends a completion, as GRPOTrainer takes them: the tokenizer's ``eos_token_id`` first, then the
    model's ``generation_config.eos_token_id`` (distinct; possibly empty)."""
    # an int or a list: Gemma-3-it, Phi-3.5 and Llama-3 end a turn on an id the tokenizer does not call eos_token
    declared = getattr(model_generation_config, "eos_token_id", None)
    ids = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    if processing_class.eos_token_id is not None and processing_class.eos_token_id not in ids:
        ids = [processing_class.eos_token_id, *ids]
    return list(dict.fromkeys(int(i) for i in ids))


def stop_token_ids(generation_config: GenerationConfig, model: nn.Module, processing_class) -> list[int]:
    """The ids a completion is cut after (possibly none): ``generation_config.eos_token_id``, else
    :func:`eos_token_ids`."""
    eos = generation_config.eos_token_id
    if eos is None:  # generate then takes the model's
        return eos_token_ids(processing_class, getattr(model, "generation_config", None))
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def _cut_after_eos(row: list[int], eos_ids: set) -> list[int]:
    for position, token in enumerate(row):
        if token in eos_ids:
            return row[: position + 1]
    return row


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (where inputs must go); the CPU for a model without parameters."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def is_token_ids(prompts: Sequence) -> bool:
    """Whether ``prompts`` are token-id lists (the tool loop's prompt + completion + tool turn) rather than strings."""
    return bool(prompts) and not isinstance(prompts[0], str)


def encode_prompts(processing_class, prompts: Sequence, add_special_tokens: bool = False) -> list[list[int]]:
    """The prompts' token ids: strings tokenized (with or without the special tokens), id lists as they are."""
    if is_token_ids(prompts):
        return [list(ids) for ids in prompts]
    return processing_class(text=list(prompts), add_special_tokens=add_special_tokens)["input_ids"]


def tokenize_left_padded(processing_class, texts: Sequence, device, add_special_tokens: bool = False,
                         pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of ``texts`` (strings, or token-id lists), left-padded to a multiple of
    ``pad_to_multiple_of`` (as GRPOTrainer), on ``device``."""
    if is_token_ids(texts):
        inputs = processing_class.pad({"input_ids": [list(ids) for ids in texts]}, padding=True, padding_side="left",
                                      pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt")
    else:
        inputs = processing_class(text=list(texts), return_tensors="pt", padding=True, padding_side="left",
                                  add_special_tokens=add_special_tokens, pad_to_multiple_of=pad_to_multiple_of)
    return {k: v.to(device) for k, v in inputs.items()}


def prompt_add_special_tokens(prompts: Sequence) -> bool:
    """Whether these dataset prompts (strings or messages, before the chat template) are tokenized with the special
    tokens, as GRPOTrainer's ``_tokenize_prompts``: ``True`` for plain text (and for none)."""
    from trl.data_utils import is_conversational

    # decided on the first prompt, as GRPO; a chat template renders its own BOS
    return not prompts or not is_conversational({"prompt": prompts[0]})


def resolve_pad_to_multiple_of(value) -> int | None:
    """GRPO's ``pad_to_multiple_of`` as an int or ``None`` (as GRPOConfig parses it).

    Raises:
        ValueError: for anything else than ``None``, ``"auto"`` or a positive integer.
    """
    original = value
    if isinstance(value, str):
        text = value.strip()
        if text == "auto" or text.lower() in ("none", "null"):  # "auto": GRPO pads only on AWS Neuron
            return None
        value = int(text) if text.isdigit() else text
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"pad_to_multiple_of must be None, 'auto' or an integer >= 1 (prompt batches are left-padded "
                         f"to a multiple of it, as in GRPO), got {original!r}.")
    return value
