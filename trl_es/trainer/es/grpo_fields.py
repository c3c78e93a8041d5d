"""Every field of TRL's ``GRPOConfig`` answered by ``ESConfig``, and the translation of a GRPO recipe onto ES's fields.

A ``GRPOConfig`` field is a ``TrainingArguments`` field, an ``ESConfig`` field of GRPO's name and meaning (*honoured*,
its ``help`` says how), or an entry of :data:`GRPO_FIELDS`: *mapped* onto ``prompt_batch_size``, *ignored* (named in
one warning) or *refused* (``ValueError``). ``python scripts/grpo_fields_markdown.py > docs/grpo_fields.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ...arguments import check_int
from ...generation import resolve_pad_to_multiple_of


__all__ = ["GRPO_FIELDS", "GRPOField", "GRPOTranslation", "added_fields", "answer_grpo_fields", "check_optional_counts",
           "collect_error", "field_errors_message", "grpo_field_errors", "grpo_field_notices", "grpo_fields_plan",
           "ignored_fields", "notices_message", "raise_field_errors", "refused_fields", "translate_grpo_fields"]

HONOURED = "honoured"  # an ESConfig field of GRPO's name and meaning, described by its help (no entry here)
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
    """How ``ESConfig`` answers a ``GRPOConfig`` field it does not declare with GRPO's meaning."""

    name: str  # the GRPOConfig field
    status: str  # "mapped" (onto prompt_batch_size), "ignored" (accepted, never read, warned about) or "refused"
    reason: str  # why ES has no such thing, or how it is mapped
    counterpart: str | None = None  # the ES setting to use instead
    type: str = "str"  # annotation of the ESConfig field answer_grpo_fields adds ("| None" appended)
    accepted: tuple = ()  # values under which GRPO does what ES does: accepted silently, as None is
    same_as: str | None = None  # also accepted when equal to this ESConfig field
    not_yet: bool = False  # refused because ES does not implement it yet, not because it has no meaning

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
        """The ``metadata["help"]`` of the ``ESConfig`` field :func:`answer_grpo_fields` adds."""
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
#: The ``GRPOConfig`` fields that are neither ``TrainingArguments`` fields nor ``ESConfig`` fields of GRPO's name and
#: meaning, in ``GRPOConfig``'s order: each mapped, ignored or refused, with the reason and the ES counterpart.
GRPO_FIELDS: tuple[GRPOField, ...] = (
    # ------------------------------------------------------------------ model
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
    _ignored("ds3_gather_for_generation", "under DeepSpeed ZeRO-3 ES generates with DeepSpeed's per-layer gathering "
                                          "(as ds3_gather_for_generation=False): the same completions, another "
                                          "speed and memory.",
             "none needed (ES's ZeRO-3 generation: docs/scaling.md)", type="bool", accepted=(False,)),
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
    _ignored("cache_implementation", "the KV cache is chosen by ES's generation engine (the same completions).",
             "generation_engine ('compiled': static KV cache and a compiled decoding step; 'eager'), or "
             "generation_kwargs={'cache_implementation': ...} with generation_engine='eager'"),
    # ------------------------------------------------------------------ vLLM
    _ignored("vllm_enable_sleep_mode", "the colocated engine stays resident: ES scores members back to back, with no "
                                       "optimizer step to free memory for.",
             "vllm_gpu_memory_utilization (the engine's share of GPU memory)", type="bool", accepted=(False,)),
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
    _refused("log_multimodal", "ES trains text-only models: completion logs hold no images or videos.",
             type="bool", accepted=(True, False)),
    _ignored("vllm_importance_sampling_cap", "deprecated in TRL (vllm_importance_sampling_clip_max). " + _VLLM_IS,
             type="float"),
)

# import-time checks of the table
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
    """The entries of :data:`GRPO_FIELDS` (mapped, ignored, refused): the fields :func:`answer_grpo_fields` adds."""
    return GRPO_FIELDS


