"""The eager engine: ``model.generate`` as transformers runs it, optionally with a shared prompt prefix; the default
engine of :func:`generate_completions`."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import DynamicCache

from .base import Completions, GenerationEngine, encode_prompts, model_device, tokenize_left_padded
from .sampling import use_candidate_sampler
from .top_p import use_candidate_top_p


SHAREABLE_ATTENTION = ("sdpa", "eager")

ORDER_DEPENDENT_PROCESSORS = ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "sequence_bias")
"""Generation settings whose logits processors read the prompt's token *order* (n-grams): the shared path's
``[prefix | padding | suffix]`` rows would feed them other n-grams than left padding does, so sharing is skipped."""


def synced_forwards() -> bool:
    """Whether ``generate`` will run with ``synced_gpus`` on its own (DeepSpeed ZeRO-3 with several processes): every
    process must then run the same number of forwards, so an extra prefix forward decided per process would hang."""
    try:
        import torch.distributed as dist
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return is_deepspeed_zero3_enabled() and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def common_prefix_length(rows: list[list[int]]) -> int:
    """Length of the longest token prefix shared by every row, leaving each row at least one token of its own."""
    if not rows:
        return 0
    limit = min(len(r) for r in rows) - 1  # the last token of each row stays its own
    first = rows[0]
    length = 0
    while length < limit and all(r[length] == first[length] for r in rows):
        length += 1
    return length


def cache_kwarg(model) -> str:
    """The name under which ``model``'s forward takes a KV cache (``cache`` in transformers >= 5.24, else
    ``past_key_values``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class EagerEngine(GenerationEngine):
    """One left-padded ``model.generate`` call per batch (any model, any generation setting).

    With ``share_prompt_prefix=True`` the token prefix every row shares (a chat template's system prompt) runs once
    per row group, where :meth:`can_share` allows it; the result equals the plain path's up to rounding.

    Args:
        share_prompt_prefix (`bool`): Compute the shared prompt prefix once per row group.
        min_shared_prefix (`int`): Shortest shared prefix (tokens) worth a separate forward.
        candidate_sampling (`bool`): Draw sampled tokens with :func:`trl_es.generation.sampling.use_candidate_sampler`
            (same distribution, other draws than transformers' for a seed).
        pad_to_multiple_of (`int`, *optional*): GRPO's ``pad_to_multiple_of`` for the left-padded prompt batch.
    """

    name = "eager"

    def __init__(self, share_prompt_prefix: bool = False, min_shared_prefix: int = 8, candidate_sampling: bool = False,
                 pad_to_multiple_of: int | None = None):
        self.share_prompt_prefix = bool(share_prompt_prefix)
        self.pad_to_multiple_of = pad_to_multiple_of  # GRPO's: the padded prompt length is a multiple of it
        self.min_shared_prefix = int(min_shared_prefix)
        self.candidate_sampling = bool(candidate_sampling)
        self.last_shared_prefix = 0  # tokens shared in the last call (0: plain path), for logging and tests

    def describe(self) -> dict:
        facts = {"name": self.name, "share_prompt_prefix": self.share_prompt_prefix}
        if self.pad_to_multiple_of is not None:
            facts["pad_to_multiple_of"] = self.pad_to_multiple_of
        return {**facts, "candidate_sampling": True} if self.candidate_sampling else facts

    def can_share(self, model, generation_config, generate_kwargs) -> bool:
        """Whether prefix sharing applies to this model and these settings."""
        config = model.config
        attention = getattr(config, "_attn_implementation", None) or "eager"
        return (
            self.share_prompt_prefix
            and not config.is_encoder_decoder
            and attention in SHAREABLE_ATTENTION
            and getattr(model, "_supports_default_dynamic_cache", lambda: True)()
            and generation_config.use_cache is not False
            and generate_kwargs.get("use_cache", True) is not False
            and not generate_kwargs.get("synced_gpus", False)  # ZeRO-3: every process runs the same forwards
            and not synced_forwards()
            and not any(getattr(generation_config, name, None) for name in ORDER_DEPENDENT_PROCESSORS)  # n-grams
            and (generation_config.num_beams or 1) == 1
            and (generation_config.num_return_sequences or 1) == 1
            and generation_config.cache_implementation in (None, "dynamic")
        )

    def _generate_ids(self, model, processing_class, texts, generation_config, num_row_groups,
                      add_special_tokens=False, **generate_kwargs):
        self.last_shared_prefix = 0
        if self.candidate_sampling:
            generation_config, generate_kwargs = use_candidate_sampler(generation_config, generate_kwargs, model=model)
        if generation_config.do_sample:  # top-p without sorting the vocabulary (the same tokens); greedy has no top-p
            generation_config, generate_kwargs = use_candidate_top_p(generation_config, generate_kwargs, model=model)
        device = model_device(model)
        if self.can_share(model, generation_config, generate_kwargs):
            encoded = encode_prompts(processing_class, texts, add_special_tokens)
            shared = common_prefix_length(encoded)
            if shared >= self.min_shared_prefix:
                self.last_shared_prefix = shared
                return self._generate_shared(model, processing_class, encoded, shared, generation_config,
                                             num_row_groups, device, **generate_kwargs)
        inputs = tokenize_left_padded(processing_class, texts, device, add_special_tokens, self.pad_to_multiple_of)
        output = model.generate(**inputs, generation_config=generation_config, **generate_kwargs)
        return output[:, inputs["input_ids"].shape[1] :].tolist()

    def _generate_shared(self, model, processing_class, encoded, shared, generation_config, num_row_groups, device,
                         **generate_kwargs):
        pad = processing_class.pad_token_id if processing_class.pad_token_id is not None \
            else processing_class.eos_token_id  # masked out, any id does
        prefix = encoded[0][:shared]
        key = cache_kwarg(model)
        cache = DynamicCache(config=model.config)
        prefix_ids = torch.tensor([prefix] * num_row_groups, dtype=torch.long, device=device)
        model(input_ids=prefix_ids, use_cache=True, logits_to_keep=1, **{key: cache})  # one prefix row per group
        cache.batch_repeat_interleave(len(encoded) // num_row_groups)  # ... repeated to every row of its group
        suffixes = [row[shared:] for row in encoded]  # each row's own tokens
        width = max(len(s) for s in suffixes)
        if self.pad_to_multiple_of:  # GRPO's padding: the whole row (prefix | padding | suffix) to a multiple
            width = -(-(shared + width) // self.pad_to_multiple_of) * self.pad_to_multiple_of - shared
        input_ids = torch.tensor([prefix + [pad] * (width - len(s)) + s for s in suffixes], dtype=torch.long,
                                 device=device)
        # [prefix | padding | suffix], the padding masked: positions come from the mask, as without sharing
        attention_mask = torch.tensor([[1] * shared + [0] * (width - len(s)) + [1] * len(s) for s in suffixes],
                                      dtype=torch.long, device=device)
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config,
                                **{key: cache}, **generate_kwargs)
        return output[:, input_ids.shape[1] :].tolist()


@torch.no_grad()
def generate_completions(
    model: nn.Module,
    processing_class,
    prompts,
    generation_config,
    num_generations: int = 1,
    engine: GenerationEngine | None = None,
    num_row_groups: int = 1,
    **generate_kwargs,
) -> Completions:
    """Generate ``num_generations`` completions per prompt with ``engine`` (default: the plain eager engine).

    See :meth:`GenerationEngine.generate`. Returns :class:`Completions` (unpacks as ``texts, ids``).
    """
    engine = engine or EagerEngine()
    return engine.generate(model, processing_class, prompts, generation_config, num_generations, num_row_groups,
                           **generate_kwargs)
