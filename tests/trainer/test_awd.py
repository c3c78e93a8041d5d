"""Anchored Weight Decay (arXiv 2605.30148) as an ESTrainer option."""

import os

import pytest
import torch
from test_es_trainer import assert_bitwise, es_args, mean_code, prompts, snapshot
from tiny import build_llama, build_qwen2

from trl_es import ESTrainer, replay


def drift(trainer, base):
    state = snapshot(trainer.model)
    return sum(float((state[k].float() - v.float()).pow(2).sum()) for k, v in base.items()) ** 0.5


def test_awd_run_ends_closer_to_anchor(tmp_path, tokenizer):
    base = snapshot(build_llama(tokenizer))
    kwargs = dict(max_steps=3, sigma=0.05, learning_rate=0.05)
    plain = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / "plain", **kwargs),
                      train_dataset=prompts(), processing_class=tokenizer)
    plain.train()
    awd = ESTrainer(build_llama(tokenizer), mean_code,
                    args=es_args(tmp_path / "awd", awd_lambda=10.0, **kwargs),
                    train_dataset=prompts(), processing_class=tokenizer)
    awd.train()
    assert 0 < drift(awd, base) < drift(plain, base)
    assert all(r["awd_shrink"] == pytest.approx(0.5) for r in awd.seed_log.records)


@pytest.mark.parametrize("penalty, lam", [("l2", 5.0), ("l1", 0.01)])
def test_awd_replay_is_bitwise(tmp_path, tokenizer, penalty, lam):
    args = es_args(tmp_path, max_steps=3, sigma=0.05, learning_rate=0.05, awd_lambda=lam, awd_penalty=penalty)
    trainer = ESTrainer(build_llama(tokenizer, dtype=torch.bfloat16), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    trainer.train()
    rebuilt = replay(build_llama(tokenizer, dtype=torch.bfloat16), args.output_dir)
    assert_bitwise(snapshot(rebuilt), snapshot(trainer.model))


def test_awd_l1_is_sparse_drift(tmp_path, tokenizer):
    base = snapshot(build_llama(tokenizer))
    # A threshold far above the per-step update: every coordinate is pulled back to theta_0 exactly.
    args = es_args(tmp_path, max_steps=2, sigma=0.02, learning_rate=0.01, awd_lambda=50.0, awd_penalty="l1")
    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    trainer.train()
    assert_bitwise(snapshot(trainer.model), base)


def test_awd_resume_decays_toward_the_same_anchor(tmp_path, tokenizer):
    kwargs = dict(max_steps=4, sigma=0.05, learning_rate=0.05, awd_lambda=4.0)
    full = ESTrainer(build_llama(tokenizer), mean_code, args=es_args(tmp_path / "full", **kwargs),
                     train_dataset=prompts(), processing_class=tokenizer)
    full.train()
    args = es_args(tmp_path / "resumed", save_strategy="steps", save_steps=2, **kwargs)
    ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(), processing_class=tokenizer).train()
    checkpoint = os.path.join(args.output_dir, "checkpoint-2")
    assert os.path.exists(os.path.join(checkpoint, "es_anchor.safetensors"))
    # Resume into a model whose *initial* weights differ: the anchor must come from the checkpoint.
    resumed = ESTrainer(build_llama(tokenizer, seed=123), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert_bitwise(snapshot(resumed.model), snapshot(full.model))


def test_awd_with_torch_optimizer_and_peft(tmp_path, tokenizer):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    kwargs = dict(max_steps=3, sigma=0.05, es_optimizer="torch", optim="sgd", learning_rate=0.05)
    plain = ESTrainer(build_qwen2(tokenizer), mean_code, args=es_args(tmp_path / "plain", **kwargs),
                      train_dataset=prompts(), processing_class=tokenizer, peft_config=peft_config)
    anchor = {k: v.cpu().clone() for k, v in plain.anchor.items()}
    plain.train()
    awd = ESTrainer(build_qwen2(tokenizer), mean_code, args=es_args(tmp_path / "awd", awd_lambda=8.0, **kwargs),
                    train_dataset=prompts(), processing_class=tokenizer, peft_config=peft_config)
    assert all(torch.equal(awd.anchor[k].cpu(), v) for k, v in anchor.items())  # anchor = the initial adapter
    awd.train()

    def adapter_drift(trainer):
        state = snapshot(trainer.model)
        return sum(float((state[k] - v).pow(2).sum()) for k, v in anchor.items()) ** 0.5

    assert 0 < adapter_drift(awd) < adapter_drift(plain)