def answer_grpo_fields(cls: type) -> type:
    """Class decorator (under ``@dataclass``): add every entry of :data:`GRPO_FIELDS` to ``cls`` as a field defaulting
    to ``None``, its ``help`` from the entry (so it gets a flag, a YAML key and a docstring entry).

    Raises:
        TypeError: if ``cls`` declares one of them itself.
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


def collect_error(errors: list[str], check, *args) -> None:
    """Run ``check(*args)``; append the message of a ``ValueError`` it raises to ``errors``."""
    try:
        check(*args)
    except ValueError as error:
        errors.append(str(error))


def check_optional_counts(config: Any, *names: str) -> None:
    """Each of ``names`` is ``None`` or an integer >= 1 (a bool is not a count).

    Raises:
        ValueError: naming the first field that is not, and its value.
    """
    for name in names:
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}.")


# ---------------------------------------------------------------------------------------------- the translation
#: ``temperature`` of a config that leaves it unset (``None``) and asks for sampling (GRPO's default).
GRPO_TEMPERATURE = 1.0
#: ``prompt_batch_size`` of a config that sets neither it nor any of GRPO's batch fields.
DEFAULT_PROMPT_BATCH_SIZE = 8
#: GRPO's ``per_device_train_batch_size`` (TrainingArguments' default), in the mapping when another batch field is set.
GRPO_PER_DEVICE_TRAIN_BATCH_SIZE = 8
#: The batch fields: ``prompt_batch_size`` from GRPO's when those are set, the other two from it.
BATCH_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "prompt_batch_size")
#: The fields :func:`translate_grpo_fields` rewrites: :class:`GRPOTranslation` keeps the user's values of them.
TRANSLATED_FIELDS = ("temperature", "generation_kwargs", *BATCH_FIELDS)
_NEUTRAL = (("top_k", 0), ("min_p", None), ("repetition_penalty", 1.0))  # GRPO's generation fields, at "off"


def _copy(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value  # so an in-place edit of the config's dict shows


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


@dataclass
class GRPOTranslation:
    """A config's record of its translation (``ESConfig.grpo_translation``; pickled with it, not in ``to_dict()``)."""

    given: dict[str, Any]  # the user's value of each of TRANSLATED_FIELDS (None: unset)
    derived: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the last translation wrote in its place
    mapping: str | None = None  # GRPO's batch fields mapped, in words (None: none was set)
    said: set[str] = dataclasses.field(default_factory=set)  # the warnings and logs emitted: each once

    @classmethod
    def given_by(cls, config: Any, **values: Any) -> GRPOTranslation:
        """A record of ``config``'s values as given; ``values``: those it no longer holds."""
        return cls({name: _copy(values[name] if name in values else getattr(config, name))
                    for name in TRANSLATED_FIELDS})

    def user_values(self, config: Any) -> dict[str, Any]:
        """:data:`TRANSLATED_FIELDS` as the user gave them (``generation_kwargs`` without what was merged in)."""
        values = {}
        for name in TRANSLATED_FIELDS:
            now = getattr(config, name)  # differs from the value written: assigned since, the user's
            values[name] = now if name in self.derived and now != self.derived[name] else self.given[name]
        derived, given = (_dict(self.derived.get("generation_kwargs")), _dict(self.given["generation_kwargs"]))
        added = {key: value for key, value in derived.items() if key not in given}  # merged in from top_k, ...
        if added and isinstance(values["generation_kwargs"], dict):  # a second call replaces them, not merges twice
            values["generation_kwargs"] = {key: value for key, value in values["generation_kwargs"].items()
                                           if key not in added or added[key] != value}
        return values


def translate_grpo_fields(config: Any, errors: list[str]) -> list[str]:
    """Write ``config``'s GRPO fields as ES reads them, from the user's values (idempotent; a field assigned since the
    last call counts as given).

    Returns:
        `list[str]`: The log lines not emitted before. Each error (naming the field) is appended to ``errors``.
    """
    if config.grpo_translation is None:  # unpickled without a record: given as it is, the batch from prompt_batch_size
        config.grpo_translation = GRPOTranslation.given_by(config, per_device_train_batch_size=None,
                                                           gradient_accumulation_steps=1)
    record = config.grpo_translation
    user, notes = record.user_values(config), []
    _resolve_temperature(config, user, notes)
    _apply_generation_fields(config, user["generation_kwargs"], errors)  # top_k, min_p, ... into generation_kwargs
    collect_error(errors, _resolve_pad_to_multiple_of, config)
    collect_error(errors, _apply_model_and_data_fields, config)  # trust_remote_code, shuffle_dataset
    collect_error(errors, _map_batch, config, user, record, notes)  # GRPO's batch fields onto prompt_batch_size
    record.given = {name: _copy(value) for name, value in user.items()}
    record.derived = {name: _copy(getattr(config, name)) for name in TRANSLATED_FIELDS}
    notes = [note for note in notes if note not in record.said]
    record.said.update(notes)
    return notes


