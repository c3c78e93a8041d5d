"""Pre-train a tiny causal LM from scratch on arithmetic + general text, keeping intermediate checkpoints.

The pre-training stage of the "RL Excursions during Pre-Training" study (arXiv 2606.04272): later scripts apply RL or
SFT to each intermediate checkpoint written here.

1. Problems: the arithmetic grid ``ops x [low, high]^2`` is split by
   :func:`_study.pretraining_corpus.pretraining_arithmetic_splits` (``--task_seed``): ``test``
   (``--num_test_problems``) and ``validation`` (``--num_validation_problems``) are held out of pre-training; every
   other problem may appear in it. RL / SFT on the checkpoints should use the same call (same arguments, recorded in
   ``pretraining.json``) and its plain-text (non-conversational) prompts.
2. Corpus: :func:`~_study.pretraining_corpus.make_pretraining_corpus`, ``--num_documents`` documents of which
   ``--task_fraction`` are task documents (question + worked answer, ``"What is 13 - 17? Reply with only the number.
   13 - 17 = -4"``), the rest English-like general text; plus held-out general text (``--num_general_eval``).
3. Tokenizer: ``--tokenizer corpus`` (default) trains a byte-level BPE of ``--vocab_size`` tokens on the corpus
   (:func:`_study.pretraining.train_corpus_tokenizer`, SmolLM2-like: digits are single tokens); any other value is
   loaded with ``AutoTokenizer`` (``embedded:SmolLM2-135M-Instruct`` for the embedded model's 49,152-token
   tokenizer: about 6x slower per step on a CPU, its output layer dominates).
4. Pre-training: :func:`_study.pretraining.pretrain_from_scratch` (transformers' ``Trainer``, causal-LM loss), a
   checkpoint ``checkpoint-<step>/`` every ``--save_steps`` and at ``--max_steps``.
5. Evaluation of every checkpoint: general-eval LM loss (nats per token) and greedy accuracy
   (:func:`trl_es.analysis.greedy_accuracy`, graded by :func:`trl_es.tasks.arithmetic.arithmetic_reward`) on the
   held-out ``test`` problems and on up to ``--num_seen_problems`` problems of the pre-training pool (``seen``).

Writes to ``--output_dir``: ``checkpoint-<step>/`` (model + tokenizer), ``general_eval.json`` (the held-out
general-text documents, a JSON list of strings: the LM-loss texts of later stages) and ``pretraining.json`` (the
arguments, the problem split and corpus calls with their arguments, and per checkpoint: ``step``, ``path``,
``train_loss``, ``eval_loss``, ``general_eval_loss``, ``test_accuracy``, ``seen_accuracy``).

    python examples/studies/pretrain_from_scratch.py --output_dir runs/pretrain_from_scratch

The defaults, measured once on the shared 2-core CPU (one thread, other jobs running): 7.4 min in all (428 s of
training); a 984,192-parameter Llama (4 layers, width 128, 1,024-token vocabulary); 40,000 documents, 12,000 of them
task documents over 582 distinct problems (a, b in 0..20, + and -); 200 held-out test problems, 100 seen ones.
The random model's general-eval loss is 6.95 nats/token.

    step   train loss   general-eval loss   test accuracy   seen accuracy
     250      1.836           2.340              0.030           0.020
     500      1.602           2.191              0.050           0.090
     750      1.609           2.126              0.045           0.130
    1000      1.560           2.108              0.115           0.170
    1250      1.562           2.083              0.175           0.290
    1500      1.537           2.057              0.160           0.320
    1750      1.526           2.065              0.290           0.640
    2000      1.475           2.032              0.380           0.660
    2250      1.506           2.026              0.505           0.900
    2500      1.508           2.013              0.590           0.970
    2750      1.460           2.009              0.610           0.990
    3000      1.469           2.006              0.605           0.990

(Train loss: the mean over the last 50 steps, task documents included; general-eval loss:
:func:`trl_es.analysis.lm_loss_fn` on the 200 held-out general documents.) Held-out accuracy rises from near 0 to
about 60 %, so RL / SFT has room on the test problems at every checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

from trl_es.files import write_json

from _study.arms import parse_arguments


@dataclass
class PretrainArguments:
    """Arguments of the from-scratch pre-training run (every field is also a key of a ``--config`` YAML file)."""

    output_dir: str = field(default="runs/pretrain_from_scratch", metadata={"help": "Where checkpoints go."})
    seed: int = field(default=0, metadata={"help": "Seed of the corpus, the initialisation and the data order."})
    # problems and corpus
    task_seed: int = field(default=0, metadata={"help": "Seed of the held-out problem split."})
    low: int = field(default=0, metadata={"help": "Smallest operand."})
    high: int = field(default=20, metadata={"help": "Largest operand."})
    ops: list[str] = field(default_factory=lambda: ["+", "-"], metadata={"help": "Operators."})
    num_validation_problems: int = field(default=100, metadata={"help": "Held-out validation problems."})
    num_test_problems: int = field(default=200, metadata={"help": "Held-out test problems (reported)."})
    num_documents: int = field(default=40000, metadata={"help": "Pre-training documents."})
    task_fraction: float = field(default=0.3, metadata={"help": "Share of task documents, in [0, 1]."})
    answer_format: str = field(default="worked", metadata={
        "help": "Task documents answer 'a op b = r' (worked) or 'r' (number).", "choices": ["worked", "number"]})
    num_general_eval: int = field(default=200, metadata={"help": "Held-out general-text documents."})
    min_sentences: int = field(default=2, metadata={"help": "Fewest sentences of a general document."})
    max_sentences: int = field(default=3, metadata={"help": "Most sentences of a general document."})
    # tokenizer and model
    tokenizer: str = field(default="corpus", metadata={
        "help": "'corpus': a BPE trained on the corpus; else a tokenizer name or path (e.g. the embedded alias)."})
    vocab_size: int = field(default=1024, metadata={"help": "Vocabulary of the corpus tokenizer."})
    hidden_size: int = field(default=128, metadata={"help": "Model width."})
    intermediate_size: int = field(default=384, metadata={"help": "MLP width."})
    num_hidden_layers: int = field(default=4, metadata={"help": "Layers."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads (and key/value heads)."})
    # training
    max_steps: int = field(default=3000, metadata={"help": "Optimizer steps."})
    save_steps: int = field(default=250, metadata={"help": "Steps between checkpoints."})
    per_device_train_batch_size: int = field(default=32, metadata={"help": "Documents per step."})
    learning_rate: float = field(default=3e-3, metadata={"help": "Peak learning rate."})
    warmup_steps: int | None = field(default=None, metadata={"help": "Warm-up steps (default 5% of max_steps)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay."})
    # evaluation
    num_seen_problems: int = field(default=100, metadata={"help": "Pre-training-pool problems scored (0: none)."})
    eval_max_new_tokens: int = field(default=12, metadata={"help": "New tokens per greedy completion."})
    eval_batch_size: int = field(default=100, metadata={"help": "Prompts per greedy generate call."})
    num_threads: int | None = field(default=1, metadata={
        "help": "torch intra-op threads (1: fastest for a tiny model on a shared CPU; none: torch's default)."})


def parse_args(argv: list[str] | None = None) -> PretrainArguments:
    """Parse ``argv`` (default: ``sys.argv[1:]``), with ``--config file.yaml`` support."""
    return parse_arguments(PretrainArguments, argv)


def load_tokenizer(args: PretrainArguments, texts):
    """The tokenizer of the run: a BPE trained on ``texts`` (``--tokenizer corpus``) or a loaded one."""
    if args.tokenizer == "corpus":
        from _study.pretraining import train_corpus_tokenizer

        return train_corpus_tokenizer(texts, vocab_size=args.vocab_size)
    from transformers import AutoTokenizer

    from trl_es.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer))


def score_checkpoint(path: str, rows: dict, args: PretrainArguments) -> dict:
    """Greedy accuracy of the checkpoint at ``path`` on each list of problem rows in ``rows``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_es.analysis import greedy_accuracy
    from trl_es.tasks.arithmetic import arithmetic_reward

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return {f"{name}_accuracy": greedy_accuracy(model, tokenizer, split, [arithmetic_reward], args.eval_max_new_tokens,
                                                batch_size=args.eval_batch_size, progress=False)
            for name, split in rows.items() if split}


