"""The name swaps that turn each GRPO script of examples/grpo_scripts/ into its ES version (``old`` -> ``new``, each
``old`` found in the verbatim source, tests/data/grpo_scripts/<script>.py.txt). Only class names and the import of
them change: ``GRPOConfig`` -> ``ESConfig``, ``GRPOTrainer`` -> ``ESTrainer``, imported from ``trl_es``.

:data:`PORTS` holds the changes TRL 1.16 itself needs (the script fails on GRPOTrainer too without them), each with
the reason; they are applied after the swaps."""

SWAPS = {
    "trl_grpo": [
        ("    from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config\n",
         "    from trl import get_dataset, get_peft_config, get_quantization_config\n"
         "    from trl_es import ESTrainer\n"),
        ("    trainer = GRPOTrainer(\n", "    trainer = ESTrainer(\n"),
        ("    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser\n",
         "    from trl import DatasetMixtureConfig, ModelConfig, TrlParser\n    from trl_es import ESConfig\n"),
        ("    dataclass_types = (GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig)\n",
         "    dataclass_types = (GRPOScriptArguments, ESConfig, ModelConfig, DatasetMixtureConfig)\n"),
    ],
    "gspo": [
        ("from trl import (\n    GRPOConfig,\n    GRPOTrainer,\n    ModelConfig,",
         "from trl import (\n    ModelConfig,"),
        ("from trl.rewards import accuracy_reward, think_format_reward\n",
         "from trl.rewards import accuracy_reward, think_format_reward\nfrom trl_es import ESConfig, ESTrainer\n"),
        ("    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))\n",
         "    parser = TrlParser((ScriptArguments, ESConfig, ModelConfig))\n"),
        ("    trainer = GRPOTrainer(\n", "    trainer = ESTrainer(\n"),
    ],
    "grpo_continuous_batching": [
        ("from trl import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config\n",
         "from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config\n"
         "from trl_es import ESConfig, ESTrainer\n"),
        ("    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))\n",
         "    parser = TrlParser((ScriptArguments, ESConfig, ModelConfig))\n"),
        ("    trainer = GRPOTrainer(\n", "    trainer = ESTrainer(\n"),
    ],
    "grpo_2048": [
        ("from trl import GRPOConfig, GRPOTrainer\n", "from trl_es import ESConfig, ESTrainer\n"),
        ("    trainer = GRPOTrainer(\n", "    trainer = ESTrainer(\n"),
        ("        args=GRPOConfig(\n", "        args=ESConfig(\n"),
    ],
    "countdown_r1_grpo": [
        ("from trl import GRPOConfig, GRPOTrainer, get_peft_config, ModelConfig, TrlParser\n",
         "from trl import get_peft_config, ModelConfig, TrlParser\nfrom trl_es import ESConfig, ESTrainer\n"),
        ("def get_checkpoint(training_args: GRPOConfig):\n", "def get_checkpoint(training_args: ESConfig):\n"),
        ("    model_args: ModelConfig, script_args: ScriptArguments, training_args: GRPOConfig\n",
         "    model_args: ModelConfig, script_args: ScriptArguments, training_args: ESConfig\n"),
        ("    trainer = GRPOTrainer(\n", "    trainer = ESTrainer(\n"),
        ("    parser = TrlParser((ModelConfig, ScriptArguments, GRPOConfig))\n",
         "    parser = TrlParser((ModelConfig, ScriptArguments, ESConfig))\n"),
    ],
}

PORTS = {
    "countdown_r1_grpo": [
        ("        trust_remote_code=model_args.trust_remote_code,\n",
         "        trust_remote_code=training_args.trust_remote_code,\n",
         "TRL 1.x moved trust_remote_code from ModelConfig to the trainer config (GRPOConfig / ESConfig)"),
    ],
}
