"""The throwaway environment hetu-galvatron 2.4.0 runs in, and one search run through it.

Galvatron is published as an sdist only; its declared dependencies include CUDA-only and
training-only packages (flash-attn optionally, transformers, torchvision, h5py, ...), none of
which its search needs. So the environment is built with `--no-deps` for Galvatron itself and
only what the search path imports:

* build: setuptools (< 81, which still ships `pkg_resources`, imported by the bundled Megatron),
  wheel and pybind11 (its C++ layer DP `galvatron_dp_core` is compiled at install);
* search: numpy, scipy (curve fitting of profiles), tqdm;
* import of `galvatron.core`: torch, einops, six, regex, pyyaml. Torch is pinned to the
  version of our `runtime` extra (2.13.0): `==2.13.0` also matches the `2.13.0+cpu` build, which
  pip prefers when one is on its find-links or index, so no CUDA libraries are pulled in.
  Elsewhere set `DYNAPIPE_GALVATRON_TORCH` to the pip arguments that give a CPU build, e.g.
  `torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu` (an unpinned `torch` from
  PyPI brings about 5 GB of CUDA wheels).

NVIDIA Apex (`apex`, `amp_C`) has no CPU build and is stubbed by `runner.py`.
The environment lives under `~/.cache/dynapipe/galvatron-2.4.0` (or `$DYNAPIPE_CACHE`) and is
reused until `build_env(rebuild=True)`.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import venv

GALVATRON_SPEC = "hetu-galvatron==2.4.0"
BUILD_REQUIREMENTS = ("setuptools<81", "wheel", "pybind11>=2.9.1")
RUNTIME_REQUIREMENTS = ("numpy", "scipy", "tqdm", "einops", "six", "regex", "pyyaml")
TORCH_REQUIREMENT = "torch==2.13.0"
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")
_READY_MARK = "galvatron-ready.json"


def default_env_dir() -> str:
    root = os.environ.get("DYNAPIPE_CACHE")
    root = root or os.path.join(os.path.expanduser("~"), ".cache", "dynapipe")
    return os.path.join(root, "galvatron-2.4.0")


def env_python(env_dir: str) -> str:
    return os.path.join(env_dir, "bin", "python")


def _clean_environ() -> dict[str, str]:
    """Our process's environment without what would leak our interpreter's packages in."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _pip(env_dir: str, *args: str, log) -> None:
    cmd = [env_python(env_dir), "-m", "pip", "install", "--disable-pip-version-check", *args]
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=_clean_environ())


def build_env(env_dir: str | None = None, *, rebuild: bool = False, verbose: bool = False) -> str:
    """Create (or reuse) the venv with Galvatron installed; returns its directory.

    Raises `RuntimeError` with the pip log's tail when the installation fails.
    """
    env_dir = env_dir or default_env_dir()
    mark = os.path.join(env_dir, _READY_MARK)
    if os.path.exists(mark) and not rebuild:
        return env_dir
    if os.path.exists(env_dir):
        shutil.rmtree(env_dir)
    os.makedirs(env_dir)
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    log_path = os.path.join(env_dir, "install.log")
    with open(log_path, "w") as log:
        try:
            torch_args = shlex.split(os.environ.get("DYNAPIPE_GALVATRON_TORCH", TORCH_REQUIREMENT))
            _pip(env_dir, *torch_args, log=log)
            _pip(env_dir, *BUILD_REQUIREMENTS, *RUNTIME_REQUIREMENTS, log=log)
            # No build isolation: the build needs pybind11 from this environment, and no deps:
            # see the module docstring.
            _pip(env_dir, "--no-deps", "--no-build-isolation", GALVATRON_SPEC, log=log)
        except subprocess.CalledProcessError as exc:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"installing {GALVATRON_SPEC} failed ({exc}):\n{tail}") from exc
    with open(mark, "w") as f:
        json.dump({"spec": GALVATRON_SPEC, "python": sys.version.split()[0]}, f)
    if verbose:
        print(f"built {GALVATRON_SPEC} environment in {env_dir}")
    return env_dir


def run_searches(env_dir: str, jobs: list[dict], *, timeout_s: float = 3600.0) -> dict:
    """Run `runner.py` on `jobs` in one process of the environment; returns its JSON summary
    (`results`, one per job in order, `import_s`, `total_s`).

    A job needs `profile_dir`, `model_name`, `hidden_size`, `num_layers`, `seq_len`,
    `num_nodes`, `gpus_per_node`, `memory_gb`, `global_batch`, `max_tp`, `max_pp`, and
    optionally `evaluate` (plans to price); jobs without a `work_dir` get one in a temporary
    directory removed afterwards.
    """
    scratch = tempfile.mkdtemp(prefix="galvatron-run-")
    try:
        jobs = [
            {**job, "work_dir": job.get("work_dir") or os.path.join(scratch, f"job{i}")}
            for i, job in enumerate(jobs)
        ]
        jobs_path = os.path.join(scratch, "jobs.json")
        with open(jobs_path, "w") as f:
            json.dump({"jobs": jobs}, f)
        proc = subprocess.run(
            [env_python(env_dir), RUNNER, jobs_path],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=scratch,
            env=_clean_environ(),
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"galvatron runner failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
