"""ES against GRPO on a tool task: two-digit multiplication with a ``multiply`` tool, after an SFT warm-up.

The embedded SmolLM2-135M-Instruct makes no tool call with TRL's Qwen2.5 tool template (``tool_calling_baseline.py``),
so the study first teaches the format with TRL's ``SFTTrainer`` on traces where **half** the answers call the tool
and half state the product directly (a product the model cannot compute in its head), then trains from that
warm-up with ESTrainer and with TRL's GRPOTrainer (the same ``tools=[multiply]``, reward and prompts). A rollout
scores 1.0 when its final assistant message states ``a * b`` (:func:`trl_es.tasks.arithmetic.stated_result`), so
the learnable skill is *when to call the tool* (and copy its result): ``tools/call_frequency`` should rise.

Splits (``make_arithmetic_dataset_dict``, operands 10..99, ``*``, disjoint): ``test`` (reported, never tuned on),
``validation`` (tuning), the SFT traces and the RL training prompts. Every model (warm-up, each arm's end) is scored
by one function: greedy rollouts through ESTrainer's agent rollout on ``--eval_split`` (accuracy and calls per
rollout). Both methods see the same number of completions (``--completions_budget``); minutes are measured.

    python examples/studies/agents_es_vs_grpo.py --output_dir runs/agents                  # warm-up, 3 seeds x 2
    python examples/studies/agents_es_vs_grpo.py --output_dir runs/agents_val --eval_split validation --seeds 0

Writes ``warmup/`` (the SFT model), ``<method>_seed<k>/result.json`` (curves from the trainer's log: reward and
``tools/call_frequency`` per step; the split's accuracy at the start and end), ``results.json``, ``results.md`` and
``curves.png`` under ``--output_dir``. An arm whose ``result.json`` exists is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import trl
from _study.spread import mean_and_std
from transformers import TrainerCallback

from trl_es.files import save_figure, write_json, write_text
from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict, stated_result


TEMPLATE = Path(trl.__file__).parent / "chat_templates"
METHODS = ("grpo", "es")  # per seed GRPO first: ES then trains for GRPO's minutes
NO_LIMIT_STEPS = 1_000_000


def multiply(a: int, b: int) -> int:
    """Multiply two integers exactly.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product a * b.
    """
    return a * b


def question(row: dict) -> list[dict]:
    return [{"role": "user", "content": f"What is {row['a']} * {row['b']}?"}]


def final_text(completion) -> str:
    """The last assistant message's text of a multi-turn completion (a message list), or the completion itself."""
    if isinstance(completion, list):
        texts = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
        return texts[-1] if texts else ""
    return str(completion)


def product_reward(completions, a, b, **kwargs) -> list[float]:
    """1.0 when the final assistant message's first stated result is ``a * b``, else 0.0 (a TRL reward function)."""
    return [float(stated_result(final_text(c), x, y, "*") == x * y) for c, x, y in zip(completions, a, b, strict=True)]


def splits(args) -> dict:
    """The task's disjoint splits: ``test``, ``validation``, ``sft`` (warm-up traces) and ``train`` (RL prompts)."""
    data = make_arithmetic_dataset_dict(args.num_sft + args.num_train, args.num_validation, args.num_test,
                                        seed=args.task_seed, low=10, high=99, ops=("*",))
    rows = {name: [{"prompt": question(r), "a": r["a"], "b": r["b"]} for r in data[name]]
            for name in ("train", "validation", "test")}
    rows["sft"], rows["train"] = rows["train"][: args.num_sft], rows["train"][args.num_sft :]
    return rows


def trace(row: dict, call: bool) -> dict:
    """One SFT conversation: the question, then a ``multiply`` call, its result and the answer, or the answer."""
    a, b = row["a"], row["b"]
    answer = {"role": "assistant", "content": f"{a} * {b} = {a * b}"}
    if not call:
        return {"messages": row["prompt"] + [answer]}
    tool_call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return {"messages": row["prompt"] + [{"role": "assistant", "content": "", "tool_calls": [tool_call]},
                                         {"role": "tool", "name": "multiply", "content": str(a * b)}, answer]}


def tool_tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = (TEMPLATE / "qwen2_5.jinja").read_text()  # SmolLM2 speaks ChatML, as Qwen2.5
    return tokenizer


