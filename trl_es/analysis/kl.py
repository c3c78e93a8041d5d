"""Off-task KL drift: Monte-Carlo KL(p_current || p_base) on completions sampled from the current model."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from ..generation.base import eos_token_ids, model_device
from ._common import ModelLike, eval_mode, load_model


__all__ = ["encode_prompts", "off_task_kl"]


def _render(tokenizer, prompts: Sequence) -> list[tuple[str, bool]]:
    """``(text, is_templated)`` per prompt: a ``str`` as is, a conversation through :func:`trl_es.rollout.prompt_texts`.

    Raises:
        ValueError: if ``prompts`` is empty.
        TypeError: if an element is neither a string nor a list of messages.
    """
    from ..rollout import prompt_texts

    if isinstance(prompts, str):  # one prompt
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("`prompts` must contain at least one prompt.")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append((p, False))  # a string as it is
        elif isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) for m in p):
            # with the generation prompt, as training renders it
            out.append((prompt_texts([{"prompt": list(p)}], tokenizer)[0], True))
        else:
            raise TypeError(
                f"prompts[{i}] must be a str or a non-empty list of {{'role', 'content'}} messages, "
                f"got {type(p).__name__}."
            )
    return out


def encode_prompts(tokenizer, prompts: Sequence) -> list[list[int]]:
    """Unpadded token ids of each prompt (strings with the special tokens, conversations through the chat template).

    Raises:
        ValueError, TypeError: as :func:`_render`; ValueError if a prompt encodes to no tokens.
    """
    out = []
    for i, (text, templated) in enumerate(_render(tokenizer, prompts)):
        # a rendered chat template already holds BOS
        ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
        if len(ids) == 0:
            raise ValueError(f"prompts[{i}] encodes to no tokens; give non-empty prompts.")
        out.append(list(ids))
    return out


def _left_pad(sequences: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad token id lists to one length (as needed by decoder-only ``generate``)."""
    length = max(len(x) for x in sequences)
    # left: decoder-only generate continues the last token
    ids = torch.tensor([[pad_id] * (length - len(x)) + x for x in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (length - len(x)) + [1] * len(x) for x in sequences], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask}


def _completion_mask(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 for every generated token up to and including the first EOS, 0 after it (generate pads finished rows)."""
    if not eos_token_ids:
        return torch.ones_like(completion_ids, dtype=torch.long)  # no EOS: every generated token counts
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    # number of EOS strictly before each position; keep positions with none before them
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).long()  # up to and including the first EOS; generate pads finished rows


def _token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(x_t | x_<t) of every token but the first, shape (B, L-1), float32; position ids follow the mask."""
    device = model_device(model)
    input_ids = input_ids.to(device)
    attention_mask = attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # position ids follow the mask, as in generate
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)  # float32; shape (B, L-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1).cpu()  # log p(x_t | x_<t), t >= 1


def off_task_kl(
    model: ModelLike,
    base_model: ModelLike,
    tokenizer,
    prompts: Sequence,
    max_new_tokens: int = 64,
    num_samples: int = 1,
    seed: int = 0,
    batch_size: int = 8,
) -> dict:
    r"""Off-task KL drift of ``model`` from ``base_model`` on completions sampled from ``model`` (arXiv 2608.27351,
    arXiv 2604.01499).

    .. math::
        \widehat{\mathrm{KL}} = \frac{1}{|T|} \sum_{(x, y) } \sum_{t \in T(y)}
            \big[\log p_\theta(y_t \mid x, y_{<t}) - \log p_{\theta_0}(y_t \mid x, y_{<t})\big],
        \qquad y \sim p_\theta(\cdot \mid x)

    with :math:`T(y)` the generated tokens up to and including the first EOS; 0 for a model with itself. ``model`` and
    ``base_model`` (modules or paths) share ``tokenizer``; ``prompts`` are strings or conversations;
    ``max_new_tokens``, ``num_samples`` (per prompt) and ``batch_size`` are >= 1; ``seed`` seeds the sampling.

    Returns:
        dict: ``{"kl": float, "per_prompt": list[float], "num_tokens": int}`` (``per_prompt``: ``nan`` without tokens).

    Raises:
        ValueError: for a count < 1, no prompt, or a tokenizer with neither a pad nor an EOS token.
        TypeError: for a state dict as a model (a forward pass is needed) or a prompt of a wrong type.
    """
    for name, value in (("max_new_tokens", max_new_tokens), ("num_samples", num_samples), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    model = load_model(model)
    base_model = load_model(base_model)
    for name, m in (("model", model), ("base_model", base_model)):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(
                f"`{name}` must be a model or a checkpoint path (a forward pass is needed), not a state dict."
            )
    encoded = encode_prompts(tokenizer, prompts)
    # EOS pads when there is no pad token
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer needs a pad token or an EOS token to batch prompts.")
    eos_ids = eos_token_ids(tokenizer, getattr(model, "generation_config", None))  # the model's and the tokenizer's
    gen_config = GenerationConfig(
        do_sample=True,
        temperature=1.0,  # sampled at temperature 1 with no top-k / top-p / min-p / typical / penalty warping
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        typical_p=1.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_samples,
        pad_token_id=pad_id,
        eos_token_id=eos_ids or None,
    )

    sums = torch.zeros(len(encoded), dtype=torch.float64)
    counts = torch.zeros(len(encoded), dtype=torch.long)
    device = model_device(model)
    rng_devices = [device] if device.type == "cuda" else []
    # the global RNG is left as it was
    with eval_mode(model, base_model), torch.inference_mode(), torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start : start + batch_size]
            enc = _left_pad(chunk, pad_id)  # left-padded for generate
            prompt_len = enc["input_ids"].shape[1]
            seqs = model.generate(
                input_ids=enc["input_ids"].to(device),
                attention_mask=enc["attention_mask"].to(device),
                generation_config=gen_config,
            ).cpu()
            completion = seqs[:, prompt_len:]
            comp_mask = _completion_mask(completion, eos_ids)  # prompt tokens and padding are masked
            # num_samples rows per prompt
            attn = torch.cat([enc["attention_mask"].repeat_interleave(num_samples, dim=0), comp_mask], dim=1)
            lp_cur = _token_logprobs(model, seqs, attn)
            lp_base = _token_logprobs(base_model, seqs, attn)
            # token at position j (j >= 1) is predicted by logits at j-1 -> index j-1 in the (L-1) arrays
            ratio = (lp_cur - lp_base)[:, prompt_len - 1 :].double() * comp_mask
            row_prompt = torch.arange(len(chunk)).repeat_interleave(num_samples) + start  # each row's prompt index
            sums.index_add_(0, row_prompt, ratio.sum(dim=1))  # float64 sums per prompt
            counts.index_add_(0, row_prompt, comp_mask.sum(dim=1))
    total_tokens = int(counts.sum())
    per_prompt = [float(s / c) if c > 0 else float("nan") for s, c in zip(sums.tolist(), counts.tolist(), strict=False)]
    # the mean over all tokens, not of the prompts' means
    kl = float(sums.sum() / total_tokens) if total_tokens > 0 else float("nan")
    return {"kl": kl, "per_prompt": per_prompt, "num_tokens": total_tokens}
