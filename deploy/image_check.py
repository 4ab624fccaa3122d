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


_KERNELS = ("_C", "_C_stable_libtorch")  # vLLM's main kernel library: the CPU build's, the CUDA build's


def _kernel_library() -> tuple[str, Path] | None:
    """vLLM's main kernel library (module name, file), the first of _KERNELS the package holds. The CPU build
    also ships one per instruction set (_C_AVX2, …), loaded only on CPUs that need it: importing one of those
    where vLLM would not can crash the interpreter, so only the main one is loaded here."""
    import vllm

    root = Path(vllm.__file__).parent
    for name in _KERNELS:
        found = sorted(root.glob(f"{name}.*.so"))
        if found:
            return f"vllm.{name}", found[0]
    return None


def _has_cuda_ops() -> bool:
    """Whether vLLM's kernels are its CUDA build's (linked to libcudart; the CPU build's are not)."""
    library = _kernel_library()
    return library is not None and b"libcudart" in library[1].read_bytes()


def _ops_load() -> str:
    """Whether vLLM's main kernel library loads: "yes", or the error (a library the image lacks). The CUDA
    build's needs the NVIDIA driver's libcuda, which only a GPU machine has."""
    library = _kernel_library()
    if library is None:
        return f"none of {', '.join(_KERNELS)} in the vllm package"
    try:
        importlib.import_module(library[0])
    except ImportError as error:
        return f"{library[0]}: {error}"
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