def warm_up(args, rows: dict, output_dir: str) -> None:
    """SFT on the traces (TRL's SFTTrainer, loss on the assistant turns only); saves model and tool tokenizer."""
    from datasets import Dataset
    from transformers.utils import get_json_schema
    from trl import SFTConfig, SFTTrainer

    from trl_es.models import resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = tool_tokenizer(path)
    schema = json.dumps([get_json_schema(multiply)])
    every = round(1 / args.warmup_call_fraction) if args.warmup_call_fraction else 0
    data = Dataset.from_list([{**trace(r, bool(every) and i % every == 0), "tools": schema}
                              for i, r in enumerate(rows["sft"])])
    training = tool_tokenizer(path)
    training.chat_template = (TEMPLATE / "qwen2_5_training.jinja").read_text()  # {% generation %} marks for the mask
    config = SFTConfig(output_dir=output_dir, max_steps=args.warmup_steps, per_device_train_batch_size=8,
                       learning_rate=args.warmup_learning_rate, lr_scheduler_type="constant", assistant_only_loss=True,
                       logging_steps=5, save_strategy="no", report_to=[], seed=args.task_seed, use_cpu=True,
                       gradient_checkpointing=False)  # memory is not the limit on CPU; time is
    trainer = SFTTrainer(path, args=config, train_dataset=data, processing_class=training)
    trainer.train()
    trainer.save_model(output_dir)
    tokenizer.save_pretrained(output_dir)  # the inference template (TRL's response schema is added at load)


def score(model, rows: list[dict], args) -> dict:
    """Greedy accuracy and calls per rollout of ``model`` (a path) on ``rows``, through ESTrainer's agent rollout."""
    from trl_es import ESConfig, ESTrainer

    config = ESConfig(output_dir="/tmp/agents_score", report_to=[], disable_tqdm=False, population_size=2,
                      temperature=0.0, max_completion_length=args.max_completion_length,
                      max_tool_calling_iterations=args.max_tool_calling_iterations,
                      per_device_eval_batch_size=args.eval_batch_size)
    trainer = ESTrainer(model, product_reward, args=config, processing_class=tool_tokenizer(model), tools=[multiply])
    metrics = trainer.evaluate(eval_dataset=_dataset(rows))
    return {"accuracy": metrics["eval_reward"], "call_frequency": metrics["eval_tools/call_frequency"],
            "failure_frequency": metrics["eval_tools/failure_frequency"], "num_rollouts": len(rows)}


def _dataset(rows: list[dict]):
    from datasets import Dataset

    return Dataset.from_list(rows)


class EqualBudget(TrainerCallback):
    """Saves the model once ``mark_step`` steps are done; stops training after ``minutes`` (None: never)."""

    def __init__(self, mark_step: int | None = None, minutes: float | None = None, mark_dir: str | None = None):
        self.mark_step, self.minutes, self.mark_dir, self.trainer = mark_step, minutes, mark_dir, None
        self.start = self.elapsed = None
        self.minutes_at = {}  # step -> training minutes when it ended

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.elapsed = (time.perf_counter() - self.start) / 60
        self.minutes_at[state.global_step] = self.elapsed
        if state.global_step == self.mark_step and self.mark_dir:
            self.trainer.save_model(self.mark_dir)
            self.trainer.processing_class.save_pretrained(self.mark_dir)
        if self.minutes is not None and self.elapsed >= self.minutes and state.global_step >= (self.mark_step or 0):
            control.should_training_stop = True