def _resolve_temperature(config: Any, user: dict[str, Any], notes: list[str]) -> None:
    # unset: GRPO's 1.0 when the config asks for sampling, else the ES reference's greedy 0.0 (num_generations=1
    # stays greedy bit for bit)
    if user["temperature"] is not None:  # an explicit one is kept
        config.temperature = user["temperature"]
        return
    # several completions of a prompt, or a sampling-only filter, ask for sampling
    asks = [f"{name}={getattr(config, name)}" for name in ("num_generations", "num_generations_eval")
            if _count(getattr(config, name)) > 1]
    asks += [f"{name}={getattr(config, name)!r}" for name, off in _NEUTRAL[:2] if getattr(config, name) != off]
    kwargs = user["generation_kwargs"] if isinstance(user["generation_kwargs"], dict) else {}
    sample = bool(asks) and not kwargs.get("do_sample")  # generation_kwargs with do_sample=True set the sampling
    config.temperature = GRPO_TEMPERATURE if sample else 0.0
    if sample:
        notes.append(f"temperature is unset and {', '.join(asks)} asks for sampling: sampling at GRPO's default "
                     f"temperature={GRPO_TEMPERATURE} (ES's own default, for one greedy completion per prompt, is "
                     "0.0). Set temperature to choose another.")


def _count(value: Any) -> int:  # an int field's value; 0 for anything else (checked elsewhere)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _apply_generation_fields(config: Any, user_kwargs: Any, errors: list[str]) -> None:
    """Check GRPO's generation fields and merge ``top_k``, ``min_p``, ``repetition_penalty`` into
    ``generation_kwargs``."""
    if config.temperature < 0:
        errors.append(f"temperature must be >= 0 (0 = greedy), got {config.temperature}.")
    if not 0 < config.top_p <= 1:
        errors.append(f"top_p must be in (0, 1], got {config.top_p}.")
    if isinstance(config.top_k, bool) or not isinstance(config.top_k, int) or config.top_k < 0:
        errors.append(f"top_k must be an integer >= 0 (0 = off, as in GRPO), got {config.top_k!r}.")
    if config.min_p is not None and not 0 <= config.min_p <= 1:
        errors.append(f"min_p must be None or in [0, 1], got {config.min_p}.")
    if not config.repetition_penalty > 0:
        errors.append(f"repetition_penalty must be > 0 (1.0 = off), got {config.repetition_penalty}.")
    limit = config.max_tool_calling_iterations
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        errors.append(f"max_tool_calling_iterations must be None (no limit) or an integer >= 0, got {limit!r}.")
    kwargs = user_kwargs if isinstance(user_kwargs, dict) else {}
    if not (config.temperature > 0 or kwargs.get("do_sample")):  # greedy: sampling settings and copies are refused
        for name, off in _NEUTRAL[:2]:
            if getattr(config, name) != off:
                errors.append(f"{name}={getattr(config, name)!r} filters tokens when sampling, but temperature=0 "
                              f"decodes greedily: set temperature > 0 (e.g. 1.0, GRPO's default, which an unset "
                              f"temperature resolves to) to sample, or leave {name} at {off!r}.")
        for name in ("num_generations", "num_generations_eval"):
            count = getattr(config, name)
            if count is not None and count > 1:
                errors.append(f"{name}={count} with greedy decoding (temperature=0) would score {count} identical "
                              "copies of each completion: set temperature > 0 (e.g. 1.0, GRPO's default, which an "
                              f"unset temperature resolves to) to sample different completions, or {name}=1.")
    # values at "off" add nothing; a key the user's generation_kwargs holds wins, as in GRPO
    merged = {name: getattr(config, name) for name, off in _NEUTRAL if getattr(config, name) != off}
    config.generation_kwargs = ({**merged, **kwargs} or None) if merged else user_kwargs


