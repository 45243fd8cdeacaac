"""Report files are written whole or not at all: a write that fails (a full disk, a file-size
limit) leaves the previous file as it was and no partial or temporary file behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from limits import limit_s


def test_a_write_that_fails_half_way_leaves_the_previous_png_whole(tmp_path):
    """A real short write: the process's file-size limit (RLIMIT_FSIZE) makes the kernel refuse the
    PNG's bytes past 2 KiB (EFBIG), as a full disk refuses them (ENOSPC)."""
    script = textwrap.dedent(
        f"""
        import os, resource, signal, pathlib, warnings
        warnings.filterwarnings("ignore")
        import matplotlib
        matplotlib.use("Agg")
        from lightning_seqmem.trainer.outputs import save_figure
        from lightning_seqmem.plan.planner import SeqMemPlanner
        from lightning_seqmem.plan.view import PlanView
        target = pathlib.Path({str(tmp_path)!r}) / "seqmem_memory.png"
        target.write_bytes(b"previous figure")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
        try:
            save_figure(PlanView.of(SeqMemPlanner()), target)
        except OSError as exc:
            print("refused", exc.errno)
        else:
            print("written")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=limit_s(120))
    assert out.returncode == 0, out.stderr
    # the figure is larger than 2 KiB: the write failed
    assert out.stdout.split()[0] == "refused", out.stdout
    assert (tmp_path / "seqmem_memory.png").read_bytes() == b"previous figure"
    # no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seqmem_memory.png"]
