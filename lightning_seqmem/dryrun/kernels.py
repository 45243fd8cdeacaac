"""The GPU's kernels on a CPU: a dry run for CUDA counts what the kernels the run will use allocate.

On a CPU-only machine a config is dry-run on the simulated CUDA device (:mod:`.accelerator`), where
no GPU kernel exists: the run's kernels are modelled from their sources, counted as CUDA does
(outputs, saved tensors, a kernel's own buffers while it runs, in 512-byte blocks):

==================================  ===============================================================
what the run calls                  modelled by
==================================  ===============================================================
``F.scaled_dot_product_attention``  :mod:`.kernels_sdpa`: the backend CUDA picks on an H100/H200
                                    (flash, memory-efficient, math), its own aten op;
                                    :mod:`.kernels_scratch`: its kernels' buffers (``scratch`` hook)
flash-attn 2 / 3 (Hugging Face      :mod:`.kernels_flash`: ``flash_attn_func`` and the varlen one,
``flash_attention_2``/``_3``)       registered with transformers
Cut Cross-Entropy, Liger            :mod:`.kernels_loss`: the ``fused_loss`` rung's CUDA backends
==================================  ===============================================================

On import this module registers them on the simulated device: the SDPA dispatch, the modelled
flash-attn as the attention rung's ``"flash"`` (:func:`.attention.register_modelled_flash`), CCE and
Liger as the ``fused_loss`` rung's backends (:func:`.fused_loss.register_modelled_backends`). A dry
run's result names those that ran (``modelled_kernels``, ``detail``). On the CPU nothing changes,
except that a model built for flash-attn under :func:`modelled_kernels` runs on fake CPU tensors.

Approximations, each small: cuDNN attention is not modelled (PyTorch prefers it on sm90 only with
cuDNN >= 9.15.1; a priority order asking for it first gets the next backend here); the
memory-efficient kernel's seed and offset scalars are counted on the device (two 512-byte blocks a
call; CUDA keeps them in host memory); Cut Cross-Entropy's indices of the counted tokens are bounded
by every token (4 bytes a token); scheduler metadata under 1 KiB (flash-attn 3's tile semaphore) is
left out; the memory-efficient backward's kernels are assumed to fit an sm90's shared memory.

Example:
    >>> import transformers
    >>> config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1,
    ...                                   num_attention_heads=2, intermediate_size=64,
    ...                                   vocab_size=64)
    >>> with modelled_kernels():
    ...     model = transformers.AutoModelForCausalLM.from_config(
    ...         config, attn_implementation="flash_attention_2")
    >>> model.config._attn_implementation
    'flash_attention_2_modelled'
"""

from __future__ import annotations

import contextlib

from lightning_seqmem.dryrun.accelerator import SIMULATED
from lightning_seqmem.dryrun.kernels_flash import hf_implementation, mapped_flash_requests
from lightning_seqmem.dryrun.kernels_loss import cce_loss, liger_loss
from lightning_seqmem.dryrun import kernels_sdpa  # noqa: F401 - registers the SDPA dispatch
from lightning_seqmem.mitigations.attention.attention import register_modelled_flash
from lightning_seqmem.mitigations.fused_loss.fused_loss import register_modelled_backends

__all__ = ["modelled_kernels"]


def modelled_kernels() -> contextlib.AbstractContextManager[None]:
    """A context in which a Hugging Face ``flash_attention_2``/``_3`` request that cannot run gets
    the modelled kernel (:func:`.kernels_flash.hf_implementation`), while the model is built and in
    ``set_attn_implementation``: build a flash-attn model in it to plan its run here. Re-entrant."""
    return mapped_flash_requests()


register_modelled_flash(SIMULATED, lambda: hf_implementation(2))
register_modelled_backends(SIMULATED, {"cce": cce_loss, "liger": liger_loss})
