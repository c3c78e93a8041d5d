"""ESTrainer's model card: TRL's card (:func:`trl.trainer.utils.generate_model_card`) with ES's settings, the seed-log
note and, with ``awd_lambda > 0``, AWD's BibTeX.

Written as GRPOTrainer writes it, before every checkpoint and on ``push_to_hub``, and beside every ``save_model``
(the hooks: :class:`~trl_es.trainer.es.es_checkpoint.ESCheckpointMixin`).
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

from transformers import is_wandb_available
from trl.trainer.utils import (
    generate_model_card,
    get_comet_experiment_url,
    get_config_model_id,
    get_trackio_space_url,
)

from ...es.seedlog import SEED_LOG_NAME
from ...files import atomic_path
from ...quantized import HEADER_KEY


__all__ = ["AWD_PAPER", "CARD_SETTINGS", "es_card_sections", "es_card_text", "hub_dataset_id", "model_card_name",
           "write_model_card"]

#: The ESConfig fields the card lists, in this order (``awd_penalty`` only with ``awd_lambda > 0``).
CARD_SETTINGS = (
    "population_size", "sigma", "learning_rate", "lr_scheduler_type", "prompt_batch_size", "num_generations",
    "temperature", "max_completion_length", "fitness_shaping", "per_prompt_shaping", "antithetic", "es_optimizer",
    "noise_source", "population_backend", "awd_lambda", "awd_penalty", "max_steps", "num_train_epochs", "seed",
)

#: Anchored Weight Decay (``awd_lambda > 0``): Schweighofer et al. 2026.
AWD_PAPER = {
    "title": "Overcoming Forgetting in LLM Fine-Tuning with Evolution Strategies",
    "id": "2605.30148",
    "citation": textwrap.dedent("""\
        @article{schweighofer2026overcoming,
            title   = {{Overcoming Forgetting in LLM Fine-Tuning with Evolution Strategies}},
            author  = {Kajetan Schweighofer and Conor F. Hayes and Roberto Dailey and Risto Miikkulainen and Xin Qiu},
            year    = 2026,
            eprint  = {arXiv:2605.30148}
        }"""),
}

_HUB_URL = re.compile(r"^hf://datasets/([^/@]+/[^/@]+)@")


def hub_dataset_id(dataset) -> str | None:
    """The hub id (``org/Name``) a ``datasets`` dataset was loaded from, where the dataset tells it exactly.

    Returns:
        `str` or `None`: ``None`` for a dataset built in memory (``Dataset.from_list``), from local files, or whose
        id cannot be told.
    """
    from datasets.naming import camelcase_to_snakecase
    from huggingface_hub.constants import HF_HUB_CACHE

    info = getattr(dataset, "info", None)
    # the hub URLs of its source files, recorded when datasets records checksums
    for url in (getattr(info, "download_checksums", None) or {}):
        if match := _HUB_URL.match(str(url)):
            return match[1]
    # else its cache folder <org>___<snake_name> (trl-lib/DeepMath-103K -> trl-lib___deep_math-103_k) matched
    # against the hub cache's datasets--<org>--<Name>, which keeps the id's case
    files = getattr(dataset, "cache_files", None) or []
    parts = [part for part in Path(files[0]["filename"]).parts if "___" in part] if files else []
    if not parts:
        return None
    org, snake_name = parts[-1].split("___", 1)
    hub = Path(HF_HUB_CACHE)
    prefix = f"datasets--{org}--"
    names = [p.name[len(prefix):] for p in hub.glob(f"{prefix}*")] if hub.is_dir() else []
    matches = [name for name in names if camelcase_to_snakecase(name) == snake_name]
    return f"{org}/{matches[0]}" if len(matches) == 1 else None


def _value(value) -> str:
    """A setting as the card shows it, in code: an enum's value; strings quoted."""
    value = getattr(value, "value", value)  # an enum's value
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def es_card_sections(args, base_model: str | None, peft: bool, quantized: bool = False) -> str:
    """The card's ES sections (markdown) for ``args``: a table of :data:`CARD_SETTINGS` and the seed-log note, with a
    replay snippet from ``base_model`` (a hub id; wrapped with its PEFT adapter if ``peft``; loaded with the seed
    log's quantization config if ``quantized``)."""
    names = [n for n in CARD_SETTINGS if n != "awd_penalty" or args.awd_lambda > 0]  # the penalty only with AWD on
    rows = "\n".join(f"| `{name}` | {_value(getattr(args, name))} |" for name in names)
    trained = "the PEFT adapter's parameters (the base weights are frozen)" if peft else "the model's weights"
    model = f'"{base_model}"' if base_model else '"<base model>"'
    adapter = ", wrapped with its initial PEFT adapter" if peft else ""
    if args.es_optimizer == "es" and quantized:  # the base as the header records it (trl_es.quantized)
        replay = textwrap.dedent(f"""\
            With `es_optimizer="es"` the trained adapter is the initial one plus this log, bitwise, over the base
            quantized as the log's header records:

            ```python
            from transformers import AutoModelForCausalLM
            from trl_es import replay
            from trl_es.es import SeedLog
            from trl_es.quantized import quantization_config_from_header

            config = quantization_config_from_header(SeedLog.load("{SEED_LOG_NAME}").header)
            model = AutoModelForCausalLM.from_pretrained({model}, quantization_config=config)  # the base{adapter}
            replay(model, "{SEED_LOG_NAME}")
            ```""")
    elif args.es_optimizer == "es":  # the seed log alone rebuilds the weights
        replay = textwrap.dedent(f"""\
            With `es_optimizer="es"` the trained weights are the base model plus this log, bitwise:

            ```python
            from transformers import AutoModelForCausalLM
            from trl_es import replay

            model = AutoModelForCausalLM.from_pretrained({model})  # the base model{adapter}
            replay(model, "{SEED_LOG_NAME}")
            ```""")
    else:
        replay = ("This run stepped a torch optimizer (`es_optimizer=\"torch\"`), whose state is not in the log: "
                  "`trl_es.replay` cannot rebuild it; the checkpoints hold the weights and `optimizer.pt`.")
    return textwrap.dedent("""\
        ### Evolution Strategies settings

        Each training step is one ES iteration: `population_size` perturbed copies `theta + sigma * eps_i` of
        {trained} generate for the same `prompt_batch_size` prompts and are scored by the reward functions; the
        shaped rewards weight the update `theta += learning_rate / population_size * sum_i z_i eps_i`.

        | Setting | Value |
        |---|---|
        {rows}

        ### Seed log

        `{log}` (in this folder and in every checkpoint) records the whole run in a few kilobytes: a header (noise
        source, sigma, the trained parameters' names, the settings a resumed run is checked against) and one line per
        ES step with the members' seeds and signs, their shaped coefficients and the learning rate.
        {replay}
        """).format(trained=trained, rows=rows, log=SEED_LOG_NAME, replay=replay)