def main(argv: list[str] | None = None) -> dict:
    """Generate the corpus, pre-train, score every checkpoint and write ``pretraining.json``."""
    from _study.pretraining import pretrain_from_scratch
    from _study.pretraining_corpus import make_pretraining_corpus, pretraining_arithmetic_splits

    args = parse_args(argv)
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    start = time.perf_counter()
    os.makedirs(args.output_dir, exist_ok=True)
    split_kwargs = dict(num_validation=args.num_validation_problems, num_test=args.num_test_problems,
                        seed=args.task_seed, low=args.low, high=args.high, ops=tuple(args.ops))
    splits = pretraining_arithmetic_splits(**split_kwargs)
    corpus_kwargs = dict(num_documents=args.num_documents, task_fraction=args.task_fraction,
                         num_general_eval=args.num_general_eval, seed=args.seed, low=args.low, high=args.high,
                         ops=tuple(args.ops), min_sentences=args.min_sentences, max_sentences=args.max_sentences,
                         answer_format=args.answer_format)
    corpus = make_pretraining_corpus(**corpus_kwargs, exclude_problems=[splits["validation"], splits["test"]])
    general_eval_file = os.path.join(args.output_dir, "general_eval.json")
    write_json(general_eval_file, list(corpus["general_eval"]["text"]))
    tokenizer = load_tokenizer(args, corpus["train"]["text"])
    print(f"[pretrain_from_scratch] corpus: {len(corpus['train'])} documents "
          f"({sum(k == 'task' for k in corpus['train']['kind'])} task, {len(corpus['task_problems'])} distinct "
          f"problems), tokenizer of {len(tokenizer)} tokens", flush=True)
    model_config = dict(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                        num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
                        num_key_value_heads=args.num_attention_heads)
    run = pretrain_from_scratch(args.output_dir, corpus, tokenizer, max_steps=args.max_steps,
                                save_steps=args.save_steps, seed=args.seed, model_config=model_config,
                                per_device_train_batch_size=args.per_device_train_batch_size,
                                learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
                                lr_scheduler_type=args.lr_scheduler_type, weight_decay=args.weight_decay)
    rows = {"test": list(splits["test"]), "seen": list(splits["train"])[: args.num_seen_problems]}
    checkpoints = []
    for checkpoint in run["checkpoints"]:
        scores = score_checkpoint(checkpoint["path"], rows, args)
        checkpoints.append({**checkpoint, **scores})
        print(f"[pretrain_from_scratch] step {checkpoint['step']}: train loss {checkpoint['train_loss']:.3f}, "
              f"general-eval loss {checkpoint['general_eval_loss']:.3f}, "
              + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()), flush=True)
    corpus_kinds = corpus["train"]["kind"]
    result = {
        "args": dataclasses.asdict(args),
        "arithmetic_splits": {"function": "_study.pretraining_corpus.pretraining_arithmetic_splits",
                              "kwargs": {**split_kwargs, "ops": list(args.ops)},
                              "held_out_of_pretraining": ["validation", "test"]},
        "corpus": {"function": "_study.pretraining_corpus.make_pretraining_corpus",
                   "kwargs": {**corpus_kwargs, "ops": list(args.ops)},
                   "exclude_problems": "the validation and test splits of arithmetic_splits",
                   "num_documents": len(corpus_kinds), "num_task_documents": sum(k == "task" for k in corpus_kinds),
                   "num_distinct_task_problems": len(corpus["task_problems"]),
                   "num_general_eval": len(corpus["general_eval"]),
                   "general_eval_file": general_eval_file},
        "tokenizer_size": len(tokenizer),
        "num_parameters": run["num_parameters"],
        "model_config": run["model_config"],
        "initial_general_eval_loss": run["initial_general_eval_loss"],
        "train_runtime_s": run["train_runtime_s"],
        "total_runtime_s": time.perf_counter() - start,
        "checkpoints": checkpoints,
    }
    write_json(os.path.join(args.output_dir, "pretraining.json"), result)
    print(f"[pretrain_from_scratch] wrote {os.path.join(args.output_dir, 'pretraining.json')} "
          f"({result['total_runtime_s'] / 60:.1f} min)", flush=True)
    return result


if __name__ == "__main__":
    main()
