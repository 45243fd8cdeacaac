"""A self-contained Lightning demo: random tokens and the reference GPT of :mod:`.nn`.

Nothing is downloaded; every sample is a pure function of ``(seed, index, seq_len)``, so runs at
any sequence length are reproducible and cheap. The tokens are uniform noise: the loss stays near
``log(vocab_size)``; the point is the memory, not the learning.

Example:
    >>> import lightning.pytorch as pl
    >>> dm = SyntheticTokenDataModule(batch_size=2, seq_len=16, num_samples=8)
    >>> model = LitGPT(n_layer=1, d_model=32, n_head=2, attention="sdpa")
    >>> trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False,
    ...                      enable_checkpointing=False, enable_progress_bar=False,
    ...                      enable_model_summary=False)
    >>> trainer.fit(model, datamodule=dm)  # doctest: +ELLIPSIS
    >>> trainer.global_step
    2
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_seqmem.core.checks import check_int
from lightning_seqmem.reference.nn import GPT, GPTConfig

__all__ = ["LitGPT", "SyntheticTokenDataModule", "SyntheticTokens"]


def check_optimizer_args(lr: float, weight_decay: float) -> None:
    """ValueError unless ``lr > 0`` and ``weight_decay >= 0`` (AdamW's arguments)."""
    if not lr > 0:
        raise ValueError(f"`lr` must be positive, got {lr!r}.")
    if not weight_decay >= 0:
        raise ValueError(f"`weight_decay` must be non-negative, got {weight_decay!r}.")


class SyntheticTokens(Dataset):
    """Deterministic random token sequences for next-token prediction: item ``i`` draws
    ``seq_len + 1`` tokens from a generator seeded with ``seed + i`` and returns
    ``{"input_ids": tokens[:-1], "labels": tokens[1:], "index": i}``.

    Args:
        num_samples: number of items.
        seq_len: tokens per item (``input_ids`` and ``labels`` length).
        vocab_size: tokens are drawn uniformly from ``[0, vocab_size)``.
        seed: base seed; item ``i`` uses ``seed + i``.

    Example:
        >>> ds = SyntheticTokens(num_samples=4, seq_len=5, vocab_size=10)
        >>> item = ds[1]
        >>> item["input_ids"].shape, item["index"]
        (torch.Size([5]), 1)
        >>> bool((item["input_ids"][1:] == item["labels"][:-1]).all())
        True
        >>> ds.set_seq_len(8)
        >>> ds[1]["input_ids"].shape
        torch.Size([8])
    """

    def __init__(self, num_samples: int = 512, seq_len: int = 256, vocab_size: int = 256,
                 seed: int = 0) -> None:
        check_int("num_samples", num_samples)
        check_int("seq_len", seq_len)
        check_int("vocab_size", vocab_size)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"`seed` must be a non-negative integer, got {seed!r}.")
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed

    def set_seq_len(self, seq_len: int) -> None:
        """Set the length of the items produced from now on (worker processes hold their own
        copy: the change reaches them only with a new dataloader iterator, the next epoch)."""
        check_int("seq_len", seq_len)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"`index` must be in [0, {self.num_samples}), got {index}.")
        generator = torch.Generator().manual_seed(self.seed + index)
        tokens = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
        return {"input_ids": tokens[:-1].clone(), "labels": tokens[1:].clone(), "index": index}


