"""Generation engines: eager (with and without a shared prompt prefix), compiled static cache; stacked members."""

import copy

import pytest
import torch
from datasets import Dataset
from conftest import needs_inductor_vectorized_cpu
from oracles import LINEARS, materialized, members3, nucleus_probabilities
from tiny import build_llama, build_qwen2

from trl_es import ESConfig, ESTrainer
from trl_es.es.noise import NoiseTable
from trl_es.es.strategy import BatchedLowRankPopulation
from trl_es.es.perturbation import Member, TrainedParameters, select_parameters
from trl_es.rewards import completion_text
from trl_es.generation import (
    CompiledEngine,
    EagerEngine,
    common_prefix_length,
    generate_completions,
    make_engine,
    resolve_engine_name,
    standard_strided_head_input,
)
from trl_es.generation.base import tokenize_left_padded
from trl_es.rollout import build_generation_config

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def chat_prompts(tokenizer, n=5):
    """Chat-template prompts of different lengths: a long shared prefix, left padding exercised."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": "Write: " + "ab" * (i % 3) + str(i)}],
                                          tokenize=False, add_generation_prompt=True) for i in range(n)]


def test_common_prefix_length():
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3]]) == 2  # each row keeps one own token
    assert common_prefix_length([[1, 2], [3, 4]]) == 0
    assert common_prefix_length([]) == 0


@pytest.mark.parametrize("num_generations", [1, 2])
def test_shared_prefix_gives_the_plain_greedy_tokens(tokenizer, num_generations):
    model = build_llama(tokenizer).eval()
    prompts = chat_prompts(tokenizer)
    config = build_generation_config(tokenizer, 8)
    plain = EagerEngine().generate(model, tokenizer, prompts, config, num_generations)
    engine = EagerEngine(share_prompt_prefix=True)
    shared = engine.generate(model, tokenizer, prompts, config, num_generations)
    assert engine.last_shared_prefix == len(tokenizer("<|im_start|>user\nWrite: ").input_ids)
    assert shared.ids == plain.ids and shared.texts == plain.texts
    assert len(shared.ids) == len(prompts) * num_generations
    assert len({str(i) for i in plain.ids}) > 1  # the prompts really produce different completions


def test_shared_prefix_is_skipped_where_unsafe(tokenizer):
    model = build_llama(tokenizer).eval()
    engine = EagerEngine(share_prompt_prefix=True)
    config = build_generation_config(tokenizer, 4)
    engine.generate(model, tokenizer, ["ab", "ac"], config)  # a 1-token prefix is not worth a forward
    assert engine.last_shared_prefix == 0
    engine.generate(model, tokenizer, chat_prompts(tokenizer), config, use_cache=False)
    assert engine.last_shared_prefix == 0
    beams = copy.deepcopy(config)
    beams.num_beams = 2
    assert not engine.can_share(model, beams, {})
    assert not engine.can_share(model, config, {"synced_gpus": True})


def test_stacked_members_with_a_shared_prefix_equal_materialized_members(tokenizer):
    """The prefix forward runs one row per member (each sees its own adapters), then every member's cache is
    repeated for its rows: each row block still equals a model with W + E_i written into the weights."""
    model = build_llama(tokenizer).eval()
    params = TrainedParameters(select_parameters(model, LINEARS))
    noise, sigma, rank = NoiseTable(1 << 20), 0.05, 2
    members = members3()
    prompts = chat_prompts(tokenizer, 3)
    config = build_generation_config(tokenizer, 8)
    engine = EagerEngine(share_prompt_prefix=True)
    adapters = BatchedLowRankPopulation(noise_rank=rank).adapters(model, params)
    with adapters.members(noise, members, sigma):
        stacked = generate_completions(model, tokenizer, prompts * 3, config, engine=engine, num_row_groups=3).ids
    assert engine.last_shared_prefix > 0
    for k, member in enumerate(members):
        expected = EagerEngine().generate(materialized(model, noise, member, sigma, rank), tokenizer, prompts, config)
        assert stacked[3 * k : 3 * k + 3] == expected.ids, k
    assert len({str(stacked[3 * k : 3 * k + 3]) for k in range(3)}) == 3


def row_major(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16bit_cpu_head_reads_row_major_inputs_in_generation(tokenizer, dtype):
    """transformers' prefill passes the head the last-position slice ``hidden[:, -1:, :]`` (not row-major), which
    PyTorch's CPU linear answers with one copy of a 16-bit weight per row (1.7 GiB for 4 rows of Qwen2.5-1.5B's
    head); the engines give the head a row-major copy of the slice: the logits of those values, as a decoding step
    computes them, and the hook is gone after the call."""
    prompts = chat_prompts(tokenizer, 3)
    config = build_generation_config(tokenizer, 6)
    for model in (build_llama(tokenizer, dtype=dtype).eval(), build_qwen2(tokenizer, dtype=dtype).eval()):
        head = model.get_output_embeddings()
        seen = []  # (shape, strides) of the head's input after its pre-hooks
        handle = head.register_forward_hook(
            lambda m, args, out, seen=seen: seen.append((args[0].shape, args[0].stride())))
        inputs = tokenize_left_padded(tokenizer, prompts, "cpu")
        plain = model.generate(**inputs, generation_config=config)[:, inputs["input_ids"].shape[1]:].tolist()
        assert seen[0][0] == (3, 1, 32) and seen[0][1] != row_major((3, 1, 32))  # the slice, unhooked
        seen.clear()
        ids = EagerEngine().generate(model, tokenizer, prompts, config).ids
        assert len(seen) == 6 and all(stride == row_major(shape) for shape, stride in seen)
        assert [row[: len(mine)] for row, mine in zip(plain, ids, strict=True)] == ids
        assert not head._forward_pre_hooks  # removed after the call
        with torch.no_grad():
            last = model(**inputs, output_hidden_states=True).hidden_states[-1][:, -1:, :]
            with standard_strided_head_input(model):
                assert len(head._forward_pre_hooks) == 1
                hooked = model(**inputs, logits_to_keep=1).logits
            row_major_logits = head(last.clone(memory_format=torch.contiguous_format))
        assert torch.equal(hooked, row_major_logits) and hooked.dtype == dtype
        handle.remove()
    model = build_llama(tokenizer).eval()  # fp32: PyTorch copies nothing, nothing is hooked
    with standard_strided_head_input(model):
        assert not model.get_output_embeddings()._forward_pre_hooks


def test_static_cache_engine_equals_eager_and_buckets_the_batch(tokenizer):
    model = build_llama(tokenizer).eval()
    config = build_generation_config(tokenizer, 8)
    engine = CompiledEngine(compile=False)
    for n in (3, 4):  # 3 rows are padded to the bucket of 4: one shape
        prompts = chat_prompts(tokenizer, n)
        assert engine.generate(model, tokenizer, prompts, config).ids == EagerEngine().generate(
            model, tokenizer, prompts, config).ids
    assert engine.shapes_seen == {(4, 128)}
    # row groups are padded inside each group, so per-row adapters keep their blocks
    prompts = chat_prompts(tokenizer, 3)
    grouped = engine.generate(model, tokenizer, prompts * 2, config, num_row_groups=2).ids
    assert grouped[:3] == grouped[3:] == EagerEngine().generate(model, tokenizer, prompts, config).ids
    assert (8, 128) in engine.shapes_seen


def test_token_id_prompts_generate_as_their_texts_in_every_engine(tokenizer):
    """The tool loop's prompts are token ids (prompt + completion + tool turn, no re-tokenization): each engine
    generates from them what it generates from the texts they encode."""
    model = build_llama(tokenizer).eval()
    config = build_generation_config(tokenizer, 8)
    texts = chat_prompts(tokenizer, 4)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    expected = EagerEngine().generate(model, tokenizer, texts, config).ids
    for engine in (EagerEngine(), EagerEngine(share_prompt_prefix=True), EagerEngine(pad_to_multiple_of=8),
                   CompiledEngine(compile=False)):
        assert engine.generate(model, tokenizer, ids, config).ids == expected, engine.describe()
    shared = EagerEngine(share_prompt_prefix=True)
    shared.generate(model, tokenizer, ids, config)
    assert shared.last_shared_prefix > 0


@needs_inductor_vectorized_cpu
def test_compiled_engine_greedy_equals_eager_on_cpu(tokenizer):
    """torch.compile'd decoding step (inductor on CPU; ~20 s to compile the tiny model once)."""
    model = build_llama(tokenizer).eval()
    prompts = chat_prompts(tokenizer, 3)
    config = build_generation_config(tokenizer, 8)
    engine = CompiledEngine(compile=True)
    first = engine.generate(model, tokenizer, prompts, config).ids
    second = engine.generate(model, tokenizer, prompts[:2] + prompts[2:], config).ids
    assert first == second == EagerEngine().generate(model, tokenizer, prompts, config).ids
    assert engine.shapes_seen == {(4, 128)}


