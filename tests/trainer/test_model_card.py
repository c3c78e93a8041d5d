"""The model card (README.md) ESTrainer writes as GRPOTrainer does: in output_dir before every checkpoint, on
push_to_hub, and beside every model save_model writes; TRL's card with the ES settings, the seed-log note and the
papers to cite."""

from pathlib import Path

import huggingface_hub.constants
import pytest
from datasets import Dataset
from hub_cache import add_dataset
from peft import LoraConfig
from tiny import build_llama
from transformers import TrainerCallback

from trl_es import ESConfig, ESTrainer
from trl_es.trainer.es.model_card import hub_dataset_id


BASE = "Qwen/Qwen2.5-0.5B-Instruct"
COUNTDOWN = "Jiayi-Pan/Countdown-Tasks-3to4"
ES_CITATION = "eprint  = {arXiv:2509.24372}"
AWD_CITATION = "eprint  = {arXiv:2605.30148}"


def es_args(output_dir, **kwargs):
    return ESConfig(output_dir=str(output_dir), **{
        "max_steps": 2, "population_size": 4, "prompt_batch_size": 2, "max_completion_length": 4, "sigma": 0.02,
        "learning_rate": 0.02, "report_to": [], "save_strategy": "no", "noise_table_size": 1 << 20,
        "disable_tqdm": True, "seed": 0, **kwargs})


def hub_model(tokenizer, repo_id=BASE):
    """A tiny model as ``from_pretrained(repo_id)`` returns it (its config names the hub id)."""
    model = build_llama(tokenizer)
    model.config._name_or_path = repo_id
    return model


def length_reward(completions, **kwargs):
    return [len(c) / 8 for c in completions]


@pytest.fixture
def hub_countdown(tmp_path, monkeypatch):
    """Countdown-Tasks-3to4 as ``load_dataset`` leaves it after a download: the arrow file in the datasets cache
    (``Jiayi-Pan___countdown-tasks-3to4``) and the repo's folder in the hub cache."""
    home = tmp_path / "hf"
    rows = [{"target": 10 + i, "nums": [i, 5, 5], "prompt": f"Use {i}, 5, 5 to make {10 + i}."} for i in range(4)]
    folder = add_dataset(home, COUNTDOWN, {"train": rows})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    return Dataset.from_file(str(folder / "countdown-tasks-3to4-train.arrow"))


class ReadmeAtSave(TrainerCallback):
    """Whether output_dir/README.md existed at each checkpoint save, and its text."""

    def __init__(self):
        self.seen = []

    def on_save(self, args, state, control, **kwargs):
        readme = Path(args.output_dir) / "README.md"
        self.seen.append((state.global_step, readme.read_text() if readme.is_file() else None))


def test_every_checkpoint_save_writes_the_card(tmp_path, tokenizer, hub_countdown):
    output_dir = tmp_path / "es-countdown"
    saves = ReadmeAtSave()
    trainer = ESTrainer(hub_model(tokenizer), length_reward, train_dataset=hub_countdown, processing_class=tokenizer,
                        args=es_args(output_dir, save_strategy="steps", save_steps=1), callbacks=[saves])
    trainer.train()
    assert [step for step, _ in saves.seen] == [1, 2]
    for _, card in saves.seen:
        assert card is not None
        assert "# Model Card for es-countdown" in card
        assert f"fine-tuned version of [{BASE}](https://huggingface.co/{BASE})" in card
        assert f"on the [{COUNTDOWN}](https://huggingface.co/datasets/{COUNTDOWN}) dataset" in card
        for setting in ("| `population_size` | `4` |", "| `sigma` | `0.02` |", "| `learning_rate` | `0.02` |",
                        "| `prompt_batch_size` | `2` |", "| `es_optimizer` | `'es'` |", "| `awd_lambda` | `0.0` |"):
            assert setting in card, setting
        assert "`awd_penalty`" not in card  # only with awd_lambda > 0
        assert "### Seed log" in card and f'from_pretrained("{BASE}")' in card
        assert "This model was trained with ES, a method introduced in [Evolution Strategies at Scale" in card
        assert ES_CITATION in card and AWD_CITATION not in card
        assert "- trl-es" in card and "- evolution-strategies" in card and f"datasets: {COUNTDOWN}" in card  # metadata
        assert card.index("### Evolution Strategies settings") < card.index("### Framework versions")
    assert not (output_dir / "checkpoint-1" / "README.md").exists()  # as GRPO: the card is in output_dir only


def test_save_model_writes_the_card_beside_the_model_peft_and_an_unnamed_dataset(tmp_path, tokenizer):
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = ESTrainer(hub_model(tokenizer, "HuggingFaceTB/SmolLM2-135M-Instruct"), length_reward,
                        train_dataset=Dataset.from_list([{"prompt": f"Say {i}"} for i in range(4)]),
                        processing_class=tokenizer, peft_config=peft_config,
                        args=es_args(tmp_path / "out", max_steps=1, awd_lambda=2.0, sigma=0.01))
    trainer.train()
    assert not (tmp_path / "out" / "README.md").exists()  # save_strategy="no": no checkpoint, no card yet
    trainer.save_model(str(tmp_path / "final"))
    card = (tmp_path / "final" / "README.md").read_text()  # ours, written over PEFT's adapter card
    assert "# Model Card for final" in card
    assert "fine-tuned version of [HuggingFaceTB/SmolLM2-135M-Instruct]" in card
    assert "huggingface.co/datasets" not in card and "\ndatasets:" not in card  # no dataset id, none in the metadata
    for setting in ("| `sigma` | `0.01` |", "| `awd_lambda` | `2.0` |", "| `awd_penalty` | `'l2'` |"):
        assert setting in card, setting
    assert "the PEFT adapter's parameters" in card
    assert ES_CITATION in card and AWD_CITATION in card
    assert card.index(AWD_CITATION) < card.index("Cite TRL as:")
    trainer.create_model_card(model_name="es-smol", dataset_name="my-org/my-prompts")  # TRL's call, as push_to_hub
    card = (tmp_path / "out" / "README.md").read_text()
    assert "# Model Card for es-smol" in card
    assert "on the [my-org/my-prompts](https://huggingface.co/datasets/my-org/my-prompts) dataset" in card


def test_hub_dataset_id(tmp_path, monkeypatch, hub_countdown):
    assert hub_dataset_id(hub_countdown) == COUNTDOWN  # the case of the id from the hub cache's folder
    assert hub_dataset_id(Dataset.from_list([{"prompt": "a"}])) is None  # in memory
    recorded = Dataset.from_list([{"prompt": "a"}])
    recorded.info.download_checksums = {"hf://datasets/openai/gsm8k@e53f048856ff4f594e959d75785d2c2d37b678ee/main/"
                                        "train-00000-of-00001.parquet": {"num_bytes": 1, "checksum": None}}
    assert hub_dataset_id(recorded) == "openai/gsm8k"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    assert hub_dataset_id(hub_countdown) is None  # no hub cache folder: the snake-cased name cannot be undone
