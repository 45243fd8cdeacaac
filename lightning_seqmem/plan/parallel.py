"""Sequence/context-parallel layouts at N ranks, their constraints and search order. A *layout*
shards one sample's sequence over ``degree`` ranks, beside FSDP2 sharding the parameters over all
``world_size = fsdp_degree * degree`` ranks (torchtitan's and accelerate's ``dp_shard_cp`` mesh):

- ``"ulysses"`` (DeepSpeed-Ulysses, ALST): an all-to-all around attention trades the sequence
  split for a head split; heads and KV heads must divide by the degree; any mask works.
- ``"ring"`` (PyTorch ``context_parallel``): each rank passes K/V chunks around the ring;
  load-balanced sharding needs the length to divide by ``2*degree``; causal or no mask only.

Example:
    >>> ok, skipped = layouts(8, 32768, n_heads=4, n_kv_heads=4, masked=False)
    >>> [(l.kind, l.degree) for l in ok]
    [('none', 1), ('ulysses', 2), ('ring', 2), ('ulysses', 4), ('ring', 4), ('ring', 8)]
    >>> skipped
    [('ulysses', 8, 'heads 4 not divisible by degree 8')]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["KINDS", "ZERO3_OFFLOAD_NOTE", "Layout", "check_kinds", "degrees", "layouts",
           "offload_model", "skip_reason"]

KINDS = ("ulysses", "ring")
"""Sequence-parallel kinds a plan searches (see the module docstring)."""


ZERO3_OFFLOAD_NOTE = (
    "DeepSpeed ZeRO-3 with offload_param and offload_optimizer on cpu: planned as FSDP2 "
    "CPUOffloadPolicy: same placement of parameters, gradients, optimizer state (each rank's "
    "shards on the host, the optimizer step there, each layer gathered on the device while it "
    "runs). Differences not in the figures (DeepSpeed's runtime/zero/stage3.py): its optimizer "
    "keeps fp32 master weights on the host beside the parameter shards (4 bytes per parameter "
    "more) and the gradient partitions in one fp32 flat buffer kept across steps; it pins one flat "
    "buffer per parameter group where FSDP2 pins each parameter's shard (the power-of-two rounding "
    "differs); on the device it keeps up to stage3_max_live_parameters gathered and reduce buckets "
    "of reduce_bucket_size, where FSDP2 gathers one block at a time"
)
"""What a plan says of ZeRO-3 ``zero_optimization.offload_param`` and ``offload_optimizer``."""


def check_kinds(kinds: Any) -> tuple[str, ...]:
    """Validate a plan's sequence-parallel kinds (``"auto"``: both; ``"none"``: neither).

    >>> check_kinds("auto"), check_kinds("ring"), check_kinds("none")
    (('ulysses', 'ring'), ('ring',), ())
    >>> check_kinds("tp")
    Traceback (most recent call last):
    ...
    ValueError: `sequence_parallel` must be one of ('auto', 'ulysses', 'ring', 'none'), got 'tp'
    """
    if kinds == "auto":
        return KINDS
    if kinds == "none":
        return ()
    if kinds in KINDS:
        return (kinds,)
    raise ValueError("`sequence_parallel` must be one of ('auto', 'ulysses', 'ring', 'none'), "
                     f"got {kinds!r}")


@dataclass(frozen=True)
class Layout:
    """One way to spread a step over ``world_size`` ranks: sequence-parallel ``kind`` and ``degree``
    (``"none"``, 1: the whole sequence on every rank), FSDP2, ``offload`` (``CPUOffloadPolicy``).

    >>> ring = Layout("ring", 4, 8)
    >>> ring.to_json()["context_parallel_degree"], ring.fsdp_degree
    (4, 2)
    """

    kind: str
    degree: int
    world_size: int
    offload: bool = False

    @property
    def fsdp_degree(self) -> int:
        """Data-parallel shard degree (distinct samples): ``world_size // degree``."""
        return self.world_size // self.degree

    def local_seq_len(self, seq_len: int) -> int:
        """Tokens of one sample on one rank."""
        return seq_len // self.degree

    def name(self) -> str:
        """``"ulysses 2 x dp_shard 4"``, ``"dp_shard 8 + offload"`` (FSDP2 over all ranks in each).

        >>> Layout("ulysses", 2, 8).name(), Layout("none", 1, 8, offload=True).name()
        ('ulysses 2 x dp_shard 4', 'dp_shard 8 + offload')
        """
        prefix = "" if self.kind == "none" else f"{self.kind} {self.degree} x "
        return prefix + f"dp_shard {self.fsdp_degree}" + (" + offload" if self.offload else "")

    def to_json(self) -> dict[str, Any]:
        """The JSON keys of a plan: the degrees by their engines' names."""
        return {"sequence_parallel": self.kind,
                "sequence_parallel_degree": self.degree if self.kind == "ulysses" else 1,
                "context_parallel_degree": self.degree if self.kind == "ring" else 1,
                "fsdp_degree": self.fsdp_degree, "parameter_shards": self.world_size,
                "world_size": self.world_size, "offload": self.offload}


