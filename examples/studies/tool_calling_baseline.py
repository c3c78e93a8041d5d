"""Can the embedded SmolLM2-135M-Instruct call a tool? The baseline of the agents issue, measured before any training.

SmolLM2 speaks ChatML (``<|im_start|>``/``<|im_end|>``), as Qwen2.5 does, so its tokenizer is given TRL's Qwen2.5
chat template (``trl/chat_templates/qwen2_5.jinja``): the tool schema goes into the system turn and TRL parses
``<tool_call>{...}</tool_call>`` from the completions. Each test problem of the arithmetic task ("a op b") is asked
with a calculator tool; one greedy rollout per problem, through ``ESTrainer``'s own agent rollout (the tool loop of
GRPO, ``trl_es.agents.AgentRollout``). Printed and written as JSON: the share of rollouts with a parseable tool call,
with a correct call (the problem's operands and operation), and with the right final answer.

    python examples/studies/tool_calling_baseline.py --num_problems 50 --output_file runs/tool_calling_baseline.json
"""

import argparse
import json
import os
import time
from pathlib import Path

import trl
from tqdm import tqdm
from transformers import AutoTokenizer

from trl_es import ESConfig, ESTrainer
from trl_es.models import EMBEDDED_MODEL, resolve_model_path
from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict


def calculator(a: int, b: int, operation: str) -> int:
    """Compute a op b exactly.

    Args:
        a: The first integer.
        b: The second integer.
        operation: One of "+", "-", "*".

    Returns:
        The result.
    """
    return {"+": a + b, "-": a - b, "*": a * b}[operation]


def final_answer(messages) -> str:
    return messages[-1].get("content") or "" if isinstance(messages, list) else str(messages)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_problems", type=int, default=50)
    parser.add_argument("--max_completion_length", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=10)
    parser.add_argument("--output_file", default=None)
    args = parser.parse_args()

    path = resolve_model_path(EMBEDDED_MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    test = make_arithmetic_dataset_dict(10, 10, args.num_problems, ops=("+", "-", "*"))["test"]
    rows = [{"prompt": [{"role": "user", "content": f"Use the calculator tool to compute {row['a']} {row['op']} "
                                                    f"{row['b']}. Then give the result."}],
             "a": row["a"], "b": row["b"], "op": row["op"], "answer": row["answer"]} for row in test]
    config = ESConfig(output_dir="/tmp/tool_calling_baseline", report_to=[], disable_tqdm=True, population_size=2,
                      max_completion_length=args.max_completion_length, max_tool_calling_iterations=2)
    trainer = ESTrainer(path, lambda completions, **kw: [0.0] * len(completions), args=config, processing_class=tok,
                        tools=[calculator])
    counts = {"rollouts": 0, "with_call": 0, "correct_call": 0, "right_answer": 0, "tool_calls": 0}
    examples = []
    start = time.perf_counter()
    for first in tqdm(range(0, len(rows), args.batch_size), desc="rollouts"):
        batch = rows[first : first + args.batch_size]
        out = trainer.rollout(trainer.model, batch)
        counts["tool_calls"] += out.tool_calls
        for row, messages in zip(batch, out.reward_completions, strict=True):
            calls = [c["function"] for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
            counts["rollouts"] += 1
            counts["with_call"] += bool(calls)
            counts["correct_call"] += any(c["name"] == "calculator" and c.get("arguments") == {
                "a": row["a"], "b": row["b"], "operation": row["op"]} for c in calls)
            counts["right_answer"] += str(row["answer"]) in final_answer(messages)
            if len(examples) < 3:
                examples.append({"problem": f"{row['a']} {row['op']} {row['b']}", "messages": messages})
    result = {**counts, **{f"{k}_rate": counts[k] / counts["rollouts"] for k in ("with_call", "correct_call",
                                                                                  "right_answer")},
              "seconds": time.perf_counter() - start, "examples": examples}
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=1))
    print(json.dumps(examples[0], indent=1)[:1500])
    if args.output_file:
        os.makedirs(os.path.dirname(args.output_file) or ".", exist_ok=True)
        with open(args.output_file, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