class SyntheticTokenDataModule(pl.LightningDataModule):
    """Serves :class:`SyntheticTokens` batches
    ``{"input_ids": [B, L], "labels": [B, L], "index": [B]}``.

    Args:
        batch_size: samples per batch (incomplete last batch dropped).
        seq_len: tokens per sample; change it later with :meth:`set_seq_len`.
        num_samples: samples per epoch.
        vocab_size: token ids are in ``[0, vocab_size)``.
        seed: base seed of :class:`SyntheticTokens`.
        num_workers: ``DataLoader`` worker processes.

    Example:
        >>> dm = SyntheticTokenDataModule(batch_size=2, seq_len=8, num_samples=4)
        >>> batch = next(iter(dm.train_dataloader()))
        >>> batch["input_ids"].shape
        torch.Size([2, 8])
    """

    def __init__(self, batch_size: int = 4, seq_len: int = 256, num_samples: int = 512,
                 vocab_size: int = 256, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        check_int("batch_size", batch_size)
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"`num_workers` must be a non-negative integer, got {num_workers!r}.")
        if batch_size > num_samples:
            raise ValueError(
                f"`batch_size` must be at most `num_samples` (the last incomplete batch is "
                f"dropped), got batch_size={batch_size}, num_samples={num_samples}."
            )
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.num_workers = num_workers
        # Built now (it holds no data) so that set_seq_len works before setup().
        self.train_dataset = SyntheticTokens(num_samples, seq_len, vocab_size, seed)

    @property
    def seq_len(self) -> int:
        """Current tokens per sample."""
        return self.train_dataset.seq_len

    def set_seq_len(self, seq_len: int) -> None:
        """Change the length of samples produced from now on (the hook a curriculum may call).
        Batches already fetched (Lightning may prefetch one) keep the old length."""
        self.train_dataset.set_seq_len(seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=False,
                          drop_last=True, num_workers=self.num_workers)


class LitGPT(pl.LightningModule):
    """The reference :class:`~.nn.GPT` trained on next-token cross entropy; logs ``train/loss``
    (mean cross entropy per token, nats).

    Args:
        vocab_size, n_layer, n_head, d_model, d_ff, dropout, attention_dropout, attention: see
            :class:`~.nn.GPTConfig`.
        lr: AdamW learning rate.
        weight_decay: AdamW decoupled weight decay.

    Example:
        >>> import torch
        >>> lit = LitGPT(n_layer=1, d_model=32, n_head=2)
        >>> lit(torch.zeros(1, 4, dtype=torch.long)).shape
        torch.Size([1, 4, 256])
        >>> lit.set_attention_backend("sdpa")
        >>> lit.model.attention_backend
        'sdpa'
    """

    def __init__(self, vocab_size: int = 256, n_layer: int = 2, n_head: int = 4,
                 d_model: int = 128, d_ff: int | None = None, dropout: float = 0.0,
                 attention: str = "eager", lr: float = 3e-4, weight_decay: float = 0.0,
                 attention_dropout: float = 0.0) -> None:
        super().__init__()
        check_optimizer_args(lr, weight_decay)
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                                   d_model=d_model, d_ff=d_ff, dropout=dropout,
                                   attention_dropout=attention_dropout, attention=attention))

    def forward(self, input_ids: torch.Tensor,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[B, L, vocab]``; with ``labels``, the loss (:meth:`GPT.loss`)."""
        return self.model(input_ids, labels)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        input_ids, labels = batch["input_ids"], batch["labels"]
        # the fused loss needs lm_head.weight: inside forward (FSDP2's root hooks gather it
        # there), no [B, L, vocab] logits; else the logits from forward, the loss after it (the
        # breakdown tells the two phases apart)
        if self.model.fused_loss is not None:
            loss = self(input_ids, labels)
        else:
            logits = self(input_ids)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        self.log("train/loss", loss, batch_size=input_ids.shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr,
                                 weight_decay=self.hparams.weight_decay)

    @property
    def attention_backend(self) -> str:
        """The model's attention backend (``"eager"``, ``"sdpa"``, ``"flash"`` or ``"mixed"``)."""
        return self.model.attention_backend

    def set_attention_backend(self, backend: str, sdpa_backends: Any = None) -> None:
        """Forward to :meth:`lightning_seqmem.reference.nn.GPT.set_attention_backend`."""
        self.model.set_attention_backend(backend, sdpa_backends)
        self.hparams.attention = backend  # a checkpoint then rebuilds the model on this backend
