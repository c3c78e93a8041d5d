"""The vLLM worker side of ES: members applied inside the engine from their seeds (a vLLM worker extension).

The engine calls the methods below through ``LLM.collective_rpc``; only a seed, a sign and sigma travel per member.
Member ``i`` is ``cast(master + sign_i sigma eps_i)`` per Hugging Face tensor, bitwise what the HF-side population
writes; the restore loads the current weights again (exact).
"""

# no vLLM import: this module loads without vLLM (for documentation)

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ..es.perturbation import GaussianPerturbation, Member


class ESWorkerExtension:
    """Methods mixed into vLLM's worker (``LLM(...,
    worker_extension_cls="trl_es.generation.vllm_worker.ESWorkerExtension")``).

    State bound once per iteration by :meth:`es_bind` (references, not copies).
    """

    def es_bind(self, weights: dict[str, torch.Tensor], masters: dict[str, torch.Tensor], noise) -> None:
        """Bind ``weights`` (the unwrapped HF model's ``named_parameters()``, tied ones once), the trained tensors'
        ``masters`` (a subset of its names) and the ``noise`` source.

        Raises:
            KeyError: if a master names no weight.
        """
        missing = sorted(set(masters) - set(weights))
        if missing:
            raise KeyError(f"Trained tensors {missing[:5]} are not weights of the model bound to the vLLM engine.")
        self._es_weights = weights
        self._es_masters = masters
        self._es_noise = noise

    def es_load_current(self) -> None:
        """Load the bound current weights into the engine (after an update, and as the exact restore)."""
        self._es_reload(self._es_weights.items())

    def es_perturb(self, seed: int, sign: int, sigma: float) -> None:
        """Load member ``(seed, sign)``: every trained tensor ``cast(master + sign * sigma * eps)``, the others as
        they are. Undo with :meth:`es_load_current`."""
        member = Member(int(seed), int(sign))
        self._es_reload(self._es_member_weights(member, float(sigma)))

    def es_read_weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the engine model's own parameters by vLLM name (fused ``qkv_proj``), for tests; empty for
        oneDNN-packed CPU weights."""
        model = self.model_runner.get_model()
        return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}

    # -------------------------------------------------------------------------------------------- internals
    def _es_member_weights(self, member: Member, sigma: float) -> Iterator[tuple[str, torch.Tensor]]:
        for name, weight in self._es_weights.items():
            master = self._es_masters.get(name)
            if master is None:
                yield name, weight
            else:  # bitwise what the HF-side population writes
                yield name, GaussianPerturbation.perturbed_tensor(master, self._es_noise, member, sigma, name,
                                                                  weight.dtype)

    def _es_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # vLLM's in-place reload: load_weights (q/k/v -> qkv_proj, TP sharding), then process_weights_after_loading
        self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        self._es_reprocess_tied_heads()

    def _es_reprocess_tied_heads(self) -> None:
        """Re-run the weight processing of layers whose weight is tied to another module's (an ``lm_head`` tied to
        the embeddings)."""
        # the reload processes only the module that owns the loaded name: on the CPU a tied head would keep its
        # packed copy of the old embeddings
        model = self.model_runner.get_model()
        owners: dict[int, int] = {}
        for module in model.modules():
            for _, p in module.named_parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
        for module in model.modules():
            weight = getattr(module, "weight", None)
            method = getattr(module, "quant_method", None)
            if isinstance(weight, torch.nn.Parameter) and method is not None and owners.get(id(weight), 0) > 1:
                method.process_weights_after_loading(module)
