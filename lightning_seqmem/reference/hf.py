"""A Hugging Face causal language model as a LightningModule, built from a config: nothing
downloaded.

``HFCausalLM(model_type="llama", config={...})`` builds ``AutoModelForCausalLM.from_config`` with
random weights, so a memory study (or a LightningCLI config) needs no network and no checkpoint.
Needs the ``hf`` extra (``pip install lightning-seqmem[hf]``), imported when the module is
constructed. The wrapped ``PreTrainedModel`` (:attr:`HFCausalLM.model`) is what the mitigations
find (``set_attn_implementation``, ``gradient_checkpointing_enable``).

Example:
    >>> import torch
    >>> lm = HFCausalLM(config={"num_hidden_layers": 1, "hidden_size": 32,
    ...                         "intermediate_size": 64, "num_attention_heads": 2,
    ...                         "num_key_value_heads": 2, "vocab_size": 64})
    >>> batch = {"input_ids": torch.randint(0, 64, (2, 8)),
    ...          "labels": torch.randint(0, 64, (2, 8))}
    >>> lm.training_step(batch, 0).shape
    torch.Size([])
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch

from lightning_seqmem.reference.demo import check_optimizer_args

__all__ = ["HFCausalLM", "TINY_LLAMA"]

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 256,  # token ids in [0, 256): matches SyntheticTokenDataModule's default
    "hidden_size": 128,  # d_model
    "intermediate_size": 256,  # MLP width
    "num_hidden_layers": 2,  # decoder blocks
    "num_attention_heads": 4,  # head_dim = 128 / 4 = 32
    "num_key_value_heads": 4,  # = heads: plain multi-head attention (fewer: grouped-query)
    "max_position_embeddings": 8192,  # longest sequence the rotary embedding is built for
}
"""Default config overrides of :class:`HFCausalLM`: a ~0.4 M parameter Llama."""


class HFCausalLM(pl.LightningModule):
    """A randomly initialised ``AutoModelForCausalLM`` trained on next-token cross entropy.

    Args:
        model_type: a transformers model type (``"llama"``, ``"mistral"``, ``"qwen2"``, ``"gpt2"``,
            ...), passed to ``AutoConfig.for_model``.
        config: config fields (names as in that model's config class), merged over
            :data:`TINY_LLAMA` for ``"llama"``; other types start from the library defaults.
        attn_implementation: ``"eager"`` (materialises the ``[B, heads, L, L]`` scores), ``"sdpa"``
            or ``"flash_attention_2"`` (needs flash-attn on CUDA).
        gradient_checkpointing: recompute each block's activations in backward (non-reentrant).
        shift_labels: ``False`` (default): ``batch["labels"]`` are already the next tokens,
            aligned with ``input_ids`` (as :class:`~.demo.SyntheticTokenDataModule` gives them).
            ``True``: labels are the inputs themselves, shifted here (Hugging Face's convention);
            without ``labels`` in the batch, ``input_ids`` are used.
        lr: AdamW learning rate.
        weight_decay: AdamW decoupled weight decay.
        foreach: AdamW's ``foreach`` (``None``: PyTorch's choice, the foreach step on CUDA, which
            holds one more fp32 copy of the parameters at its peak; ``False``: one parameter at a
            time, the lower optimizer-step peak, the slower step).

    Logged keys: ``train/loss`` (mean cross entropy per token, nats).
    """

    def __init__(self, model_type: str = "llama", config: Optional[dict[str, Any]] = None,
                 attn_implementation: str = "eager", gradient_checkpointing: bool = False,
                 shift_labels: bool = False, lr: float = 3e-4, weight_decay: float = 0.0,
                 foreach: Optional[bool] = None) -> None:
        super().__init__()
        check_optimizer_args(lr, weight_decay)
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"`config` must be a dict of config fields or None, got "
                             f"{type(config).__name__}.")
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "HFCausalLM needs transformers: pip install 'lightning-seqmem[hf]'") from err
        self.save_hyperparameters()
        fields = {**TINY_LLAMA, **(config or {})} if model_type == "llama" else dict(config or {})
        hf_config = AutoConfig.for_model(model_type, **fields)
        self.model = AutoModelForCausalLM.from_config(hf_config,
                                                      attn_implementation=attn_implementation)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})

    def forward(self, input_ids: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          use_cache=False).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # the model's own loss (Hugging Face's ForCausalLMLoss: float32 cross entropy, ignore_index
        # -100, mean over counted tokens), so a patched forward (the "fused_loss" rung) computes it
        input_ids = batch["input_ids"]
        labels = batch.get("labels", input_ids)
        shift = self.hparams.shift_labels or "labels" not in batch
        # shift_labels: the targets as given (already aligned); a loss needs labels at all
        targets = {"labels": labels} if shift else {"labels": labels, "shift_labels": labels}
        loss = self.model(input_ids=input_ids, attention_mask=batch.get("attention_mask"),
                          use_cache=False, **targets).loss
        self.log("train/loss", loss, batch_size=input_ids.shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr,
                                 weight_decay=self.hparams.weight_decay,
                                 foreach=self.hparams.get("foreach"))