def model_card_name(args, folder: str) -> str:
    """The card's model name, as GRPOTrainer names it: ``hub_model_id``'s last part, else the folder's name."""
    return Path(folder).name if args.hub_model_id is None else args.hub_model_id.split("/")[-1]


def write_model_card(trainer, folder: str, model_name: str | None = None, dataset_name: str | None = None,
                     tags: str | list[str] | None = None) -> None:
    """Write ``folder/README.md`` for an ESTrainer (main process, atomically): TRL's card with :func:`es_card_text`.

    Args:
        trainer (`ESTrainer`): The trainer.
        folder (`str`): Where ``README.md`` goes.
        model_name (`str`, *optional*): The trained model's name.
        dataset_name (`str`, *optional*): The training dataset's hub id; default :func:`hub_dataset_id`'s.
        tags (`str` or `list[str]`, *optional*): Tags besides the trainer's ``_tag_names``.
    """
    if not trainer.is_world_process_zero():
        return
    # the arguments of generate_model_card as TRL's _BaseTrainer.create_model_card builds them
    from peft import PeftModel

    model_id = get_config_model_id(trainer.model.config)
    base_model = model_id if model_id and not os.path.isdir(model_id) else None  # not a local folder
    if dataset_name is None:
        dataset_name = hub_dataset_id(getattr(trainer.train_dataset, "dataset", trainer.train_dataset))
    tags = set() if tags is None else {tags} if isinstance(tags, str) else set(tags)  # a str is one tag
    if hasattr(trainer.model.config, "unsloth_version"):
        tags.add("unsloth")
    if "JOB_ID" in os.environ:
        tags.add("hf_jobs")
    tags.update(trainer._tag_names)
    trackio_url = get_trackio_space_url()
    if trackio_url is not None:  # TRL's: the Trackio tag carries the run's url
        tags = {tag for tag in tags if not tag.startswith("trackio:")} | {f"trackio:{trackio_url}"}
    wandb_url = None
    if is_wandb_available():
        import wandb

        wandb_url = wandb.run.url if wandb.run is not None else None
    card = generate_model_card(
        base_model=base_model, model_name=model_name, hub_model_id=trainer.hub_model_id, dataset_name=dataset_name,
        tags=sorted(tags), wandb_url=wandb_url, trackio_url=trackio_url, comet_url=get_comet_experiment_url(),
        trainer_name=trainer._name, trainer_citation=trainer._paper.get("citation"),
        template_file=trainer._template_file, paper_title=trainer._paper.get("title"),
        paper_id=trainer._paper.get("id"),
    )
    peft = isinstance(trainer.accelerator.unwrap_model(trainer.model), PeftModel)
    quantized = HEADER_KEY in trainer.seed_log.header  # the base was loaded quantized
    card.text = es_card_text(card.text, trainer.args, base_model, peft, quantized)
    with atomic_path(os.path.join(folder, "README.md")) as tmp:
        card.save(tmp)


def es_card_text(text: str, args, base_model: str | None, peft: bool, quantized: bool = False) -> str:
    """TRL's card body with :func:`es_card_sections` before "### Framework versions" and, with ``awd_lambda > 0``,
    AWD's BibTeX before TRL's (each at the end where the template has no such heading)."""
    sections = es_card_sections(args, base_model, peft, quantized)
    # before "### Framework versions", or at the end of a template without that heading
    head, sep, tail = text.partition("### Framework versions")
    text = f"{head}{sections}\n{sep}{tail}" if sep else f"{text}\n{sections}"
    if args.awd_lambda > 0:
        awd = (f"The weights were anchored with AWD (`awd_lambda={args.awd_lambda}`), introduced in "
               f"[{AWD_PAPER['title']}](https://huggingface.co/papers/{AWD_PAPER['id']}). Cite AWD as:\n\n"
               f"```bibtex\n{AWD_PAPER['citation']}\n```\n\n")
        head, sep, tail = text.partition("Cite TRL as:")  # AWD's BibTeX after ES's, before TRL's
        text = f"{head}{awd}{sep}{tail}" if sep else f"{text}\n{awd}"
    return text
