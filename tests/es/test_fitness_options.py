"""Fitness that sees the sampling distribution (issue 22): per-prompt shaping of the members x prompts fitness
matrix, sampled rollouts reproducible from the seed, batched low-rank rows == materialized members when sampling."""

import json
import math
import os

import pytest
import torch
from datasets import Dataset
from oracles import LINEARS, materialized, members3
from tiny import build_llama

from trl_es import ESConfig, ESTrainer, replay
from trl_es.es import SEED_LOG_NAME
from trl_es.es.fitness import MemberScores, PopulationScores, shape_fitness
from trl_es.es.noise import NoiseTable
from trl_es.es.perturbation import Member, TrainedParameters, select_parameters
from trl_es.es.strategy import BatchedLowRankPopulation
from trl_es.rollout import RolloutResult, build_generation_config, generate_completions

NAN = math.nan
SMALL_TABLE = 1 << 20


def rollout(rewards):
    """A scored rollout as score_model returns it: one reward function, the given weighted rewards (NaN = None), one
    token per completion."""
    r, n = torch.tensor(rewards, dtype=torch.float32), len(rewards)
    return RolloutResult(r[:, None], torch.zeros(n, 1, dtype=torch.bool), r.double(), ["x"] * n, [[1]] * n, ["p"] * n,
                         ["x"] * n, [1] * n, [1] * n, [True] * n)


# ------------------------------------------------------------------------------------------- arithmetic
# 4 members x 3 prompts x 2 samples. Prompt 0: every member solves both samples (no signal); prompt 1 separates
# members 0/1 from 2/3; prompt 2 has a larger reward scale.
REWARDS = [
    [1, 1, 1, 0, 4, 4],   # member 0: prompt means 1, 0.5, 4
    [1, 1, 1, 1, 0, 0],   # member 1: 1, 1, 0
    [1, 1, 0, 0, 2, 2],   # member 2: 1, 0, 2
    [1, 1, 0, 0, 0, 1],   # member 3: 1, 0, 0.5
]
MATRIX = torch.tensor([[1, 0.5, 4], [1, 1, 0], [1, 0, 2], [1, 0, 0.5]], dtype=torch.float64)


def table(rewards=REWARDS, num_generations=2):
    members = {i: MemberScores.from_rollout(rollout(r), 1.0, num_generations=num_generations)
               for i, r in enumerate(rewards)}
    return PopulationScores.collect(members, len(rewards), 1, num_prompts=len(rewards[0]) // num_generations)


def test_member_scores_keep_one_sum_and_count_per_prompt():
    member = MemberScores.from_rollout(rollout([1, NAN, 0.5, 0.25, NAN, NAN]), 1.0, num_generations=2)
    assert member.prompt_reward_sum == [1.0, 0.75, 0.0]
    assert member.prompt_reward_count == [1, 2, 0]
    assert member.reward_sum == 1.75 and member.reward_count == 3
    assert MemberScores.from_rollout(rollout([1, 0]), 1.0).prompt_reward_sum is None  # not kept by default
    with pytest.raises(ValueError, match="num_generations=4"):
        MemberScores.from_rollout(rollout([1, 0, 1]), 1.0, num_generations=4)


def test_fitness_matrix_and_each_per_prompt_shaping():
    scores = table()
    assert torch.equal(scores.fitness_matrix(), MATRIX)
    assert torch.equal(scores.per_prompt_fitness("none"), MATRIX.mean(dim=1))
    center = MATRIX - MATRIX.mean(dim=0)
    torch.testing.assert_close(scores.per_prompt_fitness("center"), center.mean(dim=1), rtol=0, atol=1e-15)
    # zscore per prompt: column 0 is all ties -> 0; columns 1 and 2: (x - mean) / std (ddof 0)
    col1 = torch.tensor([0.5, 1, 0, 0], dtype=torch.float64)
    col2 = torch.tensor([4, 0, 2, 0.5], dtype=torch.float64)
    z1 = (col1 - col1.mean()) / col1.std(unbiased=False)
    z2 = (col2 - col2.mean()) / col2.std(unbiased=False)
    torch.testing.assert_close(scores.per_prompt_fitness("zscore"), (0 + z1 + z2) / 3, rtol=0, atol=1e-12)
    # centered ranks per prompt, ties averaged: col1 ranks (2, 3, 0.5, 0.5) / 3 - 0.5; col2 ranks (3, 0, 2, 1) / 3 - 0.5
    r1 = torch.tensor([2, 3, 0.5, 0.5], dtype=torch.float64) / 3 - 0.5
    r2 = torch.tensor([3, 0, 2, 1], dtype=torch.float64) / 3 - 0.5
    torch.testing.assert_close(scores.per_prompt_fitness("centered_rank"), (0 + r1 + r2) / 3, rtol=0, atol=1e-15)
    # the per-prompt zscore ranks the members differently from the plain mean: member 1 (best on the prompt that
    # separates, worst on the high-scale one) overtakes member 2
    assert torch.argsort(scores.per_prompt_fitness("none")).tolist() == [3, 1, 2, 0]
    assert torch.argsort(scores.per_prompt_fitness("zscore")).tolist() == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="per_prompt_shaping must be one of"):
        scores.per_prompt_fitness("mean")


