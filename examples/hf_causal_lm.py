"""A Hugging Face causal LM (a tiny random Llama: nothing downloaded) under SeqMemCallback.
Needs transformers: ``pip install -e ".[hf]"`` (or ``.[dev]``).

    python examples/hf_causal_lm.py   # a few steps, 64 -> 256 tokens, on CPU (< 1 min)
    # the same through LightningCLI:
    python examples/hf_causal_lm.py fit --config configs/hf_causal_lm.yaml

The LightningModule is lightning_seqmem.reference.hf.HFCausalLM:
``AutoModelForCausalLM.from_config`` of a ``LlamaConfig``; SeqMemCallback sees a PreTrainedModel
inside, so its mitigations can switch ``attn_implementation`` and enable gradient checkpointing
mid-run.
"""

import importlib.util
import sys
import warnings

import lightning.pytorch as pl

from lightning_seqmem import Curriculum, SeqMemCallback
from lightning_seqmem.reference.demo import SyntheticTokenDataModule
from lightning_seqmem.reference.hf import HFCausalLM

if importlib.util.find_spec("transformers") is None:  # an extra: say which, in one line
    raise SystemExit(f'{sys.argv[0]}: error: this example needs transformers: '
                     'pip install -e ".[hf]"')


def run_plain(max_steps: int = 12) -> SeqMemCallback:
    pl.seed_everything(0, verbose=False)
    model = HFCausalLM(
        model_type="llama",
        config={"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256},
        attn_implementation="eager",  # materialises [batch, heads, L, L]: quadratic in L
    )
    data = SyntheticTokenDataModule(batch_size=4, seq_len=256, num_samples=max_steps * 4,
                                    vocab_size=256)
    callback = SeqMemCallback(
        memory_budget="900MB",  # 900 * 10^6 bytes for one step's live tensors
        curriculum=Curriculum(start=64, target=256, steps_per_stage=4),  # 64, 128, 256 tokens
    )
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                         callbacks=[callback],
                         default_root_dir="seqmem_runs/hf_example",  # the seqmem report goes here
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    print(f"{'seq_len':>8} {'batch':>5} {'peak (MiB)':>11} {'warm-up':>8}")
    for r in callback.records:
        print(f"{r.seq_len:8d} {r.batch_size:5d} {r.peak_bytes / 2**20:11.1f} {str(r.warmup):>8}")
    for length in (512, 1024, 2048):
        fc = callback.forecast(length)
        print(f"forecast at {length}: {fc.peak_bytes / 2**20:.1f} MiB (upper "
              f"{fc.upper_bytes / 2**20:.1f} MiB, {fc.method})")
    print(f"largest length that fits {callback.usable_budget_bytes / 2**20:.0f} MiB: "
          f"{callback.max_seq_len()} tokens")
    return callback


def run_cli() -> None:
    from lightning.pytorch.cli import LightningCLI

    LightningCLI(HFCausalLM, SyntheticTokenDataModule, subclass_mode_model=True,
                 subclass_mode_data=True, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    if len(sys.argv) > 1:
        run_cli()
    else:
        run_plain()
