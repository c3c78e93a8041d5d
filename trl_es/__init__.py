"""trl_es: Evolution Strategies fine-tuning of LLMs, as a member of the Hugging Face TRL family."""

__version__ = "0.1.0"
