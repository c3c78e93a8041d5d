"""Pre-train a tiny causal LM from scratch, keeping intermediate checkpoints (RL Excursions, arXiv 2606.04272).

The pre-training study of "RL Excursions during Pre-Training" applies RL / SFT to intermediate checkpoints of one
pre-training run. :func:`pretrain_from_scratch` makes such a run on a CPU: a randomly initialised tiny Llama
(:func:`build_tiny_llama`, the tokenizer's vocabulary, tied embeddings) trained with transformers' ``Trainer`` on the
causal-LM objective (``DataCollatorForLanguageModeling(mlm=False)``), one document per sequence, on a corpus of
:func:`_study.pretraining_corpus.make_pretraining_corpus`. ``save_steps`` gives the checkpoints
``output_dir/checkpoint-<step>/`` (model, generation config and tokenizer; ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` load them). The mean token cross-entropy of held-out general text
(:func:`trl_es.analysis.lm_loss_fn`) is measured for the initial model and for every checkpoint.

Tokenization: each document is tokenized **without** special tokens (as the rollout code tokenizes plain-text prompts)
and the tokenizer's EOS token is appended, so that a pre-trained model ends its answers. The collator masks padding in
the labels by the pad id; when the tokenizer pads with its EOS token (SmolLM2 does), the copy used here (and saved
with the checkpoints) pads with another token (its unknown token ``<|endoftext|>`` for SmolLM2, else a new ``<pad>``)
so that EOS stays a training target.
"""

from __future__ import annotations

import copy
import math
import os
import time

import torch

__all__ = [
    "CHATML_TEMPLATE",
    "TINY_LLAMA_DEFAULTS",
    "build_tiny_llama",
    "checkpoint_steps",
    "pretrain_from_scratch",
    "pretraining_tokenizer",
    "train_corpus_tokenizer",
]

#: The chat template of :func:`train_corpus_tokenizer` (ChatML, as SmolLM2's without its default system message).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Sizes of :func:`build_tiny_llama` unless overridden (about 6.3 M embedding + 0.8 M block parameters with SmolLM2's
#: 49,152-token vocabulary).
TINY_LLAMA_DEFAULTS = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=4, max_position_embeddings=512)


def train_corpus_tokenizer(texts, vocab_size: int = 1024):
    """A small byte-level BPE tokenizer trained on ``texts``, with SmolLM2's special tokens and digit handling.

    The output layer of a model over SmolLM2's 49,152-token vocabulary costs about 8 times the compute of the
    transformer blocks of :func:`build_tiny_llama` (measured on the shared 2-core CPU, 32 documents a step: about
    3.5 s a step with SmolLM2's vocabulary, 0.15 s with 1,024 tokens); a synthetic corpus of a few hundred words needs
    far fewer tokens. This tokenizer tokenizes like SmolLM2's: byte-level BPE
    (``add_prefix_space=False``), every digit its own token (``" 13"`` is ``"Ġ", "1", "3"``), no special token added
    by ``tokenizer(text)``; special tokens ``<|endoftext|>`` (ids 0, unknown and pad), ``<|im_start|>`` (1, BOS),
    ``<|im_end|>`` (2, EOS) and a ChatML chat template (:data:`CHATML_TEMPLATE`). Any text encodes (the 256 byte
    symbols are in the vocabulary) and decodes back unchanged. Training is deterministic for the same texts (about
    1 s for 20,000 documents).

    Args:
        texts (`Iterable[str]`): Training texts, e.g. ``corpus["train"]["text"]``.
        vocab_size (`int`, defaults to 1024): Vocabulary size including the special tokens and the 256 byte symbols,
            ``>= 259`` (fewer tokens if the texts do not need that many merges).

    Returns:
        `PreTrainedTokenizerFast`: ``pad_token`` ``<|endoftext|>``, ``eos_token`` ``<|im_end|>``, ``bos_token``
        ``<|im_start|>``.

    Raises:
        ValueError: If ``vocab_size`` is not an integer ``>= 259`` (the message names the field).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < len(specials) + len(alphabet):
        raise ValueError(f"vocab_size must be an integer >= {len(specials) + len(alphabet)}, got {vocab_size!r}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def pretraining_tokenizer(tokenizer):
    """A copy of ``tokenizer`` whose pad token differs from its EOS token (the input is not modified).

    ``DataCollatorForLanguageModeling`` masks every pad id in the labels; with ``pad == eos`` the model would never
    learn to end a document. A tokenizer with a distinct pad token is returned as a plain copy; otherwise the copy
    pads with its unknown token if that differs from EOS (``<|endoftext|>`` for SmolLM2), else with a new special
    token ``<pad>`` (the vocabulary grows by one; :func:`build_tiny_llama` sizes the model with ``len(tokenizer)``).

    Args:
        tokenizer (`PreTrainedTokenizerBase`): The tokenizer, with an EOS token.

    Returns:
        `PreTrainedTokenizerBase`: The copy.

    Raises:
        ValueError: If ``tokenizer`` has no EOS token.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer must have an eos_token: documents end with it")
    tokenizer = copy.deepcopy(tokenizer)
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        if tokenizer.unk_token is not None and tokenizer.unk_token_id not in (None, tokenizer.eos_token_id):
            tokenizer.pad_token = tokenizer.unk_token
        else:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
    return tokenizer


