"""Random numbers on the device, reproducibly: Numba's xoroshiro128+ and torch's Philox.

version 1  numba.cuda.random: one xoroshiro128+ state per thread; state i starts
           i * 2**64 steps into the sequence (a "subsequence"), so threads never overlap
version 2  the same seed and the same thread -> the same numbers, whatever the block size
version 3  torch.Generator (Philox4x32-10 on CUDA, counter-based): seed + offset

Run:   python chapters/07_libraries/rng.py [--n N]
Sources: Blackman & Vigna, "Scrambled linear pseudorandom number generators"
(2018); Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC 2011).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling, pick
from common.checking import CheckError, check
from common.harness import run_script
from common.runtime import torch_cuda_available

import argparse

import numpy as np
import torch

sol = import_sibling(__file__, "solutions")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--n", type=int, default=pick(gpu=1 << 18, simulator=64), help="numbers to draw"
    )
    args = parser.parse_args(argv)
    n = args.n
    first = sol.random_uniform(n, seed=42, block=128)
    again = sol.random_uniform(n, seed=42, block=32)
    other = sol.random_uniform(n, seed=43)
    check(again, first, tol=0, name="same seed, other block size")
    if np.array_equal(first, other):
        raise CheckError("seeds 42 and 43 gave the same numbers")
    print(
        f"xoroshiro128+: seed 42 reproduced exactly with another block size; "
        f"seed 43 differs; mean {first.mean():.4f} (expect 0.5), "
        f"min {first.min():.4f}, max {first.max():.4f}"
    )

    device = "cuda" if torch_cuda_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(42)
    t1 = torch.rand(n, device=device, generator=g)
    t2 = torch.rand(n, device=device, generator=g)
    g.manual_seed(42)
    t1_again = torch.rand(n, device=device, generator=g)
    check(t1_again, t1, tol=0, name="torch same seed")
    if torch.equal(t1, t2):
        raise CheckError(
            "two draws from one torch.Generator were equal: its offset did not advance"
        )
    print(
        f"torch.Generator on {device}: re-seeding reproduces the numbers; a second draw "
        f"continues the stream (offset {g.get_offset() if device == 'cuda' else 'n/a (CPU generator)'})"
    )
    return 0


if __name__ == "__main__":
    run_script(main)