def test_engine_choice_and_errors(tokenizer, tmp_path):
    model = build_llama(tokenizer)
    assert resolve_engine_name("auto", model) == "eager"  # CPU
    assert isinstance(make_engine("compiled", model), CompiledEngine)
    engine = make_engine("auto", model, share_prompt_prefix=True)
    assert isinstance(engine, EagerEngine) and engine.share_prompt_prefix
    with pytest.raises(ValueError, match="generation_engine must be one of"):
        make_engine("vllm", model)

    class NoStatic(torch.nn.Module):
        _can_compile_fullgraph = False
        config = model.config

    with pytest.raises(ValueError, match="static-cache support"):
        make_engine("compiled", NoStatic())
    with pytest.raises(ValueError, match="generation_engine must be one of"):
        ESConfig(output_dir=str(tmp_path), generation_engine="fast")
    with pytest.raises(ValueError, match="num_row_groups"):
        EagerEngine().generate(model, tokenizer, ["a", "b", "c"], build_generation_config(tokenizer, 2),
                               num_row_groups=2)


def mean_code(completions, **kwargs):
    texts = [completion_text(c) for c in completions]
    return [sum(map(ord, t)) / (128 * max(1, len(t))) for t in texts]


@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_trainer_steps_are_the_same_with_and_without_prefix_sharing(tmp_path, tokenizer, backend):
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Write: {i}"}] for i in range(8)]})
    coefficients, engines = {}, {}
    for share in (False, True):
        args = ESConfig(output_dir=str(tmp_path / str(share)), max_steps=2, population_size=4, antithetic=True,
                        prompt_batch_size=4, max_completion_length=6, sigma=0.05, learning_rate=0.05, report_to=[],
                        save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True, seed=0,
                        population_backend=backend, share_prompt_prefix=share, include_parameters=LINEARS)
        trainer = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=data,
                            processing_class=tokenizer)
        trainer.train()
        engines[share] = trainer.generation_engine
        coefficients[share] = [r["coefficients"] for r in trainer.seed_log.records]
    assert engines[True].last_shared_prefix > 0 and engines[False].last_shared_prefix == 0
    assert coefficients[True] == coefficients[False]
    assert any(c != 0 for record in coefficients[True] for c in record)


