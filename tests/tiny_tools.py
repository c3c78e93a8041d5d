"""Tool calling on the tiny models: tests/tiny.py's character-level tokenizer with TRL's Qwen2.5 chat template (TRL
parses its tool calls), a tiny Llama long enough for a tool schema, and a scripted ``generate`` (as TRL's own tool
tests patch ``model.generate``)."""

import json
from pathlib import Path

import torch
import trl
from tiny import build_llama, build_tokenizer


QWEN2_5_TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def tool_tokenizer():
    """The tiny character-level tokenizer with TRL's Qwen2.5 chat template."""
    tok = build_tokenizer()
    tok.chat_template = QWEN2_5_TEMPLATE
    return tok


def tool_model(tok, seed: int = 0):
    model = build_llama(tok, seed)
    model.config.max_position_embeddings = 4096  # a prompt with a tool schema is ~900 characters
    return model


def scripted(tok, script, calls: list | None = None):
    """A ``generate`` that answers ``script(prompt_text, index) -> completion text`` for the ``index``-th row of each
    call (ES calls it once per member and turn, with the rows still rolling out); each call's decoded prompts are
    appended to ``calls`` when given. Completions are right-padded with the pad id."""

    def generate(input_ids=None, attention_mask=None, **kwargs):
        prompts = [tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
                   for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True)]
        if calls is not None:
            calls.append(prompts)
        rows = [tok(script(prompt, index), add_special_tokens=False)["input_ids"]
                for index, prompt in enumerate(prompts)]
        width = max(len(r) for r in rows)
        out = [r + [tok.pad_token_id] * (width - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(out, dtype=input_ids.dtype)], dim=1)

    return generate


def turn_of(prompt: str) -> int:
    """The tool turns a prompt already holds (0: the first generation)."""
    return prompt.count("<tool_response>")


def tool_call(name, **arguments) -> str:
    """A Qwen2.5 tool call of ``name`` with ``arguments``, ending the turn."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call><|im_end|>'


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b
