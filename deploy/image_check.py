"""What a built image holds, checked inside it (no GPU needed).

    docker run --rm -i --entrypoint python IMAGE - --expect cuda < deploy/image_check.py

Imports torch, vLLM and every module of services/, shared/, weight_sync/ and environments/ (an image missing a file or a
package fails here, not at a user's first start), and prints the versions the learner and each generator
compare before a weight push (weight_sync.plan.version_mismatches: torch, NCCL, vLLM) with the build each
comes in. --expect cuda (the GPU image) fails unless torch and vLLM are their CUDA builds; --expect cpu, unless
they are the CPU builds, vLLM's CPU kernels load and torch.compile works (a C++
compiler: vLLM's CPU sampling needs it). Nothing is put on a device.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path

PACKAGES = ("shared", "services", "weight_sync", "environments")


def import_all() -> list[str]:
    """Imports every module of PACKAGES; the names imported."""
    names = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        names.append(package)
        for module in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            importlib.import_module(module.name)
            names.append(module.name)
    return names


def builds() -> dict[str, object]:
    """The versions weight pushes compare, and the builds of torch and vLLM."""
    import torch
    import vllm

    from weight_sync.protocol import nccl_version, vllm_version

    cuda = torch.version.cuda
    return {
        "python": sys.version.split()[0],
        "torch": str(torch.__version__),
        "torch_cuda": cuda,
        "nccl": nccl_version(torch.device("cuda")) if cuda else None,  # no device is opened to read it
        "vllm": vllm_version(),
        "vllm_module": vllm.__version__,
        "vllm_cuda_ops": _has_cuda_ops(),
        "vllm_ops_load": _ops_load(),
    }


def _kernel_modules() -> dict[str, Path]:
    """vLLM's compiled kernel libraries by module name: ``vllm._C`` in the CPU build, ``vllm._C_stable_libtorch``
    (and others) in the CUDA build."""
    import vllm

    root = Path(vllm.__file__).parent
    return {f"vllm.{path.name.split('.')[0]}": path for path in sorted(root.glob("_C*.so"))}


def _has_cuda_ops() -> bool:
    """Whether vLLM's kernels are its CUDA build's (linked to libcudart; the CPU build's are not)."""
    return any(b"libcudart" in path.read_bytes() for path in _kernel_modules().values())


def _ops_load() -> str:
    """Whether vLLM's kernel libraries load: "yes", or the first error (a library the image lacks). The CUDA
    build's need the NVIDIA driver's libcuda, which only a GPU machine has."""
    modules = _kernel_modules()
    if not modules:
        return "no kernel library in the vllm package"
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as error:
            return f"{name}: {error}"
    return "yes"


def _inductor_compiles() -> str:
    """Whether torch.compile works on the CPU ("yes", or the error): vLLM's CPU sampler is compiled with it even
    in eager mode, and inductor needs a C++ compiler."""
    import torch

    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(4))
    except Exception as error:  # inductor raises many kinds; the message says which
        return f"{type(error).__name__}: {str(error)[:300]}"
    return "yes"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect", choices=["cuda", "cpu"], required=True)
    args = parser.parse_args()
    found = builds()
    found["modules_imported"] = len(import_all())
    print(json.dumps(found))
    cuda = bool(found["torch_cuda"]) and bool(found["vllm_cuda_ops"]) and found["nccl"] is not None
    if args.expect == "cpu" and found["vllm_ops_load"] != "yes":
        print(f"image_check: vLLM's CPU kernels do not load: {found['vllm_ops_load']}", file=sys.stderr)
        return 1
    if args.expect == "cpu":
        compiled = _inductor_compiles()
        if compiled != "yes":
            print(
                f"image_check: torch's inductor cannot compile here (vLLM's CPU sampling needs it): {compiled}",
                file=sys.stderr,
            )
            return 1
    if (args.expect == "cuda") != cuda:
        print(f"image_check: expected the {args.expect} builds of torch and vLLM, found {found}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