# ---------------------------------------------------------------------------------------------- CUDA only
@cuda
def test_compiled_engine_greedy_equals_eager_on_cuda(tokenizer):
    model = build_qwen2(tokenizer, dtype=torch.bfloat16).cuda().eval()
    prompts = chat_prompts(tokenizer, 5)
    config = build_generation_config(tokenizer, 8)
    engine = CompiledEngine()
    engine.generate(model, tokenizer, prompts, config)  # compile
    assert engine.generate(model, tokenizer, prompts, config).ids == EagerEngine().generate(
        model, tokenizer, prompts, config).ids


@cuda
def test_lowrank_rows_equal_materialized_members_on_cuda(tokenizer):
    model = build_llama(tokenizer).cuda().eval()
    params = TrainedParameters(select_parameters(model, LINEARS))
    noise, sigma = NoiseTable(1 << 20), 0.05
    members = [Member(3, 1), Member(3, -1)]
    prompts = chat_prompts(tokenizer, 2)
    config = build_generation_config(tokenizer, 6)
    adapters = BatchedLowRankPopulation(noise_rank=1).adapters(model, params)
    with adapters.members(noise, members, sigma):
        stacked = generate_completions(model, tokenizer, prompts * 2, config, num_row_groups=2).ids
    for k, member in enumerate(members):
        assert stacked[2 * k : 2 * k + 2] == EagerEngine().generate(
            materialized(model, noise, member, sigma, 1), tokenizer, prompts, config).ids