def _resolve_pad_to_multiple_of(config: Any) -> None:
    # as GRPOConfig: "auto" -> None (it pads only on AWS Neuron), "64" -> 64
    config.pad_to_multiple_of = resolve_pad_to_multiple_of(config.pad_to_multiple_of)


def _apply_model_and_data_fields(config: Any) -> None:
    """GRPO's ``trust_remote_code`` (into ``model_init_kwargs``) and ``shuffle_dataset`` (as
    ``train_sampling_strategy``).

    Raises:
        ValueError: naming both fields when they contradict each other.
    """
    if config.trust_remote_code:  # into model_init_kwargs, as GRPO loads the model
        init_kwargs = dict(config.model_init_kwargs or {})
        if init_kwargs.get("trust_remote_code", True) is not True:
            raise ValueError("trust_remote_code=True contradicts model_init_kwargs={'trust_remote_code': "
                             f"{init_kwargs['trust_remote_code']!r}}}: set one of them.")
        init_kwargs["trust_remote_code"] = True
        config.model_init_kwargs = init_kwargs
    if config.shuffle_dataset is not None:  # as train_sampling_strategy
        strategy = getattr(config.train_sampling_strategy, "value", config.train_sampling_strategy)
        wanted = "random" if config.shuffle_dataset else "sequential"
        if strategy not in ("random", wanted):
            raise ValueError(f"shuffle_dataset={config.shuffle_dataset} contradicts train_sampling_strategy="
                             f"{strategy!r}: set train_sampling_strategy alone ('random' shuffles, 'sequential' "
                             "keeps the dataset order), or shuffle_dataset alone.")
        config.train_sampling_strategy = wanted


def _map_batch(config: Any, user: dict[str, Any], record: GRPOTranslation, notes: list[str]) -> None:
    """``prompt_batch_size``: GRPO's prompts per optimizer step when any of GRPO's batch fields is set, else as given
    (8 when unset); ``per_device_train_batch_size`` then ``prompt_batch_size / processes``.

    Raises:
        ValueError: naming the fields: what GRPO refuses too, a GRPO step that is not whole prompts, a
            ``prompt_batch_size`` that disagrees with GRPO's batch fields or does not split over the processes.
    """
    per_device, accumulation, prompts = (user[name] for name in BATCH_FIELDS)
    if prompts is not None:
        check_int("prompt_batch_size", prompts, 1)
    world, mapping = config.world_size, None
    if (per_device is not None or accumulation != 1 or config.generation_batch_size is not None
            or config.steps_per_generation is not None):
        # TRL 1.16: per_device_train_batch_size x processes x gradient_accumulation_steps / num_generations
        mapped, mapping = _grpo_prompts(config, per_device, accumulation, world)
        if prompts is not None and prompts != mapped:
            raise ValueError(f"prompt_batch_size={prompts} contradicts GRPO's batch fields, {mapping[0]} = {mapped} "
                             "prompts per optimizer step. Set prompt_batch_size alone (ES's prompts per iteration) or "
                             "GRPO's batch fields alone, or make them agree.")
        prompts = mapped
    elif prompts is None:
        prompts = DEFAULT_PROMPT_BATCH_SIZE
    if prompts % world:
        source = f" (GRPO's batch fields: {mapping[0]})" if mapping else ""
        raise ValueError(f"prompt_batch_size ({prompts}{source}) must be divisible by the number of processes "
                         f"({world}): each process loads prompt_batch_size / {world} whole prompts, then all share "
                         "them (GRPO may split a prompt's completions over processes; ES cannot).")
    config.prompt_batch_size = prompts
    config.per_device_train_batch_size = prompts // world  # what each process's dataloader loads
    config.gradient_accumulation_steps = 1  # a step is one ES iteration
    record.mapping = mapping[0] if mapping else None
    if mapping:
        notes.append(f"GRPO's batch fields mapped to prompt_batch_size={prompts}: {mapping[1]}")


