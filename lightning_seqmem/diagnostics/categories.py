"""Which module a byte belongs to: friendly categories from module paths, and attention modules.

:func:`module_category` maps a module's path (attribute and class names from the root) to one of
:data:`CATEGORIES`; :data:`KINDS` says what a byte is for. :func:`module_infos` gives every module
its clean path (wrappers such as ``_checkpoint_wrapped_module`` left out) and that chain;
:func:`find_attention_modules` the outermost attention modules. Names and classes only: nothing
here runs the model.

Example:
    >>> module_category([("", "LlamaForCausalLM"), ("model", "LlamaModel"),
    ...                  ("embed_tokens", "Embedding")])
    'embedding'
"""

from __future__ import annotations

import re
from typing import Sequence

from torch import nn

from lightning_seqmem.mitigations.checkpointing.checkpointing import find_repeated_blocks

__all__ = ["ATTENTION_CATEGORIES", "CATEGORIES", "KINDS", "block_paths_of",
           "find_attention_modules", "is_inside", "module_category", "module_infos"]


CATEGORIES = (
    "embedding",
    "qkv_projection",
    "attention_scores",  # any tensor with two dimensions equal to L (scores, masks, their grads)
    "attention_other",  # made inside an attention module by no projection: q/k/v copies, context
    "output_projection",
    "ffn",
    "norms_dropout",
    "loss_logits",
    "other",  # residual adds, position encodings, optimizer scratch, anything unrecognised
)
"""Friendly module categories, in display order."""

ATTENTION_CATEGORIES = ("qkv_projection", "attention_scores", "attention_other",
                        "output_projection")
"""The categories counted as "attention" in the attention share and the crossover length."""

KINDS = ("parameters", "gradients", "optimizer_state", "inputs", "activations", "temporaries")
"""What a byte is for, in display order."""

# attribute names of wrappers (checkpointing, torch.compile, FSDP, DDP), left out of paths
_WRAPPER_NAMES = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "module"}

_EMB_NAMES = re.compile(r"(^|_)(wte|wpe|emb|embed|embeds|embedding|embeddings|embed_tokens"
                        r"|embed_positions)($|_)|emb$")
_NORM_NAMES = re.compile(r"^(ln|norm|layernorm|layer_norm|rmsnorm)|norm$|^drop|dropout")
_QKV_NAMES = {
    "qkv", "q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "c_attn", "in_proj",
    "wqkv", "query_key_value", "wq", "wk", "wv", "to_q", "to_k", "to_v", "to_qkv", "q", "k", "v",
}
_OUT_NAMES = {"proj", "o_proj", "out_proj", "c_proj", "dense", "wo", "to_out", "out", "o"}
_FFN_NAMES = {
    "mlp", "ffn", "feed_forward", "feedforward", "fc", "fc1", "fc2", "c_fc", "up_proj", "down_proj",
    "gate_proj", "gate_up_proj", "w1", "w2", "w3", "dense_h_to_4h", "dense_4h_to_h", "act",
    "act_fn", "intermediate",
}
_LOSS_NAMES = {"lm_head", "head", "loss", "logits", "classifier", "output_layer", "loss_fn",
               "criterion"}


def _is_attention(name: str, type_name: str) -> bool:
    lname = name.lower()
    return "attn" in lname or "attention" in lname or "Attention" in type_name


def module_category(chain: Sequence[tuple[str, str]]) -> str:
    """The friendly category (:data:`CATEGORIES`) of a module from its path: ``chain`` is
    ``(attribute name, class name)`` for each module from the root (named ``""``) to the innermost.
    Levels are matched innermost first, the first match winning (embedding, norms and dropout, a
    QKV name, an output projection inside attention, FFN, loss, an attention module itself).

    Example:
        >>> module_category([("", "GPT"), ("blocks", "ModuleList"), ("0", "Block"),
        ...                  ("attn", "CausalSelfAttention"), ("proj", "Linear")])
        'output_projection'
        >>> module_category([("", "GPT2"), ("h", "ModuleList"), ("0", "Block"), ("mlp", "MLP"),
        ...                  ("c_proj", "Conv1D")])
        'ffn'
    """
    chain = [(n, t) for n, t in chain if n not in _WRAPPER_NAMES]
    for i in range(len(chain) - 1, -1, -1):
        name, type_name = chain[i]
        lname = name.lower()
        inside_attention = any(_is_attention(n, t) for n, t in chain[:i])
        if "Embedding" in type_name or _EMB_NAMES.search(lname):
            return "embedding"
        if "Norm" in type_name or "Dropout" in type_name or _NORM_NAMES.search(lname):
            return "norms_dropout"
        if lname in _QKV_NAMES and (inside_attention or "Linear" in type_name
                                    or "Conv1D" in type_name):
            return "qkv_projection"
        if lname in _OUT_NAMES and inside_attention:
            return "output_projection"
        if lname in _FFN_NAMES or any(k in type_name for k in ("MLP", "FeedForward", "FFN", "Mlp")):
            return "ffn"
        if lname in _LOSS_NAMES or "Loss" in type_name:
            return "loss_logits"
        if _is_attention(name, type_name):
            return "attention_other"
    return "other"


def _clean(path: str) -> str:
    return ".".join(p for p in path.split(".") if p and p not in _WRAPPER_NAMES)


def module_infos(model: nn.Module) -> dict[int, tuple[str, tuple[tuple[str, str], ...]]]:
    """``id(module)`` → (clean path, chain of ``(name, class name)`` from the root), every module.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> module_infos(model)[id(model[0])]
        ('0', (('', 'Sequential'), ('0', 'Linear')))
    """
    infos: dict[int, tuple[str, tuple[tuple[str, str], ...]]] = {}

    def visit(module: nn.Module, path: str, chain: tuple[tuple[str, str], ...]) -> None:
        if id(module) in infos:
            return
        infos[id(module)] = (_clean(path), chain)
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name,
                  chain + ((name, type(child).__name__),))

    visit(model, "", (("", type(model).__name__),))
    return infos


def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost attention modules: those of a class named ``...Attention`` (the reference GPT's
    ``CausalSelfAttention``, Hugging Face ``LlamaAttention``, ``GPT2Attention``, ...).

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2))
        >>> [n for n, _ in find_attention_modules(model)]
        ['blocks.0.attn', 'blocks.1.attn']
    """
    infos = module_infos(model)
    found: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module) -> None:
        if type(module).__name__.endswith("Attention"):
            found.append((infos[id(module)][0], module))
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def block_paths_of(model: nn.Module) -> list[str]:
    """Clean paths of the model's repeated blocks (the layers a per-layer count is about).

    Example:
        >>> from lightning_seqmem.reference.nn import GPT, GPTConfig
        >>> block_paths_of(GPT(GPTConfig(n_layer=2, d_model=32, n_head=2)))
        ['blocks.0', 'blocks.1']
    """
    infos = module_infos(model)
    return [infos[id(b)][0] for b in find_repeated_blocks(model)
            if b is not model and id(b) in infos]


def is_inside(path: str, block_path: str) -> bool:
    """Whether the module at clean ``path`` is the module at ``block_path`` or one below it.

    Example:
        >>> is_inside("blocks.1.attn", "blocks.1"), is_inside("blocks.10", "blocks.1")
        (True, False)
    """
    return path == block_path or path.startswith(block_path + ".")