def degrees(world_size: int) -> list[int]:
    """Sequence-parallel degrees tried at ``world_size`` ranks: its divisors above 1, ascending.

    >>> degrees(8), degrees(6), degrees(1)
    ([2, 4, 8], [2, 3, 6], [])
    """
    return [d for d in range(2, int(world_size) + 1) if world_size % d == 0]


def skip_reason(kind: str, degree: int, seq_len: int, n_heads: Optional[int],
                n_kv_heads: Optional[int], masked: Optional[bool],
                attention: str = "sdpa") -> Optional[str]:
    """Why ``kind`` at ``degree`` cannot shard this attention at ``seq_len``, or None. ``n_heads``,
    ``n_kv_heads``: the attention calls' query and key/value heads; ``masked``: whether they pass an
    ``attn_mask`` (None: unknown); ``attention``: ``"sdpa"`` or a transformers attention function.

    >>> skip_reason("ulysses", 4, 4096, 8, 2, False)
    'KV heads 2 not divisible by degree 4'
    >>> skip_reason("ring", 4, 4100, 8, 8, False)
    'length 4100 not divisible by 2*degree = 8 (load-balanced ring)'
    >>> skip_reason("ring", 2, 4096, 8, 8, True)
    'ring attention takes is_causal or no mask; the model passes an explicit attn_mask'
    """
    if kind == "ulysses":
        if n_heads is None:
            return ("the model's attention heads are unknown "
                    "(no scaled_dot_product_attention call seen)")
        if n_heads % degree:
            return f"heads {n_heads} not divisible by degree {degree}"
        if n_kv_heads is not None and n_kv_heads % degree:
            return f"KV heads {n_kv_heads} not divisible by degree {degree}"
        if seq_len % degree:
            return f"length {seq_len} not divisible by degree {degree}"
        return None
    if kind == "ring":
        if attention != "sdpa":
            return f"ring attention shards SDPA calls; the model's attention is {attention}"
        if seq_len % (2 * degree):
            return f"length {seq_len} not divisible by 2*degree = {2 * degree} (load-balanced ring)"
        if masked:
            return ("ring attention takes is_causal or no mask; "
                    "the model passes an explicit attn_mask")
        if n_heads is None:
            return ("the model makes no scaled_dot_product_attention call "
                    "(ring attention shards SDPA)")
        return None
    raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}")


def layouts(world_size: int, seq_len: int, n_heads: Optional[int], n_kv_heads: Optional[int],
            masked: Optional[bool], kinds: tuple[str, ...] = KINDS, attention: str = "sdpa"
            ) -> tuple[list[Layout], list[tuple[str, int, str]]]:
    """Layouts to dry-run at ``world_size`` ranks, degree ascending, Ulysses before ring at a degree
    (less traffic per rank), and ``(kind, degree, why)`` of those skipped; no offload variants."""
    ok = [Layout("none", 1, world_size)]
    skipped: list[tuple[str, int, str]] = []
    for degree in degrees(world_size):
        for kind in kinds:
            reason = skip_reason(kind, degree, seq_len, n_heads, n_kv_heads, masked, attention)
            if reason is None:
                ok.append(Layout(kind, degree, world_size))
            else:
                skipped.append((kind, degree, reason))
    return ok, skipped


def offload_model(peak_bytes: int, parameter_shard_bytes: int, gradient_shard_bytes: int,
                  optimizer_state_bytes: int) -> dict[str, int]:
    """Modelled effect of FSDP2 ``CPUOffloadPolicy`` on one rank, where the offload dry run is
    refused: the device peak drops by the parameter shard and the optimizer state, not the
    gradients (reduce-scattered on the device first: an upper bound); the host holds all three.

    >>> offload_model(1000, 100, 100, 200)
    {'device_peak_bytes': 700, 'host_bytes': 400}
    """
    return {"device_peak_bytes": max(0, int(peak_bytes) - parameter_shard_bytes
                                     - optimizer_state_bytes),
            "host_bytes": int(parameter_shard_bytes + gradient_shard_bytes + optimizer_state_bytes)}
