"""GRPOTrainer's agent surface on ESTrainer: tools=, environment_factory= and rollout_func= (TRL's own tests of them,
ported), and what ES adds: every member rolls out with its own weights on every turn, environments start fresh for
every member under the same random numbers, and the weights stay exact (an exception, a constant reward, replay)."""

import math
import random

import pytest
import torch
from datasets import Dataset
from tiny import build_llama, build_tokenizer
from tiny_tools import multiply_tool, scripted, tool_call, tool_model, tool_tokenizer, turn_of

from trl_es import ESConfig, ESTrainer, replay
from trl_es.agents import common_random_numbers


def es_args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), max_steps=1, population_size=4, prompt_batch_size=3,
                    max_completion_length=400, sigma=0.02, learning_rate=0.02, report_to=[], save_strategy="no",
                    noise_table_size=1 << 20, disable_tqdm=True, seed=0, logging_steps=1)
    defaults.update(kwargs)
    return ESConfig(**defaults)


def task_prompts(n=3):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Task {i}"}] for i in range(n)]})


def snapshot(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def fingerprint(model) -> float:
    return float(sum(p.double().sum() for p in model.parameters()))


def task_of(prompt: str) -> int:
    return int(prompt.split("Task ")[1][0])


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


# ------------------------------------------------------------------ tools (TRL's test_train_with_tools)
def test_tools_run_as_in_grpo_and_rewards_see_the_turns(tmp_path):
    tok = tool_tokenizer()
    model = tool_model(tok)
    first = {0: tool_call("multiply_tool", a=3, b=4), 1: tool_call("no_such_tool", a=1), 2: "12<|im_end|>"}
    model.generate = scripted(tok, lambda p, i: first[task_of(p)] if turn_of(p) == 0 else "Done<|im_end|>")
    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    base = snapshot(model)
    trainer = ESTrainer(model, reward, args=es_args(tmp_path), train_dataset=task_prompts(), processing_class=tok,
                        tools=[multiply_tool])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert logs[0]["tools/call_frequency"] == pytest.approx(2 / 3)  # 2 of 3 rows call, 1 of the 2 calls fails
    assert logs[0]["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert len(seen) == 4 * 3  # every member, every row
    by_turns = {len(c): c for c in seen}
    assert sorted(by_turns) == [1, 3]  # the plain answer; assistant -> tool -> assistant
    called = [c for c in seen if len(c) == 3]
    results = sorted(c[1]["content"] for c in called)
    assert results[0] == "12" and "no_such_tool" in results[-1] and "error" in results[-1]
    assert all(c[1]["role"] == "tool" and c[2] == {"role": "assistant", "content": "Done"} for c in called)
    assert_bitwise(snapshot(trainer.model), base)  # every member scored the same: no signal, no step


def test_max_tool_calling_iterations_and_the_completion_budget(tmp_path):
    tok = tool_tokenizer()
    model = tool_model(tok)
    model.generate = scripted(tok, lambda p, i: tool_call("multiply_tool", a=2, b=turn_of(p)))  # calls forever
    turns = []

    def reward(completions, **kwargs):
        turns.extend(len(c) for c in completions)
        return [0.0] * len(completions)

    args = es_args(tmp_path, max_tool_calling_iterations=2, population_size=2)
    ESTrainer(model, reward, args=args, train_dataset=task_prompts(), processing_class=tok,
              tools=[multiply_tool]).train()
    assert set(turns) == {5}  # call, result, call, result, call (the third call is not run)
    turns.clear()
    args = es_args(tmp_path, population_size=2, max_completion_length=250)  # no limit: the budget ends it
    trainer = ESTrainer(model, reward, args=args, train_dataset=task_prompts(), processing_class=tok,
                        tools=[multiply_tool])
    out = trainer.rollout(trainer.model, [task_prompts()[0]])
    assert max(len(ids) for ids in out.completion_ids) <= 250
    assert len(out.reward_completions[0]) == 3  # one call and its result fit; the second result does not


def test_a_template_without_tool_calling_is_refused(tmp_path):
    tok = build_tokenizer()  # plain ChatML: renders no tool calls
    with pytest.raises(ValueError, match="does not support tool calling"):
        ESTrainer(build_llama(tok), constant_reward, args=es_args(tmp_path), train_dataset=task_prompts(),
                  processing_class=tok, tools=[multiply_tool])


def test_stacked_members_are_refused_with_tools(tmp_path):
    tok = tool_tokenizer()
    args = es_args(tmp_path, population_backend="batched_lowrank", member_chunk_size=2)
    with pytest.raises(ValueError, match="member_chunk_size"):
        ESTrainer(tool_model(tok), constant_reward, args=args, train_dataset=task_prompts(), processing_class=tok,
                  tools=[multiply_tool])


def test_every_turn_of_a_member_generates_with_that_member(tmp_path):
    tok = tool_tokenizer()
    model = tool_model(tok)
    calls = []  # (fingerprint of the weights, turn) of every generate call

    def script(prompt, index):
        calls.append((fingerprint(model), turn_of(prompt)))
        return tool_call("multiply_tool", a=1, b=2) if turn_of(prompt) == 0 else "2<|im_end|>"

    model.generate = scripted(tok, script)
    base = fingerprint(model)
    trainer = ESTrainer(model, constant_reward, args=es_args(tmp_path, prompt_batch_size=1, antithetic=True),
                        train_dataset=task_prompts(1), processing_class=tok, tools=[multiply_tool])
    trainer.train()
    per_member = [calls[i : i + 2] for i in range(0, len(calls), 2)]
    assert len(per_member) == 4
    for (fp_first, turn_first), (fp_second, turn_second) in per_member:
        assert (turn_first, turn_second) == (0, 1) and fp_first == fp_second != base  # regenerated as the member
    assert len({fp for (fp, _), _ in per_member}) == 4  # four members, four weights


# ------------------------------------------------------------------ environments
class CounterEnvironment:
    """TRL's DummyEnvironment, with a start drawn from `random` (as the IncrementEnv of TRL's docs)."""

    log = []

    def reset(self, **kwargs):
        self._counter = 0
        self.start = random.randint(0, 10**6)
        return f" (start {self.start})"

    def increment(self, step: int) -> int:
        """Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self._counter += step
        return self._counter

    def get_reward(self) -> float:
        CounterEnvironment.log.append((self.start, self._counter))
        return float(self._counter)


def test_environment_owned_reward_fresh_state_and_common_random_numbers(tmp_path):
    tok = tool_tokenizer()
    model = tool_model(tok)
    model.generate = scripted(tok, lambda p, i: tool_call("increment", step=1) if turn_of(p) == 0 else "ok<|im_end|>")
    CounterEnvironment.log.clear()
    args = es_args(tmp_path, max_steps=2)
    trainer = ESTrainer(model, None, args=args, processing_class=tok, environment_factory=CounterEnvironment)
    assert trainer.reward_func_names == ["CounterEnvironment"]
    assert [t.__name__ for t in trainer.tools] == ["increment"]  # reset and get_reward are not tools
    trainer.train()
    log = CounterEnvironment.log
    assert len(log) == 2 * 4 * 3  # iterations x members x rows
    assert {counter for _, counter in log} == {1}  # each member's rollout starts from a fresh reset
    starts = [[start for start, _ in log[k * 3 : (k + 1) * 3]] for k in range(8)]
    for it in range(2):
        members = starts[it * 4 : (it + 1) * 4]
        assert all(m == members[0] for m in members)  # every member, the same task for the same row
        assert len(set(members[0])) == 3  # rows differ
    assert starts[0] != starts[4]  # iterations differ
    assert len(trainer.environments.pool[None]) == 3  # one instance per row, reused


def test_common_random_numbers_restore_the_generators():
    random.seed(1)
    torch.manual_seed(1)
    before = random.random(), torch.rand(1)
    random.seed(1)
    torch.manual_seed(1)
    with common_random_numbers(7):
        a = random.random(), torch.rand(1)
    with common_random_numbers(7):
        b = random.random(), torch.rand(1)
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert (random.random(), torch.rand(1))[0] == before[0]


class FailingEnvironment(CounterEnvironment):
    resets = 0

    def reset(self, **kwargs):
        FailingEnvironment.resets += 1
        if FailingEnvironment.resets == 5:  # the second member's second row
            raise RuntimeError("environment down")
        return super().reset(**kwargs)


def test_an_exception_in_an_environment_leaves_the_weights_bitwise(tmp_path):
    tok = tool_tokenizer()
    model = tool_model(tok)
    FailingEnvironment.resets = 0
    base = snapshot(model)
    args = es_args(tmp_path, max_completion_length=4)
    trainer = ESTrainer(model, lambda completions, **kw: [0.0] * len(completions), args=args,
                        train_dataset=task_prompts(), processing_class=tok, environment_factory=FailingEnvironment)
    with pytest.raises(RuntimeError, match="environment down"):
        trainer.train()
    assert_bitwise(snapshot(trainer.model), base)


def test_multi_environment_dict_routes_rows_by_their_environment_column(tmp_path):
    tok = tool_tokenizer()
    model = tool_model(tok)
    model.generate = scripted(tok, lambda p, i: "ok<|im_end|>")

    class Other(CounterEnvironment):
        def get_reward(self) -> float:
            return 5.0

    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Task {i}"}] for i in range(3)],
                              "environment": ["counter", "other", "counter"]})
    seen = []

    def reward(completions, environments, **kwargs):
        seen.append([type(e).__name__ for e in environments])
        return [0.0] * len(completions)

    trainer = ESTrainer(model, reward, args=es_args(tmp_path, population_size=2), train_dataset=data,
                        processing_class=tok, environment_factory={"counter": CounterEnvironment, "other": Other})
    assert trainer.reward_func_names == ["reward", "CounterEnvironment", "Other"]
    out = trainer.rollout(trainer.model, list(data), reward_kwargs={})
    assert seen[-1] == ["CounterEnvironment", "Other", "CounterEnvironment"]
    rewards = out.rewards_per_func
    assert math.isnan(rewards[1, 1]) and not math.isnan(rewards[0, 1])  # None -> NaN: another class's row
    assert rewards[1, 2].item() == 5.0
    bad = Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]], "environment": ["missing"]})
    with pytest.raises(ValueError, match="environment='missing'"):
        trainer.rollout(trainer.model, list(bad))


def test_environments_need_reset_a_reward_and_max_steps_without_data(tmp_path):
    tok = tool_tokenizer()

    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: A number.
            """
            return x

    with pytest.raises(ValueError, match="must define a callable `reset`"):
        ESTrainer(tool_model(tok), constant_reward, args=es_args(tmp_path), train_dataset=task_prompts(),
                  processing_class=tok, environment_factory=NoReset)

    with pytest.raises(ValueError, match="No reward source provided"):
        ESTrainer(tool_model(tok), None, args=es_args(tmp_path), train_dataset=task_prompts(), processing_class=tok)
    with pytest.raises(ValueError, match="max_steps"):
        ESTrainer(tool_model(tok), None, args=es_args(tmp_path, max_steps=-1), processing_class=tok,
                  environment_factory=CounterEnvironment)


def test_an_environment_run_moves_the_weights_and_the_seed_log_replays_bitwise(tmp_path):
    tok = tool_tokenizer()
    model = tool_model(tok)
    base = snapshot(model)

    def reward(completions, environments, **kwargs):  # the model's own text, plus the environment's task
        return [sum(map(ord, c[0]["content"])) % 7 + e.start % 3 for c, e in zip(completions, environments,
                                                                               strict=True)]

    args = es_args(tmp_path, max_steps=2, max_completion_length=6, save_strategy="steps", save_steps=2)
    trainer = ESTrainer(model, reward, args=args, train_dataset=task_prompts(2), processing_class=tok,
                        environment_factory=CounterEnvironment)
    trainer.train()
    trained = snapshot(trainer.model)
    assert any(not torch.equal(trained[k], base[k]) for k in base)
    fresh = tool_model(tok)
    replay(fresh, str(tmp_path / "out" / "checkpoint-2"))
    assert_bitwise(snapshot(fresh), trained)


def test_a_constant_reward_with_an_environment_moves_nothing(tmp_path):
    """The members generate different texts (no script), but the environment's reward is the same for all: the
    step is exactly zero, the weights bitwise the base."""
    tok = tool_tokenizer()
    model = tool_model(tok)
    base = snapshot(model)
    seen = set()

    class Constant(CounterEnvironment):
        def get_reward(self) -> float:
            return 0.5

    def watch(completions, **kwargs):
        seen.update(c[0]["content"] for c in completions)
        return [None] * len(completions)  # "not applicable": the environment's reward decides

    args = es_args(tmp_path, max_steps=2, max_completion_length=6)
    trainer = ESTrainer(model, watch, args=args, train_dataset=task_prompts(2), processing_class=tok,
                        environment_factory=Constant)
    trainer.train()
    assert len(seen) > 2  # the members' completions differ
    assert_bitwise(snapshot(trainer.model), base)


# ------------------------------------------------------------------ rollout_func
def test_rollout_func_is_called_once_per_member_with_its_weights(tmp_path):
    tok = build_tokenizer()
    model = build_llama(tok)
    calls = []

    def rollout_func(prompts, trainer):
        calls.append((len(prompts), fingerprint(trainer.model)))
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        inputs = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        out = trainer.model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
        completion_ids = [row[inputs["input_ids"].shape[1]:].tolist() for row in out]
        return {"prompt_ids": inputs["input_ids"].tolist(), "completion_ids": completion_ids, "tag": "x",
                "length": [len(c) for c in completion_ids]}

    def reward(completions, tag, length, **kwargs):
        assert tag == ["x"] * len(completions) and len(length) == len(completions)
        return [sum(map(ord, c[0]["content"])) % 7 for c in completions]

    base = fingerprint(model)
    args = es_args(tmp_path, max_steps=2, max_completion_length=5, save_strategy="steps", save_steps=2)
    trainer = ESTrainer(model, reward, args=args, train_dataset=task_prompts(), processing_class=tok,
                        rollout_func=rollout_func)
    trainer.train()
    assert [n for n, _ in calls] == [3] * 8  # 2 iterations x 4 members, each on the 3 rows
    assert len({fp for _, fp in calls[:4]}) == 4 and base not in {fp for _, fp in calls[:4]}
    fresh = build_llama(tok)
    replay(fresh, str(tmp_path / "out" / "checkpoint-2"))
    assert_bitwise(snapshot(fresh), snapshot(trainer.model))


def test_a_rollout_func_that_ignores_the_member_is_named(tmp_path):
    tok = build_tokenizer()

    def rollout_func(prompts, trainer):  # an external server ES does not drive: the same ids for every member
        return {"prompt_ids": [[5, 6]] * len(prompts), "completion_ids": [[7, 8, 2]] * len(prompts)}

    trainer = ESTrainer(build_llama(tok), constant_reward, args=es_args(tmp_path), train_dataset=task_prompts(),
                        processing_class=tok, rollout_func=rollout_func)
    with pytest.warns(UserWarning, match="same completions from rollout_func"):
        trainer.train()


def test_rollout_func_errors_leave_the_weights_bitwise(tmp_path):
    tok = build_tokenizer()
    model = build_llama(tok)
    base = snapshot(model)
    count = [0]

    def rollout_func(prompts, trainer):
        count[0] += 1
        if count[0] == 2:
            return {"completion_ids": [[1]] * len(prompts)}  # no prompt_ids
        return {"prompt_ids": [[5]] * len(prompts), "completion_ids": [[7, 2]] * len(prompts)}

    trainer = ESTrainer(model, constant_reward, args=es_args(tmp_path), train_dataset=task_prompts(),
                        processing_class=tok, rollout_func=rollout_func)
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['prompt_ids'\]"):
        trainer.train()
    assert_bitwise(snapshot(trainer.model), base)


# ------------------------------------------------------------------ what a reviewer found
class DrawEnvironment:
    def reset(self, **kwargs):
        self.task = random.randint(0, 10**6)

    def get_reward(self) -> float:
        return float(self.task)


def test_evaluation_tasks_follow_the_dataset_index_however_it_is_batched(tmp_path):
    tok = tool_tokenizer()
    model = tool_model(tok)
    model.generate = scripted(tok, lambda p, i: "ok<|im_end|>")
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * 6})  # identical rows
    rewards = {}
    for batch in (6, 2):
        trainer = ESTrainer(model, None, args=es_args(tmp_path, per_device_eval_batch_size=batch), train_dataset=data,
                            processing_class=tok, environment_factory=DrawEnvironment)
        rewards[batch] = trainer.evaluate(data)["eval_rewards/DrawEnvironment/mean"]
    assert rewards[6] == rewards[2]  # six different tasks either way, the same six
    again = ESTrainer(model, None, args=es_args(tmp_path), train_dataset=data, processing_class=tok,
                      environment_factory=DrawEnvironment)
    out = again.rollout(again.model, list(data), row_ids=list(range(6)))
    assert len(set(out.rewards_per_func[:, 0].tolist())) == 6