def train_arm(args, rows: dict, method: str, seed: int, warm: str, output_dir: str, minutes: float | None) -> dict:
    """Train one arm from the warm-up model on ``rows["train"]``.

    GRPO runs ``args.completions_budget`` completions. ES runs ``minutes`` of training (GRPO's, when given; else the
    same completions), its model saved under ``equal_completions/`` at the first step with at least GRPO's count.
    """
    log_every = 1
    budget = EqualBudget()
    if method == "es":
        from trl_es import ESConfig, ESTrainer

        per_step = args.es_population_size * args.es_prompt_batch_size
        mark_step = -(-args.completions_budget // per_step)  # the first step with at least GRPO's completions
        budget = EqualBudget(mark_step, minutes, os.path.join(output_dir, "equal_completions"))
        config = ESConfig(output_dir=output_dir, max_steps=NO_LIMIT_STEPS if minutes else budget.mark_step, seed=seed,
                          population_size=args.es_population_size, prompt_batch_size=args.es_prompt_batch_size,
                          sigma=args.es_sigma, learning_rate=args.es_learning_rate, lr_scheduler_type="constant",
                          fitness_shaping="zscore", antithetic=True, temperature=0.0,
                          max_completion_length=args.max_completion_length,
                          max_tool_calling_iterations=args.max_tool_calling_iterations, logging_steps=log_every,
                          save_strategy="no", report_to=[])
        trainer = ESTrainer(warm, product_reward, args=config, train_dataset=_dataset(rows["train"]),
                            processing_class=tool_tokenizer(warm), tools=[multiply], callbacks=[budget])
    else:
        from trl import GRPOConfig, GRPOTrainer

        per_step = args.grpo_prompts_per_step * args.grpo_num_generations
        config = GRPOConfig(output_dir=output_dir, max_steps=args.completions_budget // per_step, seed=seed,
                            per_device_train_batch_size=per_step, num_generations=args.grpo_num_generations,
                            learning_rate=args.grpo_learning_rate, lr_scheduler_type="constant",
                            max_completion_length=args.max_completion_length,
                            max_tool_calling_iterations=args.max_tool_calling_iterations, logging_steps=log_every,
                            save_strategy="no", report_to=[], use_cpu=True, beta=0.0,
                            gradient_checkpointing=False)
        trainer = GRPOTrainer(warm, product_reward, args=config, train_dataset=_dataset(rows["train"]),
                              processing_class=tool_tokenizer(warm), tools=[multiply], callbacks=[budget])
    budget.trainer = trainer
    trainer.train()
    final = os.path.join(output_dir, "final")
    trainer.save_model(final)
    trainer.processing_class.save_pretrained(final)
    reward_key = "reward"
    curve = [{"step": e["step"], "completions": e["step"] * per_step, "reward": e[reward_key],
              "call_frequency": e.get("tools/call_frequency"), "minutes": budget.minutes_at.get(e["step"])}
             for e in trainer.state.log_history if reward_key in e]
    return {"method": method, "seed": seed, "steps": trainer.state.global_step, "completions_per_step": per_step,
            "completions": trainer.state.global_step * per_step, "train_minutes": budget.elapsed, "curve": curve,
            "final": final, "equal_completions": {"steps": budget.mark_step, "completions": (budget.mark_step or 0)
                                                  * per_step, "model": budget.mark_dir} if budget.mark_dir else None}


def summarize(results: list[dict], warm: dict, split: str) -> str:
    """The markdown table: mean ± std over seeds of each arm's accuracy, calls per rollout, completions, minutes."""
    lines = [f"| model | seeds | {split} accuracy | calls per rollout | completions | training minutes |",
             "|---|---|---|---|---|---|",
             f"| SFT warm-up (start of both) | - | {warm['accuracy']:.3f} | {warm['call_frequency']:.2f} | 0 | 0 |"]
    arms = [("GRPO", "grpo", lambda r: r), ("ES, GRPO's completions", "es", lambda r: r["equal_completions"]),
            ("ES, GRPO's minutes", "es", lambda r: r)]
    for label, method, pick in arms:
        arm = [pick(r) for r in results if r["method"] == method and pick(r)]
        if not arm:
            continue
        cells = [mean_and_std([r[k] for r in arm]) for k in ("accuracy", "call_frequency", "completions",
                                                                    "train_minutes")]
        lines.append(f"| {label} | {len(arm)} | {cells[0][0]:.3f} ± {cells[0][1]:.3f} | {cells[1][0]:.2f} ± "
                     f"{cells[1][1]:.2f} | {cells[2][0]:.0f} | {cells[3][0]:.1f} ± {cells[3][1]:.1f} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in results:
        xs = [p["completions"] for p in r["curve"]]
        style = {"color": "C0" if r["method"] == "es" else "C1", "alpha": 0.8}
        axes[0].plot(xs, [p["reward"] for p in r["curve"]], label=f"{r['method']} seed {r['seed']}", **style)
        axes[1].plot(xs, [p["call_frequency"] for p in r["curve"]], **style)
    axes[0].set(xlabel="completions", ylabel="training reward (batch mean)")
    axes[1].set(xlabel="completions", ylabel="tools/call_frequency")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model", default="embedded:SmolLM2-135M-Instruct")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--eval_split", default="test", choices=("test", "validation"))
    p.add_argument("--task_seed", type=int, default=0)
    p.add_argument("--num_sft", type=int, default=320)
    p.add_argument("--num_train", type=int, default=400)
    p.add_argument("--num_validation", type=int, default=100)
    p.add_argument("--num_test", type=int, default=100)
    p.add_argument("--warmup_steps", type=int, default=12)
    p.add_argument("--warmup_learning_rate", type=float, default=5e-5)
    p.add_argument("--warmup_call_fraction", type=float, default=0.5, help="share of SFT traces that call the tool")
    p.add_argument("--max_completion_length", type=int, default=96, help="tool call and tool turn included")
    p.add_argument("--max_tool_calling_iterations", type=int, default=2)
    p.add_argument("--eval_batch_size", type=int, default=50)
    p.add_argument("--completions_budget", type=int, default=192, help="GRPO's completions")
    p.add_argument("--es_population_size", type=int, default=8)
    p.add_argument("--es_prompt_batch_size", type=int, default=12)
    p.add_argument("--es_sigma", type=float, default=0.005)
    p.add_argument("--es_learning_rate", type=float, default=0.01)
    p.add_argument("--grpo_prompts_per_step", type=int, default=2)
    p.add_argument("--grpo_num_generations", type=int, default=4)
    p.add_argument("--grpo_learning_rate", type=float, default=1e-5)
    # one arm, in its own process
    p.add_argument("--arm", nargs=3, metavar=("METHOD", "SEED", "MINUTES"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rows = splits(args)
    warm = os.path.join(args.output_dir, "warmup")
    if args.arm:  # a child process: one arm, then its scores
        method, seed, minutes = args.arm[0], int(args.arm[1]), float(args.arm[2]) or None
        out = os.path.join(args.output_dir, f"{method}_seed{seed}")
        result = train_arm(args, rows, method, seed, warm, out, minutes)
        result.update(score(result["final"], rows[args.eval_split], args))
        if result["equal_completions"]:
            mark = result["equal_completions"]
            mark.update(score(mark["model"], rows[args.eval_split], args))
            mark["train_minutes"] = next((p["minutes"] for p in result["curve"] if p["step"] == mark["steps"]), None)
        write_json(os.path.join(out, "result.json"), result)
        return result
    if not os.path.exists(os.path.join(warm, "config.json")):
        warm_up(args, rows, warm)
    warm_file = os.path.join(args.output_dir, f"warmup_{args.eval_split}.json")
    if not os.path.exists(warm_file):
        write_json(warm_file, score(warm, rows[args.eval_split], args))
    warm_score = json.loads(Path(warm_file).read_text())
    print(f"warm-up on {args.eval_split}: {warm_score}", flush=True)
    results = []
    for seed in args.seeds:
        grpo_minutes = 0.0  # ES trains for GRPO's minutes of this seed when GRPO ran
        for method in args.methods:
            file = os.path.join(args.output_dir, f"{method}_seed{seed}", "result.json")
            if not os.path.exists(file):  # a fresh process per arm: threads, memory and RNG start clean
                child = list(argv if argv is not None else sys.argv[1:])
                subprocess.run([sys.executable, __file__, *child, "--arm", method, str(seed), str(grpo_minutes)],
                               check=True)
            results.append(json.loads(Path(file).read_text()))
            if method == "grpo":
                grpo_minutes = results[-1]["train_minutes"]
            print(f"{method} seed {seed}: {args.eval_split} accuracy {results[-1]['accuracy']:.3f}, calls per rollout "
                  f"{results[-1]['call_frequency']:.2f}, {results[-1]['train_minutes']:.1f} min", flush=True)
    table = summarize(results, warm_score, args.eval_split)
    print(table)
    write_text(os.path.join(args.output_dir, "results.md"), table)
    write_json(os.path.join(args.output_dir, "results.json"), {"warmup": warm_score, "arms": results,
                                                               "args": vars(args)})
    plot(results, os.path.join(args.output_dir, "curves.png"))
    return {"warmup": warm_score, "arms": results}


if __name__ == "__main__":
    main()
