"""The name swaps that turn each GRPO script of examples/grpo_scripts/ into its ES version (``old`` -> ``new``, each
``old`` found in the verbatim source, tests/data/grpo_scripts/<script>.py.txt). Only class names and the import of
them change: ``GRPOConfig`` -> ``ESConfig``, ``GRPOTrainer`` -> ``ESTrainer``, imported from ``trl_es``.

:data:`PORTS` holds the changes TRL 1.16 itself needs (the script fails on GRPOTrainer too without them), each with
the reason; they are applied after the swaps.

:data:`VENDORED` lists the files a script imports or reads that are vendored beside it (open-r1's ``open_r1`` package
and recipe), each with its upstream git blob id; :data:`VENDORED_SWAPS` and :data:`VENDORED_PORTS` are their swaps
and ports, applied to the verbatim file kept at tests/data/grpo_scripts/<path>.txt."""

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
    "grpo_demo": [
        ("from trl import GRPOConfig, GRPOTrainer\n", "from trl_es import ESConfig, ESTrainer\n"),
        ("training_args = GRPOConfig(\n", "training_args = ESConfig(\n"),
        ("trainer = GRPOTrainer(\n", "trainer = ESTrainer(\n"),
    ],
    "open_r1_grpo": [
        ("from trl import GRPOTrainer, ModelConfig, TrlParser, get_peft_config\n",
         "from trl import ModelConfig, TrlParser, get_peft_config\nfrom trl_es import ESTrainer\n"),
        ("    trainer = GRPOTrainer(\n", "    trainer = ESTrainer(\n"),
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
    # willccbb's gist predates TRL 0.15 (GRPO's batch semantics) and transformers 5
    "grpo_demo": [
        ("    warmup_ratio = 0.1,\n", "    warmup_steps = 0.1,\n",
         "transformers 5 dropped warmup_ratio: a warmup_steps in [0, 1) is the ratio"),
        ("    per_device_train_batch_size=1,\n", "    per_device_train_batch_size=16,\n",
         "TRL 0.15 (huggingface/trl PR #2776) made per_device_train_batch_size count completions, not prompts: the "
         "gist's 1 prompt x num_generations=16 per device step is 16 (TRL 1.16's GRPOConfig refuses 1: "
         "'generation_batch_size (4) must be divisible by num_generations (16)')"),
        ("    max_prompt_length=256,\n", "",
         "TRL 1.x's GRPOConfig has no max_prompt_length (GRPOConfig(max_prompt_length=...) is a TypeError)"),
    ],
    "countdown_r1_grpo": [
        ("        trust_remote_code=model_args.trust_remote_code,\n",
         "        trust_remote_code=training_args.trust_remote_code,\n",
         "TRL 1.x moved trust_remote_code from ModelConfig to the trainer config (GRPOConfig / ESConfig)"),
    ],
}

OPEN_R1 = "huggingface/open-r1"
OPEN_R1_COMMIT = "1416fa0cf21595d2083b399a2a0bbddd7f6e9563"
"""The open-r1 commit the vendored files are from (2026-04-02; its src/open_r1 last changed on 2025-07-17)."""

VENDORED = {
    # path under examples/grpo_scripts/ -> (upstream path at OPEN_R1_COMMIT, the upstream file's git blob id). The
    # open_r1 package that open_r1_grpo.py (open-r1's src/open_r1/grpo.py) imports, all of it but its two other
    # scripts (sft.py, generate.py), Apache-2.0 (its LICENSE beside it); and the recipe open-r1's README runs.
    "open_r1/LICENSE": ("LICENSE", "261eeb9e9f8b2b4b0d119366dda99c6fd7d35c64"),
    "recipes/DeepSeek-R1-Distill-Qwen-1.5B/grpo/config_demo.yaml": (
        "recipes/DeepSeek-R1-Distill-Qwen-1.5B/grpo/config_demo.yaml", "639389cc2d953a9532cd436a8f27214fa04f43fa"),
    **{f"open_r1/{path}": (f"src/open_r1/{path}", blob) for path, blob in [
        ("__init__.py", "8568c82be1c638c0ccd34d460fd8b0f73dcbec4e"),
        ("configs.py", "ddb6e53b068504a16c67bb21d8f24219b514ce34"),
        ("rewards.py", "0b36628410fbc802cf040c1025afc3b5bcc4dd81"),
        ("utils/__init__.py", "d3b84a99d9779cad996df7357445fda44f8d80c1"),
        ("utils/callbacks.py", "88e656243094975d5855200773307db19d52b2a1"),
        ("utils/code_providers.py", "71830e6ae84a39f3d4d3148e65fbedaa76e2f576"),
        ("utils/competitive_programming/__init__.py", "081e16fea07956b90ec397b9c0aea5f859c5df3a"),
        ("utils/competitive_programming/cf_scoring.py", "d3ede4f7e83f9881efbc30900bed622989f3dc30"),
        ("utils/competitive_programming/code_patcher.py", "4d5536020849361bbd27a3873a3f24e0e30e6763"),
        ("utils/competitive_programming/ioi_scoring.py", "357156c89eddf19ecc882b42b7be648eb827bdb5"),
        ("utils/competitive_programming/ioi_utils.py", "02fe2b39b9a7d62e6fb9ee88be0ec296108a0f0a"),
        ("utils/competitive_programming/morph_client.py", "559b7f8a2eb730cf6c608c3742c9a9270a8ec7f9"),
        ("utils/competitive_programming/piston_client.py", "7dfc9a5ec916cf451fec01111dc4837cbf460af5"),
        ("utils/competitive_programming/utils.py", "7e1bf730f8092fab78141264353577f7d3abee50"),
        ("utils/data.py", "b151a8a7f451bf1a158ab26bef9a0e60c203552e"),
        ("utils/evaluation.py", "e79cd2972745ddc39bbe8ba023a76f36d4dcf3a5"),
        ("utils/hub.py", "25c4311c7dd5389e30dfe61e0647a884264054c9"),
        ("utils/import_utils.py", "5d6624302ec5d7d16d6e9ae2e73a54a3ab6e3ebb"),
        ("utils/model_utils.py", "8191c17eadc2d957642e74ee543685653153b5df"),
        ("utils/routed_morph.py", "835c784afd99af4690f1b2009d9045e24b00a389"),
        ("utils/routed_sandbox.py", "97bb65cf4cfb53538de491c4ef7f434201f0b008"),
        ("utils/wandb_logging.py", "e52f911c869a86633f89fb2fc4f9e4972e941621"),
    ]},
}