def test_shared_prefix_is_skipped_under_zero3_and_with_ngram_processors(tokenizer, monkeypatch):
    import trl_es.generation.eager as eager

    model = build_llama(tokenizer).eval()
    engine = EagerEngine(share_prompt_prefix=True)
    config = build_generation_config(tokenizer, 4)
    assert engine.can_share(model, config, {})
    ngram = copy.deepcopy(config)
    ngram.no_repeat_ngram_size = 2  # reads the prompt's token order
    assert not engine.can_share(model, ngram, {})
    monkeypatch.setattr(eager, "synced_forwards", lambda: True)  # ZeRO-3: transformers sets synced_gpus itself
    assert not engine.can_share(model, config, {})
    engine.generate(model, tokenizer, chat_prompts(tokenizer), config)
    assert engine.last_shared_prefix == 0


# ------------------------------------------------------------------------------------------- top-p without a sort
def test_candidate_top_p_keeps_the_tokens_of_transformers_top_p():
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    from trl_es.generation.top_p import CandidateTopPLogitsWarper

    torch.manual_seed(0)
    ids = torch.zeros(64, 1, dtype=torch.long)
    fallback = {}
    for scale, temperature, top_p in ((1.0, 0.6, 0.95), (3.0, 1.0, 0.9), (0.3, 1.0, 0.95), (8.0, 0.6, 0.5)):
        scores = torch.randn(64, 5000) * scale  # scale 0.3: flat rows whose nucleus is far outside 256 candidates
        expected = TopPLogitsWarper(top_p)(ids, TemperatureLogitsWarper(temperature)(ids, scores.clone()))
        warper = CandidateTopPLogitsWarper(top_p, temperature)
        out = warper(ids, scores.clone())
        assert torch.equal(torch.isinf(out), torch.isinf(expected)), (scale, temperature, top_p)
        kept = ~torch.isinf(out)
        assert torch.equal(out[kept], scores[kept])  # the kept scores are untouched (temperature comes after)
        fallback[scale] = warper.fallback_rows
    # peaked rows are settled among the candidates, flat rows all fall back, and scale 3 mixes both in one batch
    assert fallback[8.0] == 0 and fallback[0.3] == 64 and 0 < fallback[3.0] < 64
    with pytest.raises(ValueError, match="top_p must be in"):
        CandidateTopPLogitsWarper(1.0)


