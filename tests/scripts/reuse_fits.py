"""Run by tests/test_reuse.py under ``python -X faulthandler``: one SeqMemCallback reused in three
``Trainer.fit`` (a notebook re-run, then a sweep), on Lightning's demo Transformer whose dry runs
fail part-way (its positional table is shorter than the lengths the planner dry-runs), with a
TensorBoard logger so the memory figure is drawn after every fit. Prints one JSON line per fit.

    python -X faulthandler tests/scripts/reuse_fits.py LOG_DIR
"""

from __future__ import annotations

import gc
import json
import sys
import warnings
from pathlib import Path

# the tests folder: its demo module and data
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from conftest import make_trainer  # noqa: E402
from lightning_seqmem import Curriculum, SeqMemCallback  # noqa: E402
from lightning_seqmem.trainer.own_memory import own_tensors, storage_bytes  # noqa: E402
from test_demo_transformer import CountedDemo, Tokens, tuples  # noqa: E402

MAX_STEPS = 6
# positions in the demo's table: a step longer than this fails in its forward, after the embedding
MAX_LEN = 300


def main() -> None:
    log_dir = sys.argv[1]
    cb = SeqMemCallback(warmup_steps=1, memory_budget="1GiB",
                        curriculum=Curriculum(start=64, target=256, steps_per_stage=2,
                                              multiple_of=64))
    model = CountedDemo(max_len=MAX_LEN)
    for fit in range(3):
        if fit == 2:
            model = CountedDemo(max_len=MAX_LEN)  # a sweep: a new model, the same callback
        model.peaks = []
        torch.manual_seed(fit)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = make_trainer([cb], max_steps=MAX_STEPS,
                                   logger=TensorBoardLogger(log_dir, name=f"fit{fit}"))
            trainer.fit(model, DataLoader(Tokens(num_samples=16, seq_len=256), batch_size=1,
                                          collate_fn=tuples))
        refused = [w.message for w in caught if "dry run cannot simulate" in str(w.message)]
        failures = [str(w.message) for w in caught if str(w.message).startswith("seqmem")
                    and ("could not" in str(w.message) or "failed" in str(w.message))
                    and w.message not in refused]
        # what the fit left behind, collected now (the crash came from such a collection)
        gc.collect()
        print(json.dumps({
            "fit": fit,
            "records": [[r.step, r.seq_len, r.peak_bytes] for r in cb.records],
            "independent": model.peaks,
            # the callback's own copies (the dry run's kept batch), alive in every step it measures
            "own": storage_bytes(own_tensors(cb.edge), "cpu"),
            "refused": [str(m) for m in refused],
            "failures": failures,
        }), flush=True)


if __name__ == "__main__":
    main()