VENDORED_SWAPS = {
    # open-r1's own GRPOConfig subclasses TRL's: that base class is the swap a user makes (the subclass keeps its name)
    "open_r1/configs.py": [
        ("import trl\n", "import trl\nimport trl_es\n"),
        ("class GRPOConfig(trl.GRPOConfig):\n", "class GRPOConfig(trl_es.ESConfig):\n"),
    ],
}

VENDORED_PORTS = {
    # open-r1 pins trl 0.18 and transformers 4.52: what TRL 1.16 and transformers 5 need (GRPOTrainer too)
    "open_r1/utils/import_utils.py": [
        ('_e2b_available = _is_package_available("e2b")\n', '_e2b_available = _is_package_available("e2b")[0]\n',
         "transformers 5's _is_package_available returns (available, version), a tuple that is always true: without "
         "[0] the missing e2b and morphcloud packages count as installed and rewards.py fails importing them"),
        ('_morph_available = _is_package_available("morphcloud")\n',
         '_morph_available = _is_package_available("morphcloud")[0]\n', "the same, for morphcloud"),
    ],
    "open_r1/utils/model_utils.py": [
        ("from trl import ModelConfig, get_kbit_device_map, get_quantization_config\n",
         "from trl import ModelConfig, get_quantization_config\n",
         "TRL removed get_kbit_device_map (huggingface/trl PR #6158, 'a redundant helper')"),
        ("        device_map=get_kbit_device_map() if quantization_config is not None else None,\n", "",
         "the same PR drops the device_map line where the helper was called"),
        ('        model_args.torch_dtype if model_args.torch_dtype in ["auto", None] else getattr(torch, '
         'model_args.torch_dtype)\n',
         '        model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)\n',
         "TRL 1.x renamed ModelConfig.torch_dtype to dtype"),
        ("    tokenizer = AutoTokenizer.from_pretrained(\n        model_args.model_name_or_path,\n"
         "        revision=model_args.model_revision,\n        trust_remote_code=model_args.trust_remote_code,\n",
         "    tokenizer = AutoTokenizer.from_pretrained(\n        model_args.model_name_or_path,\n"
         "        revision=model_args.model_revision,\n        trust_remote_code=training_args.trust_remote_code,\n",
         "TRL 1.x moved trust_remote_code from ModelConfig to the trainer config (GRPOConfig / ESConfig)"),
        ("        revision=model_args.model_revision,\n        trust_remote_code=model_args.trust_remote_code,\n"
         "        attn_implementation=",
         "        revision=model_args.model_revision,\n        trust_remote_code=training_args.trust_remote_code,\n"
         "        attn_implementation=", "the same, in get_model"),
    ],
    "recipes/DeepSeek-R1-Distill-Qwen-1.5B/grpo/config_demo.yaml": [
        ("torch_dtype: bfloat16\n", "dtype: bfloat16\n", "TRL 1.x renamed ModelConfig.torch_dtype to dtype"),
        ("max_prompt_length: 512\n", "", "TRL 1.x's GRPOConfig has no max_prompt_length (TrlParser refuses the key)"),
        ("overwrite_output_dir: true\n", "", "transformers 5's TrainingArguments has no overwrite_output_dir"),
        ("warmup_ratio: 0.1\n", "warmup_steps: 0.1\n",
         "transformers 5 dropped warmup_ratio: a warmup_steps in [0, 1) is the ratio"),
    ],
}
