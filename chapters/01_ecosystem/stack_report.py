"""Which parts of the GPU / deep-learning stack are on this machine?

Prints, for each layer of the stack (frameworks, compilers, libraries, the Numba path
to the GPU), whether it is installed and which version, then the GPU (or the
simulator). Nothing here is required except numba-cuda and NumPy; the rest is a map.

Run: python chapters/01_ecosystem/stack_report.py [--out runs/01_ecosystem]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import runtime
from common.harness import run_script, script_parser

import importlib.metadata as metadata
import json
import platform

# (layer, distribution name on PyPI, what it is) -- one line each, in stack order.
STACK = [
    ("framework", "torch", "PyTorch: eager tensors + autograd; torch.compile -> Triton kernels"),
    ("framework", "jax", "JAX: NumPy-like, traced and compiled by XLA"),
    ("framework", "tensorflow", "TensorFlow / Keras: graph framework, XLA compiler"),
    ("kernel DSL", "triton", "Triton: Python kernels over tiles, compiled via MLIR to PTX"),
    (
        "kernel DSL",
        "numba-cuda",
        "Numba CUDA target: Python kernels -> LLVM/NVVM -> PTX (this course)",
    ),
    ("kernel DSL", "numba", "Numba core: Python bytecode -> Numba IR -> LLVM (CPU)"),
    ("kernel DSL", "cuda-python", "NVIDIA's Python bindings to the driver/runtime APIs"),
    ("kernel DSL", "cupy", "CuPy: NumPy on the GPU, plus raw CUDA C++ kernels"),
    ("deployment", "onnx", "ONNX: a file format for trained graphs"),
    ("deployment", "onnxruntime", "ONNX Runtime: runs ONNX graphs on CPU/GPU back ends"),
    ("deployment", "tensorrt", "TensorRT: NVIDIA's inference optimizer and runtime"),
    ("deployment", "vllm", "vLLM: LLM serving (paged attention, batching)"),
    ("compiler", "llvmlite", "llvmlite: Numba's binding to LLVM"),
    ("library", "nvidia-cublas-cu12", "cuBLAS (CUDA 12 wheel): dense linear algebra, SGEMM"),
    ("library", "nvidia-cublas", "cuBLAS (CUDA 13 wheel)"),
    ("library", "nvidia-cudnn-cu12", "cuDNN (CUDA 12 wheel): convolutions, attention, norms"),
    ("library", "nvidia-cudnn-cu13", "cuDNN (CUDA 13 wheel)"),
    ("library", "nvidia-cufft-cu12", "cuFFT (CUDA 12 wheel): fast Fourier transforms"),
    ("library", "nvidia-curand-cu12", "cuRAND (CUDA 12 wheel): random numbers"),
    ("library", "nvidia-nccl-cu12", "NCCL (CUDA 12 wheel): multi-GPU collectives"),
    ("library", "nvidia-cuda-nvrtc-cu12", "NVRTC (CUDA 12 wheel): runtime C++ -> PTX compiler"),
    ("library", "nvidia-nvjitlink-cu12", "nvJitLink (CUDA 12 wheel): links PTX/LTO-IR at run time"),
    ("library", "nvidia-cuda-nvrtc", "NVRTC (CUDA 13 wheel)"),
    ("library", "nvidia-nvjitlink", "nvJitLink (CUDA 13 wheel)"),
    ("library", "numpy", "NumPy: the CPU reference for every kernel in this course"),
]


def installed_version(dist):
    """Version string of an installed distribution, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def gpu_description():
    """One line: the GPU's name and compute capability, or why kernels run in the simulator."""
    if runtime.is_simulator():
        return f"simulator ({runtime.REASON})"
    from numba import cuda

    cc = ".".join(map(str, cuda.get_current_device().compute_capability))
    return f"{runtime.device_name()}, compute capability {cc}"


def report():
    """{"python", "platform", "runtime", "device", "stack": [{layer, package, version, what}]}."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "runtime": runtime.runtime_name(),
        "device": gpu_description(),
        "stack": [
            {"layer": layer, "package": dist, "version": installed_version(dist), "what": what}
            for layer, dist, what in STACK
        ],
    }


def main(argv=None):
    args = script_parser(__doc__, "01_ecosystem").parse_args(argv)
    r = report()
    print(f"Python {r['python']} on {r['platform']}")
    print(f"kernels run on: {r['device']}")
    for row in r["stack"]:
        version = row["version"] or "-"
        print(f"  {row['layer']:<11} {row['package']:<24} {version:<14} {row['what']}")
    if installed_version("torch"):
        import torch

        print(
            f"torch CUDA build: {torch.version.cuda}; torch sees a GPU: {torch.cuda.is_available()}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stack.json").write_text(json.dumps(r, indent=2))
    print(f"wrote {args.out / 'stack.json'}")
    return 0


if __name__ == "__main__":
    run_script(main)
