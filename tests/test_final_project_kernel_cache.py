"""The capstone's compiled kernels are kept on disk (``@cuda.jit(cache=True)``) in the
course's cache folder, so a second run starts without compiling.

What runs here: the folder numba is told to use, and that every capstone kernel asks
to be cached. What only a GPU shows (the simulator compiles nothing, and ignores
``cache``): that a second process loads the kernels instead of compiling them; the
capstone README's cold and warm timings come from such a run.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import runtime

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CAPSTONE_KERNEL_FILES = ("kernels.py", "fast_layers.py", "fast_conv.py")


def _jit_decorators(tree):
    """(kernel name, the decorator's keyword names) of every ``cuda.jit`` / ``jit``
    decorated function in ``tree``, device functions left out."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            call = dec if isinstance(dec, ast.Call) else None
            name = ast.unparse(call.func if call else dec)
            if name not in ("cuda.jit", "jit"):
                continue
            keywords = {k.arg: k.value for k in call.keywords} if call else {}
            device = keywords.get("device")
            if isinstance(device, ast.Constant) and device.value:
                continue
            yield node.name, keywords


def test_every_capstone_kernel_asks_to_be_cached():
    found, uncached = 0, []
    for file in CAPSTONE_KERNEL_FILES:
        tree = ast.parse((ROOT / "final_project" / file).read_text())
        for name, keywords in _jit_decorators(tree):
            found += 1
            cache = keywords.get("cache")
            if not (isinstance(cache, ast.Constant) and cache.value is True):
                uncached.append(f"{file}: {name}")
    assert found >= 30, f"only {found} kernels found: did the files move?"
    assert not uncached, "kernels compiled again in every process: " + ", ".join(uncached)


def test_the_scan_sees_a_kernel_without_cache():
    tree = ast.parse(
        "@cuda.jit\ndef a(x): pass\n@cuda.jit(cache=True)\ndef b(x): pass\n"
        "@cuda.jit(device=True)\ndef c(x): pass\n@jit(launch_bounds=(64, 2))\ndef d(x): pass\n"
    )
    got = {name: "cache" in kw for name, kw in _jit_decorators(tree)}
    assert got == {"a": False, "b": True, "d": False}


def _cache_dir_in_a_fresh_process(env):
    code = "import common, numba.core.config as c; print(c.CACHE_DIR)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "NUMBA_ENABLE_CUDASIM": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_kernels_are_cached_in_the_course_folder_unless_numba_cache_dir_is_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    assert _cache_dir_in_a_fresh_process(env) == str(
        tmp_path / "xdg" / "cuda-python-course" / "numba"
    )
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    assert _cache_dir_in_a_fresh_process(env) == str(tmp_path / "mine")


def test_this_process_uses_the_folder_it_names():
    from numba.core import config

    assert Path(config.CACHE_DIR) == runtime.KERNEL_CACHE_DIR


@pytest.mark.gpu
@pytest.mark.skipif(
    common.is_simulator(), reason="needs a real GPU (the simulator compiles nothing)"
)
def test_a_second_process_loads_the_cached_kernels(tmp_path):
    # One training step in a fresh process fills an empty cache (every kernel a miss);
    # a second process with the same cache then loads every kernel (hits, no miss).
    code = (
        "import common, gc, json, numpy as np\n"
        "from final_project.fast_model import FastCNN\n"
        "from final_project.model import NetConfig\n"
        "from final_project import checks\n"
        "c = NetConfig(height=8, width=8, c1=2, c2=4, hidden=16)\n"
        "m = FastCNN(c, max_batch=4, seed=0)\n"
        "x, y = checks.random_batch(c, 4, np.random.default_rng(0))\n"
        "m.loss_and_grads(x, y); m.synchronize()\n"
        "ks = [o for o in gc.get_objects() if type(o).__name__ == 'CUDADispatcher']\n"
        "print(json.dumps([sum(sum(k.stats.cache_hits.values()) for k in ks),\n"
        "                  sum(sum(k.stats.cache_misses.values()) for k in ks)]))\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_ENABLE_CUDASIM": "0"}
    counts = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        counts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (hits1, misses1), (hits2, misses2) = counts
    assert misses1 > 0 and hits1 == 0, counts  # compiled, and written
    assert misses2 == 0 and hits2 == misses1, counts  # every one loaded