def test_length_metrics_and_completion_logs_count_the_models_tokens_and_turns(tmp_path):
    tok = tool_tokenizer()
    model = tool_model(tok)
    model.generate = scripted(tok, lambda p, i: tool_call("multiply_tool", a=2, b=3) if turn_of(p) == 0 else "6<|im_end|>")
    args = es_args(tmp_path, population_size=2, prompt_batch_size=1, log_completions=True)
    trainer = ESTrainer(model, constant_reward, args=args, train_dataset=task_prompts(1), processing_class=tok,
                        tools=[multiply_tool])
    out = trainer.rollout(trainer.model, [task_prompts(1)[0]])
    model_tokens = len(tok(tool_call("multiply_tool", a=2, b=3) + "6<|im_end|>", add_special_tokens=False)["input_ids"])
    assert out.completion_lengths == [model_tokens] < [len(out.completion_ids[0])]  # tool tokens left out
    trainer.train()
    logged = [h for h in trainer.state.log_history if "completions/mean_length" in h][0]
    assert logged["completions/mean_length"] == model_tokens and logged["completion_tokens"] == 2 * model_tokens
    table = trainer.completion_log.table()
    assert [m["role"] for m in table["completion"][0]] == ["assistant", "tool", "assistant"]  # as rewards saw it
    assert table["prompt"][0][-1]["content"] == "Task 0"


