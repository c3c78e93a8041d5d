"""Every field of TRL's ``GRPOConfig`` answered: the one table of the GRPO fields ``ESConfig`` honours, maps, ignores
or refuses.

A GRPO user changes one import (``GRPOConfig`` -> ``ESConfig``) and keeps the keyword arguments, YAML keys and
command-line flags they had. The fields of ``GRPOConfig`` fall in three sets:

* the fields of :class:`transformers.TrainingArguments`: ``ESConfig`` is a ``TrainingArguments`` too (GRPO's batch
  fields ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` keep GRPO's meaning: ``ESConfig`` maps
  them onto ``prompt_batch_size``, see ``ESConfig._map_grpo_batch``);
* the fields ``ESConfig`` declares itself with GRPO's name and meaning (``num_generations``, ``temperature``,
  ``use_vllm``, ...);
* the others, each answered by one entry of :data:`GRPO_FIELDS`:

  - *honoured*: an ``ESConfig`` field of the same name and meaning, declared in ``es_config.py``;
  - *mapped*: GRPO's batch fields (``generation_batch_size``, ``steps_per_generation``), checked as GRPO checks
    them and translated onto ``prompt_batch_size``;
  - *ignored*: a setting of GRPO's policy-gradient loss (``beta``, ``epsilon``, ``loss_type``, ...) or of how GRPO
    spends memory (``vllm_enable_sleep_mode``, ...), which ES does not have: accepted, never read, and named with its
    ES counterpart in one warning at start (:func:`grpo_field_notices`);
  - *refused*: a value ES cannot honour and that would change the results (``cast_lm_head_to_fp32=True``,
    transformers' continuous batching): a ``ValueError`` naming the field, why and what to do instead.

  Every entry but the honoured ones is an ``ESConfig`` field (added by :func:`answer_grpo_fields`, default ``None``),
  so ``ESConfig(beta=0.1)``, ``--beta 0.1`` and a recipe's ``beta: 0.1`` behave alike, instead of a bare
  ``TypeError``. Values under which GRPO does what ES does (``beta=0.0``: no KL term; ``log_completions=False``) are
  accepted silently.

``tests/trainer/test_grpo_fields.py`` fails when a ``GRPOConfig`` field of the installed TRL is in none of the sets.
``docs/grpo_fields.md`` is generated from this table::

    python scripts/grpo_fields_markdown.py > docs/grpo_fields.md
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


__all__ = ["GRPO_FIELDS", "GRPOField", "added_fields", "answer_grpo_fields", "check_grpo_fields",
           "field_errors_message", "grpo_field_errors", "grpo_field_notices", "ignored_fields", "notices_message",
           "raise_field_errors", "refused_fields"]

HONOURED = "honoured"
MAPPED = "mapped"
IGNORED = "ignored"
REFUSED = "refused"
STATUSES = (HONOURED, MAPPED, IGNORED, REFUSED)

_NO_LOSS = "ES computes no loss and no gradient of one: each step moves the weights by the fitness-weighted sum of " \
           "the members' noise."
_NO_RATIO = "ES keeps no old policy and computes no log-probabilities: there is no importance ratio to clip, weigh " \
            "or mask."
_NO_KL = "ES has no reference model and no KL term."
_NO_ENTROPY = "ES computes no token entropies (no loss to regularize); its exploration is the noise scale sigma " \
              "(and sampling, temperature > 0)."
_SHAPING = "fitness_shaping ('zscore', 'centered_rank', 'none') across the population, and per_prompt_shaping " \
           "across the members on each prompt"
_VLLM_IS = "ES scores exactly the completions the member's vLLM engine generated: no training-side " \
           "log-probabilities, nothing off-policy to correct."
_SERVER = "vllm_mode='server' sends the ES server only seeds (a member, an update's seed-log record)."


@dataclass(frozen=True)
class GRPOField:
    """How ``ESConfig`` answers one ``GRPOConfig`` field.

    Args:
        name (`str`): The ``GRPOConfig`` field.
        status (`str`): ``"honoured"`` (an ``ESConfig`` field of the same name and meaning), ``"mapped"``
            (translated onto an ES field), ``"ignored"`` (accepted, never read, warned about) or ``"refused"``.
        reason (`str`): Why (refused, ignored: why ES has no such thing; honoured, mapped: how ES applies it).
        counterpart (`str`, *optional*): The ES setting to use instead (refused, ignored), if any.
        type (`str`): Annotation of the ``ESConfig`` field added for an entry that is not honoured (``| None`` is
            appended).
        accepted (`tuple`): Refused and ignored entries: values under which GRPO does what ES does, accepted silently
            as well as ``None``.
        same_as (`str`, *optional*): Refused and ignored entries: also accepted when equal to this ``ESConfig`` field.
        not_yet (`bool`): Refused because ES does not support it yet (it could), not because it has no meaning.
    """

    name: str
    status: str
    reason: str
    counterpart: str | None = None
    type: str = "str"
    accepted: tuple = ()
    same_as: str | None = None
    not_yet: bool = False

    def accepts(self, value: Any, config: Any = None) -> bool:
        """Whether ``value`` is accepted silently (``None``, an ``accepted`` value, or ``same_as``'s): a refused
        field refuses any other value, an ignored one warns about it."""
        if value is None:
            return True
        if self.same_as is not None and config is not None and value == getattr(config, self.same_as, None):
            return True
        return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in self.accepted)

    def accepted_text(self) -> str:
        """The accepted values, in words (for messages and docs)."""
        values = ["unset (None)"] + [repr(a) for a in self.accepted]
        if self.same_as:
            values.append(f"the value of {self.same_as}")
        return ", ".join(values)

    def help(self) -> str:
        """The ``metadata["help"]`` of the ``ESConfig`` field of an entry that is not honoured."""
        if self.status == MAPPED:
            return f"GRPOConfig field, mapped by ES: {self.reason}"
        if self.status == IGNORED:
            use = f" ES counterpart: {self.counterpart}." if self.counterpart else " ES has no counterpart."
            return (f"GRPOConfig field with no effect on ES (accepted, not used; another value than "
                    f"{self.accepted_text()} is named in one warning at start): {self.reason}{use}")
        lead = "GRPOConfig field not supported by ES yet" if self.not_yet else "GRPOConfig field not used by ES"
        use = f" Use {self.counterpart} instead." if self.counterpart else " ES has no counterpart."
        return f"{lead}: {self.reason}{use} Accepted: {self.accepted_text()}; any other value raises ValueError."

    def notice(self, value: Any) -> str:
        """The line of the start-up warning for an ignored field set to ``value``."""
        use = f" ES counterpart: {self.counterpart}." if self.counterpart else " ES has no counterpart."
        return f"{self.name}={value!r} has no effect on ES (accepted, not used): {self.reason}{use}"

    def error(self, value: Any) -> str:
        """The ``ValueError`` message for a refused value."""
        lead = "is not supported by ES yet" if self.not_yet else "is a GRPOConfig setting with no meaning for ES"
        use = f" ES counterpart: {self.counterpart}." if self.counterpart else " ES has no counterpart."
        return f"{self.name}={value!r} {lead}: {self.reason}{use} Accepted for {self.name}: {self.accepted_text()}."


def _honoured(name: str, how: str) -> GRPOField:
    return GRPOField(name, HONOURED, how)


def _refused(name: str, reason: str, counterpart: str | None = None, type: str = "str", accepted: tuple = (),
             not_yet: bool = False, same_as: str | None = None) -> GRPOField:
    return GRPOField(name, REFUSED, reason, counterpart, type, accepted, same_as, not_yet)


def _ignored(name: str, reason: str, counterpart: str | None = None, type: str = "str",
             accepted: tuple = ()) -> GRPOField:
    return GRPOField(name, IGNORED, reason, counterpart, type, accepted)


def _mapped(name: str, how: str, type: str = "int") -> GRPOField:
    return GRPOField(name, MAPPED, how, type=type)


_CLIP = "sigma and learning_rate (the size of an ES step: members at theta + sigma * eps, a step of alpha / N * " \
        "sum_i z_i eps_i)"
_AWD = "awd_lambda (Anchored Weight Decay: after each step the drift from theta_0 shrinks, pulling the weights " \
       "toward the initial model instead of a KL penalty)"
#: The ``GRPOConfig`` fields that are neither ``TrainingArguments`` fields nor ``ESConfig``'s own fields of the same
#: name and meaning, in ``GRPOConfig``'s order: each honoured, mapped, ignored or refused, with the reason and the ES
#: counterpart.
GRPO_FIELDS: tuple[GRPOField, ...] = (
    # ------------------------------------------------------------------ model
    _honoured("trust_remote_code", "Added to model_init_kwargs (trust_remote_code=True), used when the model is given "
                                   "by name."),
    _ignored("router_aux_loss_coef", "the MoE load-balancing loss is a term of the training loss; " + _NO_LOSS,
             type="float", accepted=(0.0,)),
    _ignored("disable_dropout", "ES generates with the model in eval mode, so dropout is always off (as "
                                "disable_dropout=True); it runs no training forward pass.", type="bool",
             accepted=(True,)),
    _refused("cast_lm_head_to_fp32", "casting the LM head alone to float32 is not implemented, and it changes the "
                                     "logits, hence the completions.",
             "delete it, or load the model in float32 (model_init_kwargs={'dtype': 'float32'})", type="bool",
             accepted=(False,), not_yet=True),
    # ------------------------------------------------------------------ data and batching
    _honoured("num_generations_eval", "evaluate() generates num_generations_eval completions per prompt (None: "
                                      "num_generations); more than 1 samples (temperature unset: GRPO's 1.0)."),
    _ignored("ds3_gather_for_generation", "under DeepSpeed ZeRO-3 ES generates with DeepSpeed's per-layer gathering "
                                          "(as ds3_gather_for_generation=False): the same completions, another "
                                          "speed and memory.",
             "none needed (ES's ZeRO-3 generation: docs/scaling.md)", type="bool", accepted=(False,)),
    _honoured("shuffle_dataset", "False sets train_sampling_strategy='sequential' (prompts in dataset order); True "
                                 "keeps the default 'random'."),
    _honoured("pad_to_multiple_of", "Each prompt batch is left-padded (masked) to a multiple of it, in the eager "
                                    "(shared prefix included) and compiled engines; 'auto' pads only on AWS Neuron "
                                    "in GRPO, which ES does not run on, so it is None. vLLM takes unpadded prompts "
                                    "(as GRPO's vLLM path)."),
    _mapped("generation_batch_size", "checked as GRPO checks it (divisible by per_device_train_batch_size x processes "
                                     "and by num_generations; not together with steps_per_generation). It sets how "
                                     "many optimizer steps GRPO spends one generation batch on; ES generates afresh "
                                     "for every iteration, so the prompts per update (prompt_batch_size = "
                                     "per_device_train_batch_size x processes x gradient_accumulation_steps / "
                                     "num_generations) do not depend on it. Logged with the mapping."),
    _mapped("steps_per_generation", "checked as GRPO checks it (generation_batch_size = per_device_train_batch_size "
                                    "x processes x steps_per_generation, divisible by num_generations). Like "
                                    "generation_batch_size, it only sets how GRPO reuses a generation batch over "
                                    "optimizer steps; logged with the mapping."),
    # ------------------------------------------------------------------ generation
    _honoured("top_k", "Merged into generation_kwargs (GRPO's meaning: 0 = off); sampling only (temperature unset: "
                       "GRPO's 1.0; refused with an explicit temperature=0)."),
    _honoured("min_p", "Merged into generation_kwargs; sampling only (temperature unset: GRPO's 1.0; refused with an "
                       "explicit temperature=0)."),
    _honoured("repetition_penalty", "Merged into generation_kwargs (1.0 = off); applies to greedy decoding too."),
    _ignored("cache_implementation", "the KV cache is chosen by ES's generation engine (the same completions).",
             "generation_engine ('compiled': static KV cache and a compiled decoding step; 'eager'), or "
             "generation_kwargs={'cache_implementation': ...} with generation_engine='eager'"),
    # ------------------------------------------------------------------ vLLM
    _honoured("vllm_model_impl", "Passed to the colocated engine (vLLM's model_impl): 'vllm'; 'transformers' is "
                                 "refused by name (vLLM's transformers backend does not start as a generative model "
                                 "in ES's engine yet)."),
    _ignored("vllm_enable_sleep_mode", "the colocated engine stays resident: ES scores members back to back, with no "
                                       "optimizer step to free memory for.",
             "vllm_gpu_memory_utilization (the engine's share of GPU memory)", type="bool", accepted=(False,)),
    _honoured("vllm_structured_outputs_regex", "Every completion of the colocated engine is constrained to "
                                               "the regex (vLLM structured outputs); use_vllm=True only."),
    _ignored("vllm_group_port", _SERVER + " The server replays every update itself: there is no weight-update group "
                                          "(NCCL).", "vllm_server_base_url(s) of a `trl-es vllm-serve` server",
             type="int"),
    # ------------------------------------------------------------------ loss, KL, clipping
    _ignored("beta", _NO_KL + " " + _NO_LOSS, _AWD, type="float", accepted=(0.0,)),
    _ignored("num_iterations", "ES scores every prompt batch once per iteration and steps once; there are no "
                               "optimizer passes over the same samples.", type="int", accepted=(1,)),
    _ignored("epsilon", _NO_RATIO + " " + _NO_LOSS, _CLIP, type="float"),
    _ignored("delta", _NO_RATIO, _CLIP, type="float"),
    _ignored("epsilon_high", _NO_RATIO, _CLIP, type="float"),
    _ignored("sapo_temperature_neg", "a parameter of the 'sapo' loss. " + _NO_LOSS, type="float"),
    _ignored("sapo_temperature_pos", "a parameter of the 'sapo' loss. " + _NO_LOSS, type="float"),
    _ignored("vespo_k_pos", "a parameter of the 'vespo' loss. " + _NO_LOSS, type="float"),
    _ignored("vespo_lambda_pos", "a parameter of the 'vespo' loss. " + _NO_LOSS, type="float"),
    _ignored("vespo_k_neg", "a parameter of the 'vespo' loss. " + _NO_LOSS, type="float"),
    _ignored("vespo_lambda_neg", "a parameter of the 'vespo' loss. " + _NO_LOSS, type="float"),
    _ignored("importance_sampling_level", _NO_RATIO, _CLIP),
    # ------------------------------------------------------------------ rewards
    _refused("multi_objective_aggregation", "ES sums the weighted rewards of a completion, then shapes the members' "
                                            "fitness (GRPO's 'sum_then_normalize'); normalizing each reward function "
                                            "first is not implemented, and it weighs the rewards otherwise.",
             _SHAPING + "; reward_weights", accepted=("sum_then_normalize",), not_yet=True),
    _ignored("scale_rewards", "ES has no groups of completions and no advantages: rewards become a member's "
                              "fitness, which is shaped across the population.", _SHAPING),
    _ignored("loss_type", _NO_LOSS,
             "es_optimizer ('es': the reference update; 'torch': the ES gradient estimate through a torch optimizer) "
             "and fitness_shaping"),
    _honoured("mask_truncated_completions", "A completion without an EOS id (cut at max_completion_length) is "
                                            "left out of its member's fitness, as one whose rewards are all None "
                                            "(GRPO leaves it out of the loss); a member with only cut completions "
                                            "has no fitness. Training only."),
    _ignored("sync_ref_model", _NO_KL, "awd_lambda (AWD anchors the weights to theta_0)", type="bool",
             accepted=(False,)),
    _ignored("ref_model_mixup_alpha", _NO_KL, "awd_lambda (AWD anchors the weights to theta_0)", type="float"),
    _ignored("ref_model_sync_steps", _NO_KL, "awd_lambda (AWD anchors the weights to theta_0)", type="int"),
    # ------------------------------------------------------------------ entropy
    _ignored("top_entropy_quantile", _NO_ENTROPY, "sigma", type="float", accepted=(1.0,)),
    _ignored("entropy_coef", _NO_ENTROPY, "sigma", type="float", accepted=(0.0,)),
    _ignored("use_adaptive_entropy", _NO_ENTROPY, "sigma", type="bool", accepted=(False,)),
    _ignored("entropy_coef_min", _NO_ENTROPY, "sigma", type="float"),
    _ignored("entropy_coef_max", _NO_ENTROPY, "sigma", type="float"),
    _ignored("entropy_coef_delta", _NO_ENTROPY, "sigma", type="float"),
    _ignored("entropy_target", _NO_ENTROPY, "sigma", type="float"),
    # ------------------------------------------------------------------ vLLM importance sampling
    _ignored("vllm_importance_sampling_correction", _VLLM_IS, type="bool", accepted=(False,)),
    _ignored("vllm_importance_sampling_mode", _VLLM_IS),
    _ignored("vllm_importance_sampling_clip_max", _VLLM_IS, type="float"),
    _ignored("vllm_importance_sampling_clip_min", _VLLM_IS, type="float"),
    _ignored("off_policy_mask_threshold", _NO_KL + " " + _VLLM_IS, type="float"),
    _ignored("use_bias_correction_kl", _NO_KL, "awd_lambda (AWD anchors the weights to theta_0)", type="bool",
             accepted=(False,)),
    # ------------------------------------------------------------------ completion logging
    _honoured("log_completions", "At every log: the last iteration's completions of every member, printed with "
                                 "rich, written to output_dir/completions/*.parquet, logged as a table to wandb / "
                                 "trackio; the advantage column is the member's shaped fitness."),
    _refused("log_multimodal", "ES trains text-only models: completion logs hold no images or videos.",
             type="bool", accepted=(True, False)),
    _honoured("num_completions_to_print", "Completions printed with rich at each log (a fixed-seed sample; None: "
                                          "all; 0: none, as in GRPO)."),
    _honoured("log_unique_prompts", "One row per distinct prompt in the wandb / trackio table."),
    _honoured("log_completions_hub_repo", "The completion parquet files are pushed to this Hub dataset repo "
                                          "(huggingface_hub CommitScheduler, every 2 minutes, as GRPO)."),
    # ------------------------------------------------------------------ transformers continuous batching
    _honoured("use_transformers_continuous_batching", "Generates with transformers' continuous batching "
                                                      "(model.generate_batch), as GRPO: generation_engine="
                                                      "'continuous_batching', one member a call on the live weights "
                                                      "(population_backend='sequential'; not with use_vllm, ZeRO-3 or "
                                                      "tools); sampling seeded per member."),
    _honoured("transformers_continuous_batching_config", "Keyword arguments of transformers' "
                                                         "ContinuousBatchingConfig (max_memory_percent defaults to "
                                                         "GRPO's 0.5; on the CPU the cache is sized to each call); "
                                                         "'seed' is refused: ES seeds each member's sampling."),
    _honoured("use_transformers_paged", "Deprecated, as in TRL: True turns use_transformers_continuous_batching on "
                                        "(FutureWarning)."),
    _ignored("vllm_importance_sampling_cap", "deprecated in TRL (vllm_importance_sampling_clip_max). " + _VLLM_IS,
             type="float"),
)

_BY_NAME = {entry.name: entry for entry in GRPO_FIELDS}
assert len(_BY_NAME) == len(GRPO_FIELDS), "a GRPOConfig field is answered twice"
assert all(entry.status in STATUSES for entry in GRPO_FIELDS)


def refused_fields() -> tuple[GRPOField, ...]:
    """The refused entries of :data:`GRPO_FIELDS`."""
    return tuple(entry for entry in GRPO_FIELDS if entry.status == REFUSED)


def ignored_fields() -> tuple[GRPOField, ...]:
    """The ignored entries of :data:`GRPO_FIELDS` (accepted, never read, warned about at start)."""
    return tuple(entry for entry in GRPO_FIELDS if entry.status == IGNORED)


def added_fields() -> tuple[GRPOField, ...]:
    """The entries of :data:`GRPO_FIELDS` that ``ESConfig`` does not declare itself (mapped, ignored, refused):
    :func:`answer_grpo_fields` adds them."""
    return tuple(entry for entry in GRPO_FIELDS if entry.status != HONOURED)


def answer_grpo_fields(cls: type) -> type:
    """Class decorator (under ``@dataclass``): add every mapped, ignored and refused ``GRPOConfig`` field to ``cls``
    as a field defaulting to ``None``, with its reason and counterpart as ``metadata["help"]`` (so
    ``HfArgumentParser`` gives it a flag, and :func:`trl_es.arguments.document_parameters` a docstring entry). Their
    values are checked by :func:`check_grpo_fields` (refused), warned about with :func:`grpo_field_notices` (ignored)
    and mapped by ``ESConfig`` (mapped).

    Args:
        cls (`type`): The config class, not yet a dataclass.

    Returns:
        `type`: ``cls``.

    Raises:
        TypeError: if ``cls`` declares a field that :data:`GRPO_FIELDS` lists as mapped, ignored or refused.
    """
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    for entry in added_fields():
        if entry.name in annotations:
            raise TypeError(f"{cls.__name__} declares {entry.name}, which GRPO_FIELDS lists as {entry.status}.")
        annotations[entry.name] = f"{entry.type} | None"
        setattr(cls, entry.name, dataclasses.field(default=None, metadata={"help": entry.help()}))
    cls.__annotations__ = annotations
    return cls


def grpo_field_errors(config: Any) -> list[str]:
    """The error message of every refused ``GRPOConfig`` field set to a value ES does not accept (see
    :meth:`GRPOField.accepts`), in ``GRPO_FIELDS`` order; empty when there is none."""
    errors = []
    for entry in refused_fields():
        value = getattr(config, entry.name, None)
        if not entry.accepts(value, config):
            errors.append(entry.error(value))
    return errors


def grpo_field_notices(config: Any) -> list[str]:
    """The warning line of every ignored ``GRPOConfig`` field set to a value under which GRPO would do what ES does
    not (see :meth:`GRPOField.accepts`), in ``GRPO_FIELDS`` order; empty when there is none."""
    return [entry.notice(getattr(config, entry.name, None)) for entry in ignored_fields()
            if not entry.accepts(getattr(config, entry.name, None), config)]


def notices_message(notices: list[str]) -> str:
    """One warning for several settings that have no effect: a single one as it is; several as a numbered list under
    a line that says how many (as :func:`field_errors_message` does for errors)."""
    if len(notices) == 1:
        return notices[0]
    lines = [f"{len(notices)} settings of this config have no effect on ES (accepted, not used; all of them are "
             "listed):"]
    lines += [f"  {i}. {notice}" for i, notice in enumerate(notices, 1)]
    return "\n".join(lines)


def field_errors_message(errors: list[str]) -> str:
    """One message for several field errors: a single error as it is; several as a numbered list under a line that
    says how many, so a config (a GRPO command line, a YAML recipe) with several refused or invalid fields is fixed
    in one run, not one rerun per field."""
    if len(errors) == 1:
        return errors[0]
    lines = [f"{len(errors)} fields of this config are refused or invalid (all of them are listed):"]
    lines += [f"  {i}. {error}" for i, error in enumerate(errors, 1)]
    return "\n".join(lines)


def raise_field_errors(errors: list[str]) -> None:
    """Raise one ``ValueError`` for all of ``errors`` (:func:`field_errors_message`); nothing when it is empty."""
    if errors:
        raise ValueError(field_errors_message(errors))


def check_grpo_fields(config: Any) -> None:
    """Refuse every refused ``GRPOConfig`` field set to a value ES does not accept (see :meth:`GRPOField.accepts`),
    all of them in one error.

    Raises:
        ValueError: naming each such field and its value, why ES has no such thing, the ES counterpart and the
            accepted values (one field: its message alone; several: a numbered list of them).
    """
    raise_field_errors(grpo_field_errors(config))