def test_center_equals_none_after_shaping_when_every_member_has_every_prompt():
    scores = table()
    for shaping in ("zscore", "centered_rank"):
        torch.testing.assert_close(shape_fitness(scores.per_prompt_fitness("center"), shaping),
                                   shape_fitness(scores.per_prompt_fitness("none"), shaping), rtol=0, atol=1e-12)


def test_missing_prompts_and_invalid_members():
    rewards = [row[:] for row in REWARDS]
    rewards[1][2:4] = [NAN, NAN]  # member 1 has no reward on prompt 1 (all None)
    members = {i: MemberScores.from_rollout(rollout(r), 1.0, num_generations=2) for i, r in enumerate(rewards)}
    members[3].invalid = 1  # member 3 returned a non-finite reward: no fitness
    scores = PopulationScores.collect(members, 4, 1, num_prompts=3)
    matrix = scores.fitness_matrix()
    assert math.isnan(matrix[1, 1]) and torch.isnan(matrix[3]).all()
    center = scores.per_prompt_fitness("center")
    # prompt 1 over members 0 and 2 only (mean 0.25); prompt 2 over members 0, 1, 2 (mean 2)
    torch.testing.assert_close(center[:3], torch.tensor([(0 + 0.25 + 2) / 3, (0 - 2) / 2, (0 - 0.25 + 0) / 3],
                                                        dtype=torch.float64), rtol=0, atol=1e-15)
    assert math.isnan(center[3])
    assert shape_fitness(center, "zscore")[3] < shape_fitness(center, "zscore")[:3].min()  # invalid ranked worst
    with pytest.raises(ValueError, match="no per-prompt sums"):
        PopulationScores.collect(members, 4, 1).fitness_matrix()


def test_sharded_processes_fill_their_own_prompt_columns_and_sum_to_the_whole_table():
    """ZeRO-3: every process scores every member on its own prompts; the all-reduce sums the columns together."""
    whole = table()
    parts = []
    for rank, columns in ((0, slice(0, 4)), (1, slice(4, 6))):  # process 0: prompts 0-1, process 1: prompt 2
        members = {i: MemberScores.from_rollout(rollout(r[columns]), 1.0, num_generations=2)
                   for i, r in enumerate(REWARDS)}
        parts.append(PopulationScores.collect(members, 4, 1, num_prompts=3, prompt_offset=2 * rank))
    summed = PopulationScores.from_tensor(parts[0].to_tensor() + parts[1].to_tensor(), 1, num_prompts=3)
    assert torch.equal(summed.fitness_matrix(), whole.fitness_matrix())
    assert torch.equal(summed.per_prompt_fitness("zscore"), whole.per_prompt_fitness("zscore"))
    assert parts[0].nbytes() == 4 * (6 + 2 + 2 * 3) * 8  # 6 scalars + 2 per function + 2 per prompt, per member
    assert PopulationScores.collect({}, 4, 1).nbytes() == 4 * (6 + 2) * 8  # nothing per prompt by default
    with pytest.raises(ValueError, match="do not fit"):
        PopulationScores.collect({0: MemberScores.from_rollout(rollout([1, 0]), 1.0, num_generations=1)}, 4, 1,
                                 num_prompts=3, prompt_offset=2)


