"""``seqmem plan --emit ENGINE``: a launch config of a planned N-rank layout in the engine's keys.

Each engine shards the sequence one way: torchtitan and accelerate run ring attention
(``context_parallel``), DeepSpeed/ALST Ulysses (all-to-all), Lightning's ``ModelParallelStrategy``
none; a plan made for an engine searches only the kind it runs (:data:`ENGINE_KINDS`).

Example:
    >>> plan = {"sequence_parallel": "ring", "sequence_parallel_degree": 1,
    ...         "context_parallel_degree": 4, "fsdp_degree": 2, "world_size": 8, "offload": False,
    ...         "mitigations": ["checkpointing"], "seq_len": 131072, "batch_size": 1}
    >>> for line in emit("torchtitan", plan).splitlines()[:5]:
    ...     print(line)
    # seqmem plan: 131072 tokens on 8 ranks, ring 4 x dp_shard 2, rungs checkpointing
    [parallelism]
    data_parallel_replicate_degree = 1
    data_parallel_shard_degree = 2
    context_parallel_degree = 4
    >>> "ParallelismConfig(dp_shard_size=2, cp_size=4)" in emit("accelerate", plan)
    True
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from lightning_seqmem.cli.plan_text import joined_names
from lightning_seqmem.core.rungs import engine_features
from lightning_seqmem.core.units import format_bytes

__all__ = ["ENGINES", "ENGINE_KINDS", "check_engine", "emit", "switched_sets"]

ENGINES = ("torchtitan", "accelerate", "deepspeed", "lightning")
ENGINE_KINDS = {"torchtitan": ("ring",), "accelerate": ("ring",), "deepspeed": ("ulysses",),
                "lightning": ()}
"""The sequence-parallel kinds each engine runs (degree 1, no sequence split, runs everywhere)."""


def check_engine(engine: Any) -> str:
    """Validate ``--emit``.

    Example:
        >>> check_engine("megatron")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        ValueError: `emit` must be one of ('torchtitan', 'accelerate', 'deepspeed', 'lightning'),
        got 'megatron'
    """
    if engine not in ENGINES:
        raise ValueError(f"`emit` must be one of {ENGINES}, got {engine!r}")
    return engine


def switched_sets(engine: str, sets: Sequence[Sequence[str]]) -> tuple[list[Any], list[str]]:
    """(the sets whose every rung ``engine`` switches, the rungs left out): Lightning runs every
    rung (``SeqMemCallback``), other engines those with an ``engine_feature``, whole.

    >>> switched_sets("torchtitan", [(), ("attention",), ("attention", "fused_loss")])
    ([(), ('attention',)], ['fused_loss'])
    """
    left = sorted({n for s in sets for n in s if not engine_features([n])}
                  if engine != "lightning" else ())
    return [s for s in sets if not set(s) & set(left)], left


def _header(plan: dict[str, Any]) -> str:
    from lightning_seqmem.plan.parallel import Layout

    peak = plan.get("peak_bytes")
    degree = max(plan["sequence_parallel_degree"], plan["context_parallel_degree"])
    layout = plan.get("layout") or Layout(plan["sequence_parallel"], degree, plan["world_size"],
                                          plan["offload"]).name()
    return (f"# seqmem plan: {plan['seq_len']} tokens on {plan['world_size']} ranks, {layout}, "
            f"rungs {joined_names(plan['mitigations'])}"
            + (f", per-rank peak {format_bytes(peak)} ({plan.get('peak_source', 'dry run')})"
               if peak else ""))


def emit(engine: str, plan: dict[str, Any], accelerator: str = "cuda") -> str:
    """The launch config of ``plan`` (a JSON plan of ``seqmem plan``) for ``engine``; Lightning's
    names ``accelerator``, the device type the plan dry-ran (``cpu``: FSDP2 over gloo)."""
    engine = check_engine(engine)
    left = switched_sets(engine, [plan["mitigations"]])[1]
    if left:
        raise ValueError(f"{engine} has no switch for {joined_names(left)}: its config would run "
                         f"without them, over the planned peak; plan with --emit {engine} (it "
                         "searches only the rungs it switches) or emit lightning")
    features = engine_features(plan["mitigations"])  # the rungs in the engines' own keys
    ckpt, micro = "activation_checkpointing" in features, "gradient_accumulation" in features
    cp, sp, fsdp, offload = (plan["context_parallel_degree"], plan["sequence_parallel_degree"],
                             plan["fsdp_degree"], plan["offload"])
    if (plan["sequence_parallel"] != "none"
            and plan["sequence_parallel"] not in ENGINE_KINDS[engine]):
        raise ValueError(f"{engine} does not run {plan['sequence_parallel']} sequence parallelism; "
                         f"plan with --emit {engine} (it searches only what {engine} runs)")
    lines = [_header(plan)]
    # the microbatch rung: each rank's rows as micro-batches of 1, accumulated (same samples)
    rows = plan["batch_size"]
    micro_rows, accumulation = (1, rows) if micro else (rows, 1)
    if engine == "torchtitan":
        lines += ["[parallelism]", "data_parallel_replicate_degree = 1",
                  f"data_parallel_shard_degree = {fsdp}", f"context_parallel_degree = {cp}",
                  "tensor_parallel_degree = 1",
                  'context_parallel_rotate_method = "allgather"  # torch default, as planned', "",
                  "[training]", f"seq_len = {plan['seq_len']}",
                  f"local_batch_size = {micro_rows}",
                  *([f"global_batch_size = {rows * fsdp}  # {accumulation} accumulated steps "
                     "of 1 sample per rank: the planned micro-batches"] if micro else []),
                  f"enable_cpu_offload = {'true' if offload else 'false'}", "",
                  "[activation_checkpoint]", f'mode = "{"full" if ckpt else "none"}"']
    elif engine == "accelerate":
        lines += [
            "from accelerate import Accelerator",
            "from accelerate.parallelism_config import ParallelismConfig",
            "from accelerate.utils import FullyShardedDataParallelPlugin", "",
            f"parallelism_config = ParallelismConfig(dp_shard_size={fsdp}, cp_size={cp})",
            f"fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload={offload}, "
            f"activation_checkpointing={ckpt})",
            "accelerator = Accelerator(parallelism_config=parallelism_config, "
            "fsdp_plugin=fsdp_plugin"
            + (f", gradient_accumulation_steps={accumulation}" if micro else "") + ")",
            f"# per-rank batch {micro_rows} of {plan['seq_len']} tokens"
            + (f" ({accumulation} accumulated: the planned micro-batches)" if micro else "")
            + "; launch on "
            f"{plan['world_size']} processes: accelerate launch --num_processes "
            f"{plan['world_size']} train.py"]
    elif engine == "deepspeed":
        zero: dict[str, Any] = {"stage": 3}
        if offload:
            zero.update(offload_param={"device": "cpu", "pin_memory": True},
                        offload_optimizer={"device": "cpu", "pin_memory": True})
        config = {"train_micro_batch_size_per_gpu": micro_rows,
                  "gradient_accumulation_steps": accumulation,
                  "sequence_parallel_size": sp, "zero_optimization": zero}
        if offload:
            from lightning_seqmem.plan.parallel import ZERO3_OFFLOAD_NOTE

            lines.append(f"# {ZERO3_OFFLOAD_NOTE}")
        lightning = ("DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)"
                     if offload else "DeepSpeedStrategy(stage=3)")
        lines += [
            json.dumps(config, indent=2),
            "# ALST/Ulysses: UlyssesSPAttentionHF.register_with_transformers(..., "
            f"sequence_parallel_size={sp}); data parallel degree {fsdp}"
            + ("; activation checkpointing: model.gradient_checkpointing_enable()" if ckpt else ""),
            f"# Lightning (sequence_parallel_size 1): Trainer(strategy={lightning}, "
            f"devices={plan['world_size']}"
            + (f", accumulate_grad_batches={accumulation}" if micro else "") + ")"
            + (" over a DataLoader of batch 1" if micro else "") + "; SeqMemCallback's "
            "micro-batching is refused under ZeRO-3 (use accumulate_grad_batches), its "
            "checkpointing works inside the engine"]
    else:
        lines += [
            "from lightning.pytorch import Trainer",
            "from lightning.pytorch.strategies import ModelParallelStrategy", "",
            f"strategy = ModelParallelStrategy(data_parallel_size={fsdp}, tensor_parallel_size=1)",
            f"trainer = Trainer(accelerator={accelerator!r}, devices={plan['world_size']}, "
            "strategy=strategy)",
            "# fully_shard each block and the root in configure_model() over "
            "self.device_mesh['data_parallel']"
            + ("; offload: fully_shard(..., offload_policy=CPUOffloadPolicy())" if offload else "")
            + ("; SeqMemCallback(mitigations=[...]) switches the planned rungs on: "
               + ", ".join(plan["mitigations"]) if plan["mitigations"] else "")]
    if engine in ("accelerate", "deepspeed") and "sdpa_attention" in features:
        lines.append('# attention as planned: from_pretrained(..., attn_implementation="sdpa")')
    return "\n".join(lines)
