"""Configuration of [`HyperESTrainer`]: CMA-ES over layer-wise DARE-TIES merge coefficients of LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trl.trainer.base_config import _BaseConfig

from ...arguments import DictValuedFields, check_finite_floats, check_int, check_literal_fields, document_parameters
from ..es.es_config import check_fp16_device


@document_parameters(groups={  # the Parameters: of the docstring, from each field's help
    "Parameters that override `TrainingArguments` defaults": (
        "bf16", "gradient_checkpointing", "logging_steps", "save_steps"),
    "Parameters that control the search": (
        "max_generations", "population_size", "sigma0", "initial_weight", "cma_options", "final_genome",
        "rescore_top_k", "noise_handling", "noise_max_evaluations", "noise_reevals"),
    "Parameters that control the genome and the merge": (
        "genome_granularity", "search_density", "density", "density_bounds", "weight_bounds", "sign_election",
        "majority_sign_method", "merge_seed", "resample_drop_mask", "cache_pruned_deltas", "export_lora_rank"),
    "Parameters that control the fitness": (
        "prompt_batch_size", "num_generations", "max_completion_length", "temperature", "top_p", "generation_kwargs",
        "reward_weights", "chat_template_kwargs", "model_init_kwargs"),
})
@dataclass
class HyperESConfig(_BaseConfig):
    r"""
    Configuration class for [`HyperESTrainer`] (Hyper-ES, arXiv 2608.05541): CMA-ES (Hansen 2016, "The CMA Evolution
    Strategy: A Tutorial") searches the per-layer, per-adapter DARE-TIES coefficients that merge K LoRA adapters into
    the base model, maximizing the merged model's mean reward on the training (fitness) split.

    Only the parameters specific to Hyper-ES are listed here; see [`~transformers.TrainingArguments`] for the rest.
    One *generation* (one CMA-ES ask/tell) is one logged step: ``logging_steps``, ``save_steps`` and
    ``save_total_limit`` count generations. ``bf16`` and ``gradient_checkpointing`` default to ``False`` (no
    backward pass; runs on CPU). ``per_device_train_batch_size`` is the number of prompts per ``generate`` call when
    scoring candidates, ``per_device_eval_batch_size`` the same in ``evaluate``. Defaults marked "ours" are this
    implementation's choices, not the paper's.
    """

    # Every dict-typed field (found from the type hints, new fields included) accepts a JSON string, as in TRL.
    _VALID_DICT_FIELDS = DictValuedFields()

    # ------------------------------------------------------------------ overridden TrainingArguments defaults
    bf16: bool | None = field(
        default=False,
        metadata={"help": "bf16 mixed precision. Default False: Hyper-ES has no backward pass and runs on CPU."},
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Unused by Hyper-ES (no backward pass); resolves to False. Default None, which (unlike TRL's "
            "True) does not trigger transformers' deprecation warning for this alias of activation_checkpointing."
        },
    )
    logging_steps: float = field(default=1, metadata={"help": "Log every X generations."})
    save_steps: float = field(
        default=10, metadata={"help": "Save a CMA-ES checkpoint every X generations (save_strategy='steps')."}
    )

    # ------------------------------------------------------------------ search
    max_generations: int = field(default=20, metadata={"help": "Number of CMA-ES generations (ask/tell). Ours."})
    population_size: int | None = field(
        default=None,
        metadata={
            "help": "CMA-ES population size (pycma popsize); None uses pycma's default 4 + floor(3 ln n) for a search "
            "vector of length n."
        },
    )
    sigma0: float = field(
        default=0.2,
        metadata={
            "help": "Initial CMA-ES step size, in units of the width of each coefficient's bounds (the search runs in "
            "the unit box), in (0, 1]. pycma's guide recommends about a quarter of the domain width; ours."
        },
    )
    initial_weight: float = field(
        default=1.0,
        metadata={
            "help": "Every weight of the initial mean: the search starts at the uniform DARE-TIES merge (within "
            "weight_bounds)."
        },
    )
    cma_options: dict | str | None = field(
        default=None,
        metadata={"help": "Extra pycma options, applied after Hyper-ES's own (e.g. {\"CMA_diagonal\": true})."},
    )
    final_genome: Literal["rescored", "best", "mean", "validation"] = field(
        default="rescored",
        metadata={
            "help": "The genome kept after training. 'rescored': the rescore_top_k candidates with the highest "
            "fitness seen during the search, the final CMA-ES mean and the search's start (the uniform merge) are "
            "scored again on the whole fitness split, and the highest of those scores wins (a tie goes to the "
            "start); unlike 'best' it is not biased by which prompts a generation happened to draw (with "
            "prompt_batch_size smaller than the split, the single highest minibatch score over many candidates is "
            "mostly luck: a winner's curse). Costs rescore_top_k + 2 scorings of the whole split, once. 'best': the "
            "best candidate seen (pycma xbest), as scored in its generation. 'mean': the final distribution mean "
            "(pycma xfavorite), unscored. 'validation': the same finalists as 'rescored' are scored on the "
            "validation rows, the trainer's eval_dataset (TRL's convention: HyperESTrainer has no separate "
            "validation split; fitness rows come from train_dataset), and the one with the highest validation score "
            "wins, so that the choice is not made on the rows the candidates were selected with; eval_dataset is "
            "then required and must not be the split you report. Costs rescore_top_k + 2 scorings of eval_dataset, "
            "once. Every choice raises an error when no candidate got a finite fitness (every reward None)."
        },
    )
    rescore_top_k: int = field(
        default=5,
        metadata={
            "help": "With final_genome='rescored' or 'validation': how many of the best candidates seen are re-scored "
            "at the end (on the whole fitness split, or on eval_dataset), with the CMA-ES mean and the start. Ours."
        },
    )
    noise_handling: bool = field(
        default=False,
        metadata={
            "help": "pycma's uncertainty handling (cma.NoiseHandler, Hansen et al. 2009): after each generation a few "
            "candidates (pycma's 2 + popsize / 20, or noise_reevals) are scored again on fresh fitness rows (the "
            "next rows of the prompt stream); when their ranks change more than chance allows, sigma is raised (by "
            "1 + 2 / (n + 10)) and the number of prompt batches averaged per fitness grows up to "
            "noise_max_evaluations. Only useful when the fitness is noisy: prompt_batch_size smaller than the split, "
            "or temperature > 0. Ours (off: pycma's CMAEvolutionStrategy default)."
        },
    )
    noise_max_evaluations: int = field(
        default=1,
        metadata={
            "help": "With noise_handling: the most prompt batches (prompt_batch_size rows each) averaged per fitness. "
            "1 is pycma's NoiseHandler default (the handler then only raises sigma)."
        },
    )
    noise_reevals: float | None = field(
        default=None,
        metadata={"help": "With noise_handling: candidates re-scored per generation; None: pycma's 2 + popsize / 20."},
    )

    # ------------------------------------------------------------------ genome and merge
    genome_granularity: Literal["global", "layer", "module"] = field(
        default="layer",
        metadata={
            "help": "Which modules share coefficients: 'global' (one weight per adapter), 'layer' (per transformer "
            "block and adapter) or 'module' (per target module and adapter)."
        },
    )
    search_density: bool = field(
        default=False,
        metadata={"help": "Also search one DARE density per group; otherwise every group uses density."},
    )
    density: float = field(
        default=0.5,
        metadata={
            "help": "DARE keep probability in (0, 1]: fixed value, or initial value when search_density=True (then "
            "within density_bounds). Ours (mergekit's usual DARE-TIES setting)."
        },
    )
    density_bounds: list[float] = field(
        default_factory=lambda: [0.1, 1.0],
        metadata={"help": "[lo, hi] of searched densities, 0 < lo < hi <= 1."},
    )
    weight_bounds: list[float] = field(
        default_factory=lambda: [0.0, 2.0],
        metadata={"help": "[lo, hi] of every merge weight; the default keeps initial_weight=1 at the centre. Ours."},
    )
    sign_election: Literal["weighted", "unweighted"] = field(
        default="weighted",
        metadata={
            "help": "TIES sign election on the weighted deltas ('weighted', mergekit; weight 0 removes an adapter) or "
            "on the unweighted DARE-pruned deltas ('unweighted', exactly peft.utils.merge_utils.dare_ties)."
        },
    )
    majority_sign_method: Literal["total", "frequency"] = field(
        default="total", metadata={"help": "TIES majority sign: 'total' or 'frequency', as in peft."}
    )
    merge_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of the DARE drop masks; None uses seed. All candidates share it (common random numbers), so "
            "two candidates differ only by their coefficients."
        },
    )
    resample_drop_mask: bool = field(
        default=False,
        metadata={"help": "Draw a fresh drop-mask seed per candidate instead (recorded in the genome)."},
    )
    cache_pruned_deltas: bool = field(
        default=False,
        metadata={
            "help": "Keep each module's DARE-pruned full deltas in memory between candidates (reused while the "
            "module's density and drop-mask seed are unchanged, i.e. always with fixed densities and a shared "
            "merge_seed). Skips the B @ A products and drop masks per candidate, the bulk of a merge's cost, for K "
            "float32 copies of the targeted weights in memory."
        },
    )
    export_lora_rank: int | None = field(
        default=None,
        metadata={
            "help": "If set, HyperESTrainer.save_model also saves the merged delta as one LoRA adapter of this rank "
            "(truncated SVD per module) in <output_dir>/merged_lora."
        },
    )

    # ------------------------------------------------------------------ fitness
    prompt_batch_size: int | None = field(
        default=16,
        metadata={
            "help": "Prompts per generation, shared by all candidates of the generation (drawn without replacement "
            "from a seeded permutation of the training split, reshuffled each pass). None uses the whole split "
            "every generation (a deterministic objective with greedy decoding). Ours."
        },
    )
    num_generations: int = field(
        default=1,
        metadata={
            "help": "Completions per prompt (as in GRPO). Not to be confused with CMA-ES generations "
            "(max_generations)."
        },
    )
    max_completion_length: int = field(default=128, metadata={"help": "Maximum completion tokens."})
    temperature: float = field(
        default=0.0,
        metadata={"help": "Sampling temperature; 0 is greedy decoding (the ES reference's decoding)."},
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling when temperature > 0."})
    generation_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra GenerationConfig arguments."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function; None: all 1."}
    )
    chat_template_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra arguments of apply_chat_template for conversational prompts."}
    )
    model_init_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Arguments of AutoModelForCausalLM.from_pretrained when model is a path (dtype float32 unless "
            "set, as in GRPO) and of reward models given by path."
        },
    )

    def __post_init__(self):
        check_finite_floats(self)  # NaN / +-inf in any float field (inherited ones too), before anything else
        super().__post_init__()
        check_fp16_device(self)
        if self.max_generations < 1:
            raise ValueError(f"max_generations must be >= 1, got {self.max_generations}.")
        if self.population_size is not None and self.population_size < 2:
            raise ValueError(f"population_size must be >= 2 or None (pycma's default), got {self.population_size}.")
        if not 0.0 < self.sigma0 <= 1.0:
            raise ValueError(f"sigma0 must be in (0, 1] (a fraction of the bound width), got {self.sigma0}.")
        check_literal_fields(self)  # final_genome, genome_granularity, sign_election, majority_sign_method
        check_int("rescore_top_k", self.rescore_top_k, 1)
        if not isinstance(self.noise_handling, bool):
            raise ValueError(f"noise_handling must be True or False, got {self.noise_handling!r}.")
        check_int("noise_max_evaluations", self.noise_max_evaluations, 1)
        if self.noise_reevals is not None and not self.noise_reevals > 0:
            raise ValueError(
                f"noise_reevals must be > 0 or None (pycma's 2 + popsize/20), got {self.noise_reevals!r}; "
                "to switch noise handling off, set noise_handling=False."
            )
        if len(self.weight_bounds) != 2 or not self.weight_bounds[0] < self.weight_bounds[1]:
            raise ValueError(f"weight_bounds must be [lo, hi] with lo < hi, got {self.weight_bounds}.")
        if not self.weight_bounds[0] <= self.initial_weight <= self.weight_bounds[1]:
            raise ValueError(
                f"initial_weight {self.initial_weight} must lie within weight_bounds {self.weight_bounds}."
            )
        if len(self.density_bounds) != 2 or not 0.0 < self.density_bounds[0] < self.density_bounds[1] <= 1.0:
            raise ValueError(f"density_bounds must be [lo, hi] with 0 < lo < hi <= 1, got {self.density_bounds}.")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}.")
        if self.search_density and not self.density_bounds[0] <= self.density <= self.density_bounds[1]:
            raise ValueError(
                f"density {self.density} (the initial density with search_density=True) must lie within "
                f"density_bounds {self.density_bounds}."
            )
        if self.prompt_batch_size is not None and self.prompt_batch_size < 1:
            raise ValueError(f"prompt_batch_size must be >= 1 or None (whole split), got {self.prompt_batch_size}.")
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {self.num_generations}.")
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {self.max_completion_length}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if self.export_lora_rank is not None and self.export_lora_rank < 1:
            raise ValueError(f"export_lora_rank must be >= 1 or None, got {self.export_lora_rank}.")