# ------------------------------------------------------------------------------------------- trainer
def es_args(tmp_path, **kwargs):
    defaults = {
        "output_dir": str(tmp_path / "out"), "max_steps": 2, "population_size": 4, "prompt_batch_size": 3,
        "max_completion_length": 5, "sigma": 0.05, "learning_rate": 0.02, "report_to": [], "save_strategy": "no",
        "noise_table_size": SMALL_TABLE, "disable_tqdm": True, "seed": 0, "include_parameters": LINEARS,
        "temperature": 1.0, "top_p": 0.95, "num_generations": 2, "per_prompt_shaping": "zscore",
    }
    defaults.update(kwargs)
    return ESConfig(**defaults)


def prompts(n=6):
    return Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(n)]})


def share_a(prompts, completions, **kwargs):
    """Depends on the prompt too (its last digit), so completions grouped under the wrong prompt score differently."""
    return [c.count("a") / max(1, len(c)) + 0.01 * len(c) + 0.1 * int(p[-1]) for p, c in zip(prompts, completions)]


def snapshot(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def test_config_rejects_unknown_per_prompt_shaping(tmp_path):
    with pytest.raises(ValueError, match="per_prompt_shaping must be one of .*'none', 'center', 'zscore'"):
        ESConfig(output_dir=str(tmp_path), per_prompt_shaping="rank")


@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_trainer_coefficients_are_the_per_prompt_zscore_of_the_sampled_rewards(tmp_path, tokenizer, backend):
    """The seed log's coefficients are recomputed here from the members' sampled rewards, per prompt by hand."""
    args = es_args(tmp_path, population_backend=backend, max_steps=1, fitness_shaping="centered_rank")
    trainer = ESTrainer(build_llama(tokenizer), share_a, args=args, train_dataset=prompts(), processing_class=tokenizer)
    seen = []
    score_members = trainer._score_members
    trainer._score_members = lambda members, rows, step: seen.append((rows, score_members(members, rows, step))) \
        or seen[-1][1]
    trainer.train()
    ((rows, scores),) = seen
    prompts_of_texts = [row["prompt"] for row in rows for _ in range(2)]  # prompt-major, num_generations each
    assert len(set(prompts_of_texts)) == 3
    by_hand = []
    for i in range(4):
        texts = scores[i].texts
        assert len(texts) == 3 * 2  # 3 prompts x num_generations
        rewards = share_a(prompts_of_texts, texts)
        by_hand.append([(rewards[2 * p] + rewards[2 * p + 1]) / 2 for p in range(3)])
    matrix = torch.tensor(by_hand, dtype=torch.float64)
    assert torch.unique(matrix, dim=0).shape[0] > 1  # the members really differ
    z = torch.stack([shape_fitness(matrix[:, p], "zscore") for p in range(3)], dim=1).mean(dim=1)
    expected = shape_fitness(z, "centered_rank").tolist()
    with open(os.path.join(args.output_dir, SEED_LOG_NAME)) as f:
        steps = [json.loads(line) for line in f][1:]
    torch.testing.assert_close(torch.tensor(steps[0]["coefficients"]), torch.tensor(expected), rtol=0, atol=1e-12)
    trainer.population.close()


@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_sampled_fitness_run_is_reproducible_from_the_seed_and_replays(tmp_path, tokenizer, backend):
    def run(seed, name):
        model = build_llama(tokenizer)
        args = es_args(tmp_path / name, population_backend=backend, seed=seed)
        trainer = ESTrainer(model, share_a, args=args, train_dataset=prompts(), processing_class=tokenizer)
        trainer.train()
        trainer.population.close()
        with open(os.path.join(args.output_dir, SEED_LOG_NAME)) as f:
            log = [json.loads(line) for line in f][1:]
        return snapshot(trainer.model), log, args.output_dir

    first, log, out = run(0, "a")
    again, log_again, _ = run(0, "b")
    other, log_other, _ = run(1, "c")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert [s["coefficients"] for s in log] == [s["coefficients"] for s in log_again]
    assert [s["coefficients"] for s in log] != [s["coefficients"] for s in log_other]
    assert any(not torch.equal(first[k], other[k]) for k in first)
    fresh = build_llama(tokenizer)
    replay(fresh, os.path.join(out, SEED_LOG_NAME))
    assert all(torch.equal(v, first[k]) for k, v in snapshot(fresh).items())


# ------------------------------------------------------------------------------------------- low-rank rows, sampled
def test_batched_lowrank_rows_sample_as_the_materialized_members(tokenizer):
    """One sampled generate over 3 members' row blocks == each materialized member sampled alone with the same seed
    and the same batch shape (HF's sampler draws per row from one stream: row j's draw is the same slice of it)."""
    model = build_llama(tokenizer).eval()
    noise = NoiseTable(SMALL_TABLE)
    params = TrainedParameters(select_parameters(model, LINEARS))
    members, sigma, rank = members3(), 0.05, 2
    texts = ["Write: 1", "Hello there, friend"]
    config = build_generation_config(tokenizer, 8, temperature=1.0, top_p=0.95)
    backend = BatchedLowRankPopulation(noise_rank=rank)
    with backend.apply(params, noise, members, sigma, model):
        torch.manual_seed(7)
        _, stacked = generate_completions(model, tokenizer, texts * 3, config)
    eos = tokenizer.eos_token_id
    cut = [ids[: ids.index(eos) + 1] if eos in ids else ids for ids in stacked]
    for k, member in enumerate(members):
        torch.manual_seed(7)
        _, alone = generate_completions(materialized(model, noise, member, sigma, rank), tokenizer, texts * 3, config)
        alone = [ids[: ids.index(eos) + 1] if eos in ids else ids for ids in alone]
        assert cut[2 * k : 2 * k + 2] == alone[2 * k : 2 * k + 2], k
    torch.manual_seed(8)
    _, other_seed = generate_completions(materialized(model, noise, members[0], sigma, rank), tokenizer, texts * 3, config)
    assert len({str(cut[0:2]), str(cut[2:4]), str(cut[4:6])}) == 3  # the members sample differently
    assert [ids[: ids.index(eos) + 1] if eos in ids else ids for ids in other_seed][0:2] != cut[0:2]


def test_sharded_trainer_fills_its_own_prompt_columns(tmp_path, tokenizer, monkeypatch):
    """ZeRO-3 layout, seen from process 1 of 2: its 3 prompts are columns 3-5 of 6; unequal shares are refused."""
    trainer = ESTrainer(build_llama(tokenizer), share_a, args=es_args(tmp_path, max_steps=1),
                        train_dataset=prompts(), processing_class=tokenizer)

    class TwoProcesses:
        num_processes, process_index, device = 2, 1, torch.device("cpu")

        def __init__(self, other_rows):
            self.other_rows = other_rows

        def gather(self, tensor):
            return torch.cat([torch.tensor([self.other_rows]), tensor])

        def reduce(self, tensor, reduction):
            return tensor  # process 0's table adds only zeros to process 1's members here

    monkeypatch.setattr(type(trainer), "sharded", property(lambda self: True))
    members = {i: MemberScores.from_rollout(rollout(REWARDS[i]), 1.0, num_generations=2) for i in range(4)}
    trainer.accelerator = TwoProcesses(3)
    scores = trainer._population_scores(members, 3)
    assert scores.prompt_sum.shape == (4, 6)
    assert torch.equal(scores.fitness_matrix()[:, 3:], MATRIX) and torch.isnan(scores.fitness_matrix()[:, :3]).all()
    trainer.accelerator = TwoProcesses(2)
    with pytest.raises(ValueError, match="same number of prompts on every process; got \\[2, 3\\]"):
        trainer._population_scores(members, 3)
