"""The README's install gets the CPU build of torch on a machine without a GPU, and `.ci/run` is the
README's test command.

The dry runs (``pip install --dry-run --report``) resolve against the public indexes only: this
machine's pip configuration (local wheel folders, local indexes) is left out, as on a fresh machine.
Where an index cannot be reached from here, the check says so and is skipped, never passed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from limits import run

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_PACKAGES = re.compile(r"^(nvidia-|cuda-|triton$)", re.I)
pytestmark = pytest.mark.slow


def _first_commands() -> tuple[str, str]:
    """The README's first two bash blocks: (install and run the demo, install and run the tests)."""
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    return blocks[0].strip(), blocks[1].strip()


def _steps(command: str) -> list[list[str]]:
    return [shlex.split(part) for part in command.split("&&")]


def _pip_steps(command: str) -> list[list[str]]:
    return [argv[2:] for argv in _steps(command) if argv[:2] == ["pip", "install"]]


def _fresh_env() -> dict[str, str]:
    """The environment of a fresh machine's pip: no PIP_* settings, no configuration files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    if os.environ.get("PIP_CERT"):
        env["PIP_CERT"] = os.environ["PIP_CERT"]  # the machine's CA bundle, not an index
    return env


def _dry_run(args: list[str], tmp_path: Path, *extra: str) -> tuple[list[str], str]:
    """``pip install --dry-run --report`` of ``args``: the ``name==version`` it would install, or
    skips the test when an index it names cannot be reached from this machine."""
    report = tmp_path / "report.json"
    proc = run([sys.executable, "-m", "pip", "install", "--dry-run", "--report", str(report),
                "--retries", "1", "--timeout", "30", *extra, *args], 120, env=_fresh_env(),
                cwd=ROOT)
    unreachable = re.search(
        r"Could not fetch URL (\S+?): connection error|Failed to establish a new connection"
        r"|Name or service not known|Temporary failure in name resolution", proc.stderr)
    if proc.returncode != 0 and unreachable:
        pytest.skip(f"an index of `pip install {' '.join(args)}` cannot be reached from this "
                    f"machine ({unreachable.group(0)[:160]}); the check needs it and was not made")
    assert proc.returncode == 0, proc.stderr[-3000:]
    installs = json.loads(report.read_text())["install"]
    return [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in installs], proc.stderr


def test_ci_runs_exactly_the_readme_test_command():
    _, tests = _first_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines(), f"`.ci/run` must run the README's test command:\n{tests}"
    assert tests.endswith("python -m pytest -q")


def test_the_readme_installs_torch_from_the_cpu_index_first():
    for command in _first_commands():
        pips = _pip_steps(command)
        torch_step, package_step = pips[0], pips[1]
        assert ("torch==2.13.0" in torch_step
                and torch_step[torch_step.index("--index-url") + 1] == CPU_INDEX)
        # unreachable: seconds, not minutes
        assert "--timeout" in torch_step and "--retries" in torch_step
        # then the package, whose torch>=2.4 the CPU torch satisfies
        assert package_step[:1] == ["-e"]
    assert CPU_INDEX in (ROOT / "pyproject.toml").read_text()


def test_the_readme_torch_step_resolves_the_cpu_build_and_no_cuda_package(tmp_path):
    torch_step = _pip_steps(_first_commands()[1])[0]
    installs, _ = _dry_run(torch_step, tmp_path, "--ignore-installed")
    names = [i.split("==")[0] for i in installs]
    assert [i for i in installs if i.startswith("torch==")] == ["torch==2.13.0+cpu"], installs
    assert not [n for n in names if CUDA_PACKAGES.match(n)], installs


def test_the_readme_package_step_after_the_cpu_torch_resolves_no_cuda_package(tmp_path):
    """The second step against the plain package index, with the first step's CPU torch installed
    (this environment's): nothing replaces torch, no CUDA package comes in."""
    import torch

    if torch.version.cuda is not None or "+cpu" not in torch.__version__:
        pytest.skip(f"this environment's torch is {torch.__version__}, not the CPU build the first "
                    "step installs")
    package_step = _pip_steps(_first_commands()[1])[1]
    installs, _ = _dry_run(package_step, tmp_path)
    names = [i.split("==")[0].lower() for i in installs]
    assert "torch" not in names and not [n for n in names if CUDA_PACKAGES.match(n)], installs


@pytest.mark.skipif(not os.environ.get("SEQMEM_INSTALL_CONTRAST"),
                    reason="opt-in (SEQMEM_INSTALL_CONTRAST=1): "
                    "resolving the CUDA build from the plain index takes 15-100 s of network")
def test_without_the_cpu_index_the_plain_index_resolves_cuda_packages(tmp_path):
    """Why the first step names the CPU index: the same pin against the plain package index alone
    resolves the CUDA build (what the check above would catch)."""
    installs, _ = _dry_run(["torch==2.13.0"], tmp_path, "--ignore-installed")
    assert [i for i in installs if CUDA_PACKAGES.match(i.split("==")[0])], installs