def build_tiny_llama(tokenizer, seed: int = 0, **config_kwargs):
    """A randomly initialised tiny ``LlamaForCausalLM`` over the tokenizer's vocabulary, tied embeddings.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): Gives ``vocab_size = len(tokenizer)`` and the bos / eos / pad ids of the
            config and the generation config.
        seed (`int`, defaults to 0): ``torch.manual_seed`` of the initialisation (the global RNG is restored after).
        **config_kwargs (`Any`): ``LlamaConfig`` fields over :data:`TINY_LLAMA_DEFAULTS` (``hidden_size=128``,
            ``intermediate_size=384``, 4 layers, 4 heads, ``max_position_embeddings=512``) and
            ``tie_word_embeddings=True``.

    Returns:
        `LlamaForCausalLM`: In float32, train mode.

    Raises:
        ValueError: If ``config_kwargs`` sets ``vocab_size`` below ``len(tokenizer)`` (the message names the field).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = {**TINY_LLAMA_DEFAULTS, "tie_word_embeddings": True, "vocab_size": len(tokenizer),
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id, **config_kwargs}
    if kwargs["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size must be >= len(tokenizer) = {len(tokenizer)}, got {kwargs['vocab_size']}")
    config = LlamaConfig(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def checkpoint_steps(max_steps: int, save_steps: int) -> list[int]:
    """The steps at which :func:`pretrain_from_scratch` writes a checkpoint: every ``save_steps``, and ``max_steps``.

    Args:
        max_steps (`int`): Optimizer steps, ``>= 1``.
        save_steps (`int`): Steps between checkpoints, ``>= 1``.

    Returns:
        `list[int]`: Increasing; ``[save_steps, 2 * save_steps, ..., max_steps]``.
    """
    return sorted(set(range(save_steps, max_steps + 1, save_steps)) | {max_steps})


def _tokenize(dataset, tokenizer, max_length: int):
    eos = tokenizer.eos_token_id

    def encode(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [(list(x) + [eos])[:max_length] for x in ids]}

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names)


def _last_logged(history: list[dict], key: str, step: int) -> float | None:
    """The last ``key`` logged at or before ``step`` (``None`` if none)."""
    value = None
    for entry in history:
        if key in entry and entry.get("step", 0) <= step:
            value = float(entry[key])
    return value


def pretrain_from_scratch(
    output_dir: str | os.PathLike,
    corpus,
    tokenizer,
    max_steps: int,
    save_steps: int,
    seed: int = 0,
    model_config: dict | None = None,
    per_device_train_batch_size: int = 32,
    learning_rate: float = 3e-3,
    warmup_steps: int | None = None,
    lr_scheduler_type: str = "cosine",
    weight_decay: float = 0.1,
    max_length: int = 128,
    logging_steps: int | None = None,
    eval_batch_size: int = 64,
    progress: bool = True,
    training_args: dict | None = None,
) -> dict:
    """Pre-train a tiny Llama from random initialisation and keep checkpoints every ``save_steps`` (arXiv 2606.04272).

    The model is :func:`build_tiny_llama` (``model_config`` over its defaults) over :func:`pretraining_tokenizer`
    (``tokenizer`` with a pad token distinct from EOS). transformers' ``Trainer`` trains it for ``max_steps`` AdamW
    steps of ``per_device_train_batch_size`` documents (one document per sequence, EOS appended, dynamic padding,
    ``DataCollatorForLanguageModeling(mlm=False)``: the loss is the mean next-token cross-entropy over the non-pad
    tokens of a batch), evaluates on ``corpus["general_eval"]`` and saves a checkpoint (model + tokenizer, no optimizer
    state) every ``save_steps`` and at ``max_steps``. The train loss and Trainer's eval loss are logged (tqdm bar and
    ``trainer_state.json`` of each checkpoint). After training each checkpoint is loaded back from disk with
    ``AutoModelForCausalLM.from_pretrained`` and its general-eval loss measured with
    :func:`trl_es.analysis.lm_loss_fn` (mean token cross-entropy in nats of the ``general_eval`` texts, without the
    EOS token), as is the initial model's.

    Speed: on a shared 2-core CPU one intra-op thread (``torch.set_num_threads(1)``, the example script's default) was
    several times faster for this tiny model than torch's default of two. The function leaves the thread count alone.

    Args:
        output_dir (`str | os.PathLike`): Where ``checkpoint-<step>/`` folders go (created; existing checkpoints of
            the same steps are overwritten).
        corpus (`datasets.DatasetDict | dict`): With ``"train"`` and ``"general_eval"`` splits holding a ``text``
            column (:func:`~_study.pretraining_corpus.make_pretraining_corpus`); ``general_eval`` non-empty.
        tokenizer (`PreTrainedTokenizerBase`): The tokenizer (with an EOS token); e.g. the embedded SmolLM2's,
            ``AutoTokenizer.from_pretrained(resolve_model_path("embedded:SmolLM2-135M-Instruct"))``.
        max_steps (`int`): Optimizer steps, ``>= 1``.
        save_steps (`int`): Steps between checkpoints, ``>= 1`` (see :func:`checkpoint_steps`).
        seed (`int`, defaults to 0): Seed of the initialisation and of the Trainer (data order, ``data_seed``).
        model_config (`dict`, *optional*): ``LlamaConfig`` fields over :data:`TINY_LLAMA_DEFAULTS`.
        per_device_train_batch_size (`int`, defaults to 32): Documents per step.
        learning_rate (`float`, defaults to 3e-3): Peak AdamW learning rate.
        warmup_steps (`int`, *optional*): Linear warm-up steps; ``None``: 5 % of ``max_steps`` (at least 1).
        lr_scheduler_type (`str`, defaults to ``"cosine"``): transformers' scheduler name.
        weight_decay (`float`, defaults to 0.1): AdamW weight decay.
        max_length (`int`, defaults to 128): Tokens per document (EOS included), longer documents are cut.
        logging_steps (`int`, *optional*): Steps between train-loss logs; ``None``: ``max(1, save_steps // 5)``.
        eval_batch_size (`int`, defaults to 64): Documents per forward pass in evaluations.
        progress (`bool`, defaults to True): Show the Trainer's tqdm bar and print the checkpoint losses.
        training_args (`dict`, *optional*): More ``TrainingArguments`` fields, applied last.

    Returns:
        `dict`: ``checkpoints``: one dict per checkpoint, by step, with ``step`` (`int`), ``path`` (`str`),
        ``train_loss`` (the last logged mean train loss at or before the step, nats per token), ``eval_loss`` (the
        Trainer's loss on ``general_eval`` at the step, EOS included) and ``general_eval_loss`` (``lm_loss_fn``, nats
        per token); ``initial_general_eval_loss`` (the random model's, nats per token); ``train_runtime_s``
        (seconds of ``Trainer.train``); ``num_parameters`` (`int`, tied weights once); ``model_config`` (`dict`);
        ``log_history`` (Trainer's).

    Raises:
        ValueError: If a field is out of range (``max_steps``, ``save_steps``, ``per_device_train_batch_size``,
            ``max_length`` < 2, ``eval_batch_size``, ``logging_steps``, ``learning_rate`` <= 0), ``corpus`` lacks a
            split or its ``text`` column, ``general_eval`` is empty, or the tokenizer has no EOS token (the message
            names the field).
    """
    from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from trl_es.analysis import lm_loss_fn
    from trl_es.arguments import check_int

    check_int("max_steps", max_steps, 1)
    check_int("save_steps", save_steps, 1)
    check_int("per_device_train_batch_size", per_device_train_batch_size, 1)
    check_int("eval_batch_size", eval_batch_size, 1)
    check_int("max_length", max_length, 2)
    if logging_steps is None:
        logging_steps = max(1, save_steps // 5)
    check_int("logging_steps", logging_steps, 1)
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not (
        math.isfinite(learning_rate) and learning_rate > 0
    ):
        raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate!r}")
    if warmup_steps is None:
        warmup_steps = max(1, round(0.05 * max_steps))
    for split in ("train", "general_eval"):
        if split not in corpus:
            raise ValueError(f"corpus has no {split!r} split (found {sorted(corpus)})")
        if "text" not in corpus[split].column_names:
            raise ValueError(f"corpus[{split!r}] has no 'text' column (found {corpus[split].column_names})")
    if len(corpus["general_eval"]) == 0 or len(corpus["train"]) == 0:
        raise ValueError("corpus['train'] and corpus['general_eval'] must not be empty")

    tokenizer = pretraining_tokenizer(tokenizer)
    model = build_tiny_llama(tokenizer, seed=seed, **(model_config or {}))
    eval_texts = list(corpus["general_eval"]["text"])
    general_loss = lm_loss_fn(tokenizer, eval_texts, batch_size=eval_batch_size, max_length=max_length)
    initial_loss = general_loss(model)
    model.train()

    train = _tokenize(corpus["train"], tokenizer, max_length)
    evaluation = _tokenize(corpus["general_eval"], tokenizer, max_length)
    output_dir = os.fspath(output_dir)
    args = TrainingArguments(**{
        "output_dir": output_dir,
        "max_steps": max_steps,
        "per_device_train_batch_size": per_device_train_batch_size,
        "per_device_eval_batch_size": eval_batch_size,
        "learning_rate": learning_rate,
        "warmup_steps": warmup_steps,
        "lr_scheduler_type": lr_scheduler_type,
        "weight_decay": weight_decay,
        "adam_beta2": 0.98,
        "max_grad_norm": 1.0,
        "logging_steps": logging_steps,
        "eval_strategy": "steps",
        "eval_steps": save_steps,
        "save_strategy": "steps",
        "save_steps": save_steps,
        "save_only_model": True,
        "prediction_loss_only": True,
        "seed": seed,
        "data_seed": seed,
        "report_to": "none",
        "disable_tqdm": not progress,
        "use_cpu": not torch.cuda.is_available(),
        "dataloader_num_workers": 0,
        **(training_args or {}),
    })
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
    )
    start = time.perf_counter()
    trainer.train()
    runtime = time.perf_counter() - start
    history = list(trainer.state.log_history)

    checkpoints = []
    for step in checkpoint_steps(max_steps, save_steps):
        path = os.path.join(output_dir, f"checkpoint-{step}")
        if not os.path.isdir(path):
            raise RuntimeError(f"Trainer wrote no checkpoint at step {step}: {path} is missing")
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        loss = general_loss(loaded)
        eval_loss = next((float(e["eval_loss"]) for e in history if "eval_loss" in e and e.get("step") == step), None)
        checkpoints.append({"step": step, "path": path, "train_loss": _last_logged(history, "loss", step),
                            "eval_loss": eval_loss, "general_eval_loss": loss})
        if progress:
            train_loss = checkpoints[-1]["train_loss"]
            print(f"[pretrain] checkpoint-{step}: train loss "
                  f"{'n/a' if train_loss is None else f'{train_loss:.4f}'}, general-eval loss {loss:.4f} nats/token",
                  flush=True)
        del loaded
    num_parameters = sum(p.numel() for p in model.parameters())
    return {
        "checkpoints": checkpoints,
        "initial_general_eval_loss": initial_loss,
        "train_runtime_s": runtime,
        "num_parameters": num_parameters,
        "model_config": model.config.to_dict(),
        "log_history": history,
    }
