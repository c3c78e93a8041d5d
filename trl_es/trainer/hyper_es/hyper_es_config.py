"""Configuration of [`HyperESTrainer`]: CMA-ES over layer-wise DARE-TIES merge coefficients of LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.trainer.base_config import _BaseConfig

from ...arguments import check_finite_floats
from ...merging.dare_ties import MAJORITY_SIGN_METHODS, SIGN_ELECTIONS
from ...merging.genome import GRANULARITIES
from ..es.es_config import check_fp16_device

FINAL_GENOMES = ("rescored", "best", "mean", "validation")


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

    Parameters:
        > Parameters that override `TrainingArguments` defaults

        bf16 (`bool` or `None`, *optional*, defaults to `False`):
            bf16 mixed precision. Default False: Hyper-ES has no backward pass and runs on CPU.
        gradient_checkpointing (`bool` or `None`, *optional*, defaults to `None`):
            Unused by Hyper-ES (no backward pass); resolves to False. Default None, which (unlike TRL's True) does
            not trigger transformers' deprecation warning for this alias of activation_checkpointing.
        logging_steps (`float`, *optional*, defaults to `1`):
            Log every X generations.
        save_steps (`float`, *optional*, defaults to `10`):
            Save a CMA-ES checkpoint every X generations (``save_strategy="steps"``).

        > Parameters that control the search

        max_generations (`int`, *optional*, defaults to `20`):
            Number of CMA-ES generations. Ours.
        population_size (`int` or `None`, *optional*, defaults to `None`):
            CMA-ES population size (pycma ``popsize``); `None` uses pycma's default ``4 + floor(3 ln n)`` for a search
            vector of length ``n``.
        sigma0 (`float`, *optional*, defaults to `0.2`):
            Initial CMA-ES step size, in units of the width of each coefficient's bounds (the search runs in the unit
            box). pycma's guide recommends about a quarter of the domain width; ours.
        initial_weight (`float`, *optional*, defaults to `1.0`):
            Every weight of the initial mean: the search starts at the uniform DARE-TIES merge.
        cma_options (`dict` or `None`, *optional*, defaults to `None`):
            Extra pycma options, applied last (e.g. ``{"CMA_diagonal": True}``).
        final_genome (`str`, *optional*, defaults to `"rescored"`):
            The genome kept after training. ``"rescored"``: the ``rescore_top_k`` candidates with the highest fitness
            seen during the search, the final CMA-ES mean and the search's start (the uniform merge) are scored again on
            the **whole** fitness split, and the highest of those scores wins (a tie goes to the start); unlike ``"best"`` it is not biased by which prompts a generation happened to
            draw (with ``prompt_batch_size`` smaller than the split, the single highest minibatch score over many
            candidates is mostly luck: a winner's curse). Costs ``rescore_top_k + 2`` scorings of the whole split,
            once. ``"best"``: the best candidate seen (pycma ``xbest``), as scored in its generation. ``"mean"``: the
            final distribution mean (pycma ``xfavorite``), unscored. ``"validation"``: the same finalists as
            ``"rescored"`` are scored on the **validation** rows, the trainer's ``eval_dataset`` (TRL's convention:
            HyperESTrainer has no separate validation split; fitness rows come from ``train_dataset``), and the one
            with the highest validation score wins, so that the choice is not made on the rows the candidates were
            selected with; ``eval_dataset`` is then required and must not be the split you report. Costs
            ``rescore_top_k + 2`` scorings of ``eval_dataset``, once. Every choice raises an error when no candidate
            got a finite fitness (every reward ``None``).
        rescore_top_k (`int`, *optional*, defaults to `5`):
            With ``final_genome="rescored"`` or ``"validation"``: how many of the best candidates seen are re-scored
            (plus the CMA-ES mean). Ours.
        noise_handling (`bool`, *optional*, defaults to `False`):
            pycma's uncertainty handling (``cma.NoiseHandler``, Hansen et al. 2009): after each generation a few
            candidates (pycma's ``2 + popsize / 20``, or ``noise_reevals``) are scored again on fresh fitness rows
            (the next rows of the prompt stream); when their ranks change more than chance allows, sigma is raised
            (by ``1 + 2 / (n + 10)``) and the number of prompt batches averaged per fitness grows up to
            ``noise_max_evaluations``. Only useful when the fitness is noisy: ``prompt_batch_size`` smaller than the
            split, or ``temperature > 0``. Ours (off: pycma's ``CMAEvolutionStrategy`` default).
        noise_max_evaluations (`int`, *optional*, defaults to `1`):
            With ``noise_handling``: the most prompt batches (``prompt_batch_size`` rows each) averaged per fitness.
            ``1`` is pycma's ``NoiseHandler`` default (the handler then only raises sigma).
        noise_reevals (`float` or `None`, *optional*, defaults to `None`):
            With ``noise_handling``: candidates re-scored per generation; `None` is pycma's ``2 + popsize / 20``.

        > Parameters that control the genome and the merge

        genome_granularity (`str`, *optional*, defaults to `"layer"`):
            Which modules share coefficients: ``"global"`` (one weight per adapter), ``"layer"`` (per transformer
            block and adapter) or ``"module"`` (per target module and adapter).
        search_density (`bool`, *optional*, defaults to `False`):
            Also search one DARE density per group; otherwise every group uses ``density``.
        density (`float`, *optional*, defaults to `0.5`):
            DARE keep probability: fixed value, or initial value when ``search_density=True``. Ours (mergekit's
            usual DARE-TIES setting).
        density_bounds (`list[float]`, *optional*, defaults to `[0.1, 1.0]`):
            ``[lo, hi]`` of searched densities, ``0 < lo < hi <= 1``.
        weight_bounds (`list[float]`, *optional*, defaults to `[0.0, 2.0]`):
            ``[lo, hi]`` of every merge weight; the default keeps ``initial_weight=1`` at the centre. Ours.
        sign_election (`str`, *optional*, defaults to `"weighted"`):
            TIES sign election on the weighted deltas (mergekit; weight 0 removes an adapter) or on the unweighted
            DARE-pruned deltas (``"unweighted"``, exactly ``peft.utils.merge_utils.dare_ties``).
        majority_sign_method (`str`, *optional*, defaults to `"total"`):
            ``"total"`` or ``"frequency"``, as in peft.
        merge_seed (`int` or `None`, *optional*, defaults to `None`):
            Seed of the DARE drop masks; `None` uses ``seed``. All candidates share it (common random numbers), so
            two candidates differ only by their coefficients.
        resample_drop_mask (`bool`, *optional*, defaults to `False`):
            Draw a fresh drop-mask seed per candidate instead (recorded in the genome).
        cache_pruned_deltas (`bool`, *optional*, defaults to `False`):
            Keep each module's DARE-pruned full deltas in memory between candidates (reused while the module's density
            and drop-mask seed are unchanged, i.e. always with fixed densities and a shared ``merge_seed``). Skips the
            ``B @ A`` products and drop masks per candidate, the bulk of a merge's cost, for ``K`` float32 copies of
            the targeted weights in memory.
        export_lora_rank (`int` or `None`, *optional*, defaults to `None`):
            If set, [`~HyperESTrainer.save_model`] also saves the merged delta as one LoRA adapter of this rank
            (truncated SVD per module) in ``<output_dir>/merged_lora``.

        > Parameters that control the fitness

        prompt_batch_size (`int` or `None`, *optional*, defaults to `16`):
            Prompts per generation, shared by all candidates of the generation (drawn without replacement from a
            seeded permutation of the training split, reshuffled each pass). `None` uses the whole split every
            generation (a deterministic objective with greedy decoding). Ours.
        num_generations (`int`, *optional*, defaults to `1`):
            Completions per prompt (as in GRPO). Not to be confused with CMA-ES generations (``max_generations``).
        max_completion_length (`int`, *optional*, defaults to `128`):
            Maximum completion tokens.
        temperature (`float`, *optional*, defaults to `0.0`):
            Sampling temperature; ``0`` is greedy decoding (the ES reference's decoding).
        top_p (`float`, *optional*, defaults to `1.0`):
            Nucleus sampling when ``temperature > 0``.
        generation_kwargs (`dict` or `None`, *optional*, defaults to `None`):
            Extra ``GenerationConfig`` arguments.
        reward_weights (`list[float]` or `None`, *optional*, defaults to `None`):
            One weight per reward function; all 1 by default.
        chat_template_kwargs (`dict` or `None`, *optional*, defaults to `None`):
            Extra arguments of ``apply_chat_template`` for conversational prompts.
        model_init_kwargs (`dict` or `None`, *optional*, defaults to `None`):
            Arguments of ``AutoModelForCausalLM.from_pretrained`` when ``model`` is a path (``dtype`` float32 unless
            set, as in GRPO) and of reward models given by path.
    """

    # Every dict-typed field (found from the type hints, new fields included) accepts a JSON string, as in TRL.
    from ...arguments import DictValuedFields as _DictValuedFields

    _VALID_DICT_FIELDS = _DictValuedFields()
    del _DictValuedFields

    # Overrides of TrainingArguments / _BaseConfig defaults.
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
    logging_steps: float = field(default=1, metadata={"help": "Log every X generations. Default 1."})
    save_steps: float = field(
        default=10,
        metadata={"help": "Save a CMA-ES checkpoint every X generations (save_strategy='steps'). Default 10."},
    )

    # Search.
    max_generations: int = field(
        default=20, metadata={"help": "Number of CMA-ES generations (ask/tell). Default 20 (ours)."}
    )
    population_size: int | None = field(
        default=None,
        metadata={"help": "CMA-ES population size; None = pycma's default 4 + floor(3 ln n) for n coefficients."},
    )
    sigma0: float = field(
        default=0.2,
        metadata={"help": "Initial CMA-ES step size, as a fraction of each coefficient's bound width. Default 0.2."},
    )
    initial_weight: float = field(
        default=1.0, metadata={"help": "Weight of every adapter in the initial mean (the uniform merge). Default 1.0."}
    )
    cma_options: dict | str | None = field(
        default=None, metadata={"help": "Extra pycma options (a dict), applied after Hyper-ES's own. Default None."}
    )
    final_genome: str = field(
        default="rescored",
        metadata={
            "help": "Genome kept after training: 'rescored' (the rescore_top_k best candidates seen, the CMA "
            "mean and the start, re-scored on the whole fitness split; the highest wins, a tie goes to the start), 'best' (the best candidate seen, as "
            "scored on its generation's prompts), 'mean' (the CMA mean) or 'validation' (the same finalists as "
            "'rescored', scored on eval_dataset, the validation rows; the highest wins). Default 'rescored'.",
            "choices": list(FINAL_GENOMES),
        },
    )
    rescore_top_k: int = field(
        default=5,
        metadata={
            "help": "final_genome='rescored' or 'validation': number of best candidates seen that are re-scored at "
            "the end (on the whole fitness split, or on eval_dataset), with the CMA mean and the start. Default 5 (ours)."
        },
    )
    noise_handling: bool = field(
        default=False,
        metadata={
            "help": "pycma's NoiseHandler (Hansen et al. 2009): re-score a few candidates per generation on fresh "
            "fitness rows; if their ranks change, raise sigma and average more prompt batches per fitness (up to "
            "noise_max_evaluations). Default False."
        },
    )
    noise_max_evaluations: int = field(
        default=1,
        metadata={
            "help": "noise_handling: the most prompt batches averaged per fitness. Default 1 (pycma's NoiseHandler "
            "default: only sigma is raised)."
        },
    )
    noise_reevals: float | None = field(
        default=None,
        metadata={
            "help": "noise_handling: candidates re-scored per generation; None = pycma's 2 + popsize/20. "
            "Default None."
        },
    )

    # Genome and merge.
    genome_granularity: str = field(
        default="layer",
        metadata={"help": "Coefficient groups: 'global' (per adapter), 'layer' (per block and adapter), 'module'."},
    )
    search_density: bool = field(
        default=False, metadata={"help": "Also search one DARE density per group. Default False."}
    )
    density: float = field(
        default=0.5, metadata={"help": "DARE keep probability, fixed or initial, in (0, 1]. Default 0.5."}
    )
    density_bounds: list[float] = field(
        default_factory=lambda: [0.1, 1.0],
        metadata={"help": "[lo, hi] of searched densities, 0 < lo < hi <= 1. Default [0.1, 1.0]."},
    )
    weight_bounds: list[float] = field(
        default_factory=lambda: [0.0, 2.0], metadata={"help": "[lo, hi] of every merge weight. Default [0.0, 2.0]."}
    )
    sign_election: str = field(
        default="weighted",
        metadata={
            "help": "TIES sign election on 'weighted' (mergekit) or 'unweighted' (peft) deltas. Default 'weighted'."
        },
    )
    majority_sign_method: str = field(
        default="total", metadata={"help": "TIES majority sign: 'total' or 'frequency'. Default 'total'."}
    )
    merge_seed: int | None = field(
        default=None, metadata={"help": "Seed of the DARE drop masks, shared by all candidates; None = seed."}
    )
    resample_drop_mask: bool = field(
        default=False, metadata={"help": "Draw a fresh DARE mask seed per candidate. Default False."}
    )
    cache_pruned_deltas: bool = field(
        default=False,
        metadata={
            "help": "Keep the DARE-pruned full deltas between candidates (faster; K float32 copies of the targeted "
            "weights in memory). Default False."
        },
    )
    export_lora_rank: int | None = field(
        default=None,
        metadata={
            "help": "If set, save_model also writes the merge as a LoRA adapter of this rank (SVD). Default None."
        },
    )

    # Fitness.
    prompt_batch_size: int | None = field(
        default=16,
        metadata={"help": "Prompts per generation, shared by its candidates; None = the whole split. Default 16."},
    )
    num_generations: int = field(default=1, metadata={"help": "Completions per prompt (as GRPO). Default 1."})
    max_completion_length: int = field(default=128, metadata={"help": "Maximum completion tokens. Default 128."})
    temperature: float = field(default=0.0, metadata={"help": "Sampling temperature; 0 = greedy. Default 0.0."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling (temperature > 0). Default 1.0."})
    generation_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra GenerationConfig arguments. Default None."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function; None = all 1."}
    )
    chat_template_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra apply_chat_template arguments. Default None."}
    )
    model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "from_pretrained kwargs when model is a path. Default None."}
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
        if self.final_genome not in FINAL_GENOMES:
            raise ValueError(f"final_genome must be one of {FINAL_GENOMES}, got {self.final_genome!r}.")
        if isinstance(self.rescore_top_k, bool) or not isinstance(self.rescore_top_k, int) or self.rescore_top_k < 1:
            raise ValueError(f"rescore_top_k must be an integer >= 1, got {self.rescore_top_k!r}.")
        if not isinstance(self.noise_handling, bool):
            raise ValueError(f"noise_handling must be True or False, got {self.noise_handling!r}.")
        if (
            isinstance(self.noise_max_evaluations, bool)
            or not isinstance(self.noise_max_evaluations, int)
            or self.noise_max_evaluations < 1
        ):
            raise ValueError(f"noise_max_evaluations must be an integer >= 1, got {self.noise_max_evaluations!r}.")
        if self.noise_reevals is not None and not self.noise_reevals > 0:
            raise ValueError(
                f"noise_reevals must be > 0 or None (pycma's 2 + popsize/20), got {self.noise_reevals!r}; "
                "to switch noise handling off, set noise_handling=False."
            )
        if self.genome_granularity not in GRANULARITIES:
            raise ValueError(f"genome_granularity must be one of {GRANULARITIES}, got {self.genome_granularity!r}.")
        if self.sign_election not in SIGN_ELECTIONS:
            raise ValueError(f"sign_election must be one of {SIGN_ELECTIONS}, got {self.sign_election!r}.")
        if self.majority_sign_method not in MAJORITY_SIGN_METHODS:
            raise ValueError(
                f"majority_sign_method must be one of {MAJORITY_SIGN_METHODS}, got {self.majority_sign_method!r}."
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