def test_agent_arguments_of_the_wrong_kind_are_named(tmp_path):
    tok = tool_tokenizer()

    def no_docstring(a: int) -> int:
        return a

    cases = [({"tools": multiply_tool}, TypeError, "tools must be a list"),
             ({"tools": [no_docstring]}, ValueError, "'no_docstring' has no JSON schema"),
             ({"rollout_func": "abc"}, TypeError, "rollout_func must be callable"),
             ({"environment_factory": CounterEnvironment()}, TypeError, "not an instance")]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            ESTrainer(tool_model(tok), constant_reward, args=es_args(tmp_path), train_dataset=task_prompts(),
                      processing_class=tok, **kwargs)


def test_plain_text_prompts_and_bad_reset_returns_are_refused(tmp_path):
    tok = tool_tokenizer()
    text = Dataset.from_dict({"prompt": ["Task 0", "Task 1"]})
    trainer = ESTrainer(tool_model(tok), constant_reward, args=es_args(tmp_path), train_dataset=text,
                        processing_class=tok, tools=[multiply_tool])
    with pytest.raises(ValueError, match="tools need conversational prompts"):
        trainer.rollout(trainer.model, list(text))

    class DictReset(CounterEnvironment):
        def reset(self, **kwargs):
            return {"task": 1}

    trainer = ESTrainer(tool_model(tok), constant_reward, args=es_args(tmp_path), train_dataset=task_prompts(),
                        processing_class=tok, environment_factory=DictReset)
    with pytest.raises(TypeError, match=r"DictReset.reset\(\) must return a string"):
        trainer.rollout(trainer.model, list(task_prompts()))


def test_evaluate_logs_tool_metrics_and_takes_a_promptless_eval_set(tmp_path):
    tok = tool_tokenizer()
    model = tool_model(tok)
    model.generate = scripted(tok, lambda p, i: tool_call("increment", step=1) if turn_of(p) == 0 else "ok<|im_end|>")
    routing = Dataset.from_dict({"environment": ["counter", "counter"]})
    trainer = ESTrainer(model, None, args=es_args(tmp_path), train_dataset=routing, eval_dataset=routing,
                        processing_class=tok, environment_factory={"counter": CounterEnvironment})
    metrics = trainer.evaluate()
    assert metrics["eval_tools/call_frequency"] == 1.0 and metrics["eval_tools/failure_frequency"] == 0.0
    assert metrics["eval_rewards/CounterEnvironment/mean"] == 1.0