def test_sampling_with_top_p_gives_transformers_tokens(tokenizer):
    """The eager engine's swapped top-p samples the same completions as transformers' own warper, same seed."""
    from trl_es.generation.top_p import use_candidate_top_p

    model = build_llama(tokenizer).eval()
    prompts = ["Write: 1", "Write: 22"] * 4
    config = build_generation_config(tokenizer, 8, temperature=0.6, top_p=0.9)
    swapped, kwargs = use_candidate_top_p(config, {})
    assert swapped.top_p == 1.0 and len(kwargs["logits_processor"]) == 1 and config.top_p == 0.9
    inputs = tokenizer(text=prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    torch.manual_seed(3)
    out = model.generate(**inputs, generation_config=config)  # transformers' TopPLogitsWarper
    reference = out[:, inputs["input_ids"].shape[1]:].tolist()
    # 256 candidates cover the tiny vocabulary (101 tokens); with 8, rows fall back and others do not
    for candidates, fallback in ((256, False), (8, True)):
        swapped, kwargs = use_candidate_top_p(config, {}, candidates)
        torch.manual_seed(3)
        ours = model.generate(**inputs, generation_config=swapped, **kwargs)[:, inputs["input_ids"].shape[1]:].tolist()
        assert ours == reference, candidates
        assert (kwargs["logits_processor"][-1].fallback_rows > 0) == fallback
    engine = EagerEngine(share_prompt_prefix=True, min_shared_prefix=1)  # the engine swaps it in itself
    torch.manual_seed(3)
    _, ids = generate_completions(model, tokenizer, prompts, config, engine=engine)
    assert engine.last_shared_prefix > 0 and len({str(i) for i in ids}) > 2  # really sampled
    assert ids == [row[: len(i)] for row, i in zip(reference, ids, strict=True)]
    # wherever transformers would do something else, the swap keeps out: top-k set (applied before top-p) or
    # unset (transformers' default of 50), no explicit temperature, beams, a min-p in the model's own generation
    # config, a sampling setting passed to generate
    from transformers import GenerationConfig

    top_k = build_generation_config(tokenizer, 8, temperature=0.6, top_p=0.9, generation_kwargs={"top_k": 20})
    assert use_candidate_top_p(top_k, {})[0] is top_k
    for unsure in (GenerationConfig(do_sample=True, top_p=0.9, temperature=0.6),
                   GenerationConfig(do_sample=True, top_p=0.9, top_k=0),
                   build_generation_config(tokenizer, 8, temperature=0.6, top_p=0.9, generation_kwargs={"num_beams": 2})):
        assert use_candidate_top_p(unsure, {})[0] is unsure
    assert use_candidate_top_p(config, {"temperature": 1.0})[0] is config
    assert use_candidate_top_p(config, {"use_cache": False})[0] is not config  # not a sampling setting
    model.generation_config.min_p = 0.1
    assert use_candidate_top_p(config, {}, model=model)[0] is config
    model.generation_config.min_p = None
    assert use_candidate_top_p(config, {}, model=model)[0] is not config


# ------------------------------------------------------------------------------- sampling without multinomial
@pytest.mark.parametrize("temperature, top_p, candidates, fallback", [
    (0.6, 0.95, 256, False),  # the papers' protocol: nucleus among the candidates
    (1.0, 0.9, 3, True),      # nucleus wider than 3 candidates: transformers' warper, then the full cumulative sum
    (1.0, 1.0, 256, True),    # no truncation: the whole distribution
])
def test_candidate_sampler_draws_the_nucleus_distribution(temperature, top_p, candidates, fallback):
    from trl_es.generation.sampling import CandidateSampler

    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 2.0
    expected = nucleus_probabilities(logits, temperature, top_p)
    draws = 20_000
    scores = logits.repeat_interleave(draws, dim=0)
    sampler = CandidateSampler(temperature, top_p, candidates)
    torch.manual_seed(1)
    out = sampler(torch.zeros(scores.shape[0], 1, dtype=torch.long), scores.clone())
    # the output is the draw: 0 at one token per row, -inf elsewhere, so greedy decoding picks it
    assert torch.equal((out == 0).sum(dim=1), torch.ones(scores.shape[0], dtype=torch.long))
    assert torch.isinf(out).sum() == scores.numel() - scores.shape[0]
    tokens = out.argmax(dim=1).view(3, draws)
    for row in range(3):
        counts = torch.bincount(tokens[row], minlength=40).double()
        assert counts[expected[row] == 0].sum() == 0  # never outside the nucleus
        # every token's frequency within 5 binomial standard deviations of transformers' probability
        sd = (expected[row].double() * (1 - expected[row].double()) / draws).sqrt()
        assert ((counts / draws - expected[row]).abs() <= 5 * sd + 1e-12).all(), row
    assert (sampler.fallback_rows > 0) == (fallback and top_p < 1)
    torch.manual_seed(1)  # one uniform per row from the global generator: the same seed, the same draws
    assert torch.equal(sampler(torch.zeros(scores.shape[0], 1, dtype=torch.long), scores.clone()), out)
    for row in (torch.full((1, 40), -float("inf")), torch.tensor([[0.0, float("nan")] + [1.0] * 38])):
        for top_p in (0.95, 1.0):  # NaN or all -inf scores: refused, as transformers' multinomial refuses them
            with pytest.raises(ValueError, match="contain NaN or inf, or sum to 0"):
                CandidateSampler(1.0, top_p)(torch.zeros(1, 1, dtype=torch.long), row)
    for bad, match in (({"temperature": 0.0}, "temperature must be > 0"), ({"top_p": 0.0}, "top_p must be in"),
                       ({"top_p": 1.5}, "top_p must be in"), ({"candidates": 0}, "candidates must be >= 1")):
        with pytest.raises(ValueError, match=match):
            CandidateSampler(**bad)


def test_candidate_sampler_can_draw_the_tiniest_tokens_of_a_large_vocabulary(monkeypatch):
    """Inverse transform sampling in float64: past a cumulative mass of 0.5 a float32 sum ignores tokens of
    probability below about 3e-8, which could then never be drawn; the uniform that falls in such a token's interval
    of the float64 CDF draws it."""
    import trl_es.generation.sampling as sampling

    vocab = 49_152
    scores = torch.full((1, vocab), -18.0)  # each tail token: p = e^-18 / (1 + ...) ~ 1.5e-8
    scores[0, 0] = 0.0
    cdf = scores.double().softmax(dim=-1).cumsum(dim=-1)[0]
    cdf32 = scores.softmax(dim=-1).cumsum(dim=-1)[0]
    assert float(cdf32[30_000] - cdf32[29_999]) == 0  # in float32, token 30,000 has no interval of its own
    for target in (1, 30_000, vocab - 1):
        u = float((cdf[target - 1] + cdf[target]) / 2 / cdf[-1])
        monkeypatch.setattr(sampling.torch, "rand", lambda *shape, **kwargs: torch.full(shape, u, **kwargs))
        assert int(sampling.CandidateSampler(1.0, 1.0).draw(torch.zeros(1, 1, dtype=torch.long), scores)) == target


def test_candidate_sampling_in_generate_matches_transformers_sampling(tokenizer):
    """One sampled token from many copies of a prompt: the candidate sampler's frequencies (greedy generate) equal
    transformers' do_sample frequencies within sampling error; seeded runs repeat; the swap keeps out where unsafe."""
    from transformers import GenerationConfig

    from trl_es.generation.sampling import CandidateSampler, use_candidate_sampler

    model = build_llama(tokenizer).eval()
    config = build_generation_config(tokenizer, 1, temperature=0.6, top_p=0.95)
    swapped, kwargs = use_candidate_sampler(config, {}, model=model)
    assert swapped.do_sample is False and config.do_sample is True
    assert isinstance(kwargs["logits_processor"][-1], CandidateSampler)
    inputs = tokenizer(text=["Write: 1"] * 4000, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        torch.manual_seed(0)
        reference = model.generate(**inputs, generation_config=config)[:, -1]
        torch.manual_seed(0)
        ours = model.generate(**inputs, generation_config=swapped, **kwargs)[:, -1]
        probs = nucleus_probabilities(model(**tokenizer(text=["Write: 1"], return_tensors="pt",
                                                        add_special_tokens=False)).logits[:, -1], 0.6, 0.95)[0]
    assert len(set(ours.tolist())) > 2  # really sampled
    sd = (probs.double() * (1 - probs.double()) / 4000).sqrt()
    for drawn in (reference, ours):
        frequency = torch.bincount(drawn, minlength=probs.numel()).double() / 4000
        assert ((frequency - probs).abs() <= 5 * sd + 1e-12).all()
    prompts = ["Write: 1", "Write: 22"] * 4
    engine = EagerEngine(share_prompt_prefix=True, min_shared_prefix=1, candidate_sampling=True)
    sampled = build_generation_config(tokenizer, 8, temperature=0.6, top_p=0.9)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        _, ids = generate_completions(model, tokenizer, prompts, sampled, engine=engine)
        runs.append(ids)
    assert runs[0] == runs[1] and len({str(i) for i in runs[0]}) > 2
    assert engine.describe() == {"name": "eager", "share_prompt_prefix": True, "candidate_sampling": True}
    # where something reads or changes the scores after sampling, or the settings are not fully known: no swap
    for unsure in (GenerationConfig(do_sample=True, top_p=0.9, temperature=0.6),  # top-k unset (50)
                   build_generation_config(tokenizer, 8, temperature=0.6, top_p=0.9,
                                           generation_kwargs={"output_scores": True}),
                   build_generation_config(tokenizer, 8, temperature=0.6, top_p=0.9,
                                           generation_kwargs={"renormalize_logits": True}),
                   build_generation_config(tokenizer, 8, temperature=0.6, top_p=None)):
        assert use_candidate_sampler(unsure, {})[0] is unsure
    assert use_candidate_sampler(sampled, {"output_logits": True})[0] is sampled
    several = build_generation_config(tokenizer, 8, temperature=0.6, top_p=0.9,
                                      generation_kwargs={"num_return_sequences": 2})
    assert use_candidate_sampler(several, {})[0] is several  # greedy decoding refuses several sequences
    assert use_candidate_sampler(sampled, {"num_return_sequences": 2})[0] is sampled
    model.generation_config.penalty_alpha = 0.6  # would turn greedy decoding into contrastive search
    assert use_candidate_sampler(sampled, {}, model=model)[0] is sampled
    model.generation_config.penalty_alpha = None
    assert use_candidate_sampler(sampled, {}, model=model)[0].top_k == 0
    assert use_candidate_sampler(build_generation_config(tokenizer, 8), {})[1] == {}  # greedy stays greedy
    whole = build_generation_config(tokenizer, 8, temperature=1.0, top_p=1.0)
    assert use_candidate_sampler(whole, {})[1]["logits_processor"][-1].top_p == 1.0