def _grpo_prompts(config: Any, per_device: int | None, accumulation: int, world: int) -> tuple[int, tuple[str, str]]:
    """GRPO's prompts per optimizer step, and the mapping in words: ``(formula, explanation)``.

    Raises:
        ValueError: as :func:`_map_batch`.
    """
    if per_device is not None:
        check_int("per_device_train_batch_size", per_device, 1)
    check_int("gradient_accumulation_steps", accumulation, 1)
    check_optional_counts(config, "generation_batch_size", "steps_per_generation")
    generations = config.num_generations
    check_int("num_generations", generations, 1)
    size = per_device if per_device is not None else GRPO_PER_DEVICE_TRAIN_BATCH_SIZE
    global_batch = size * world
    steps, generation = config.steps_per_generation, config.generation_batch_size
    if generation is not None and steps is not None:
        raise ValueError(f"generation_batch_size={generation} and steps_per_generation={steps} cannot both be set "
                         "(GRPO refuses it too): set one of them.")
    if generation is not None:
        if generation % global_batch:
            raise ValueError(f"generation_batch_size ({generation}) must be divisible by the global batch size "
                             f"per_device_train_batch_size x processes = {size} x {world} = {global_batch} (GRPO "
                             "refuses it too).")
        steps = generation // global_batch  # optimizer steps per generation batch
    elif steps is None:
        steps = accumulation  # GRPO's default: one generation batch per optimizer step
    generation = global_batch * steps
    if generation % generations:
        raise ValueError(f"generation_batch_size ({generation} = per_device_train_batch_size {size} x {world} "
                         f"processes x steps_per_generation {steps}) must be divisible by num_generations "
                         f"({generations}) (GRPO refuses it too): a generation batch holds whole prompts.")
    completions = global_batch * accumulation  # one GRPO optimizer step's
    processes = f"{world} process{'es' if world > 1 else ''}"
    grpo_step = (f"per_device_train_batch_size={size}{'' if per_device is not None else ' (unset: GRPO default)'}"
                 f" x {processes} x gradient_accumulation_steps={accumulation}")
    if completions % generations:
        raise ValueError(f"GRPO's batch fields cannot be mapped: one GRPO optimizer step holds {grpo_step} = "
                         f"{completions} completions, not a whole number of prompts at num_generations={generations} "
                         "(GRPO spreads a prompt's completions over optimizer steps here), but an ES iteration scores "
                         "whole prompts. Make that product a multiple of num_generations, or set prompt_batch_size "
                         "instead of GRPO's batch fields.")
    prompts = completions // generations
    formula = f"{grpo_step} / num_generations={generations}"
    words = (f"one GRPO optimizer step holds {grpo_step} = {completions} completions, {completions} / "
             f"num_generations={generations} = {prompts} prompts; each ES iteration scores every member on {prompts} "
             f"prompts, {generations} completion(s) each. per_device_train_batch_size is now "
             f"{prompts // world if prompts % world == 0 else '-'} (prompts per process) and "
             "gradient_accumulation_steps 1.")
    if config.generation_batch_size is not None or config.steps_per_generation is not None:
        words += (f" generation_batch_size={generation} (steps_per_generation={steps}): GRPO generates {generation} "
                  f"completions at a time and spends them over {steps}/{accumulation} optimizer step(s); ES generates "
                  "afresh for every iteration, with the same prompts per update.")
    return prompts, (formula, words)


def grpo_fields_plan(config: Any) -> dict[str, list[str]]:
    """GRPO's fields ``config`` mapped or ignores, for the plan ``ESTrainer.train()`` prints.

    Returns:
        `dict`: ``"mapped"``: the batch mapping lines (``"... -> prompt_batch_size=4"``); ``"ignored"``: ``name=value``
        of each ignored field warned about.
    """
    mapping = config.grpo_translation.mapping if config.grpo_translation is not None else None
    mapped = [f"{mapping} -> prompt_batch_size={config.prompt_batch_size}"] if mapping else []
    for name in ("generation_batch_size", "steps_per_generation"):
        if mapping and getattr(config, name) is not None:
            mapped.append(f"{name}={getattr(config, name)} (how GRPO reuses a generation batch: ES generates afresh "
                          "every iteration)")
    ignored = [f"{e.name}={getattr(config, e.name)!r}" for e in ignored_fields()
               if not e.accepts(getattr(config, e.name), config)]
    return {"mapped": mapped, "ignored": ignored}
