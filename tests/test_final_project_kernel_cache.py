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
import time
from pathlib import Path

import pytest
from kernel_decorators import asks_for_cache, jit_decorators

ROOT = Path(__file__).resolve().parent.parent
CAPSTONE_KERNEL_FILES = ("kernels.py", "fast_layers.py", "fast_conv.py")


def test_every_capstone_kernel_asks_to_be_cached():
    found, uncached = 0, []
    for file in CAPSTONE_KERNEL_FILES:
        tree = ast.parse((ROOT / "final_project" / file).read_text())
        for name, keywords in jit_decorators(tree):
            found += 1
            if not asks_for_cache(keywords):
                uncached.append(f"{file}: {name}")
    assert found >= 30, f"only {found} kernels found: did the files move?"
    assert not uncached, "kernels compiled again in every process: " + ", ".join(uncached)


def test_the_scan_sees_a_kernel_without_cache():
    tree = ast.parse(
        "@cuda.jit\ndef a(x): pass\n@cuda.jit(cache=True)\ndef b(x): pass\n"
        "@cuda.jit(device=True)\ndef c(x): pass\n@jit(launch_bounds=(64, 2))\ndef d(x): pass\n"
    )
    got = {name: asks_for_cache(kw) for name, kw in jit_decorators(tree)}
    assert got == {"a": False, "b": True, "d": False}


def _run(code_or_args, env):
    """Run ``python -c code`` (or ``python *args``) in a fresh process from the
    repository root; its last line of output."""
    args = code_or_args if isinstance(code_or_args, list) else ["-c", code_or_args]
    done = subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _cache_dir_in_a_fresh_process(env):
    code = "import common, numba.core.config as c; print(c.CACHE_DIR)"
    return _run(code, {**env, "NUMBA_ENABLE_CUDASIM": "1"})


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


# One training step and one evaluation forward of a small FastCNN in a fresh process,
# printing every kernel's numba cache counters as JSON {name: [hits, misses]}.
_STEP_AND_COUNT = (
    "import common, gc, json, numpy as np\n"
    "from final_project.fast_model import FastCNN\n"
    "from final_project.model import NetConfig\n"
    "from final_project import checks\n"
    "c = NetConfig(height=8, width=8, c1=2, c2=4, hidden=16)\n"
    "m = FastCNN(c, max_batch=4, seed=0, graph=False)\n"
    "x, y = checks.random_batch(c, 4, np.random.default_rng(0))\n"
    "m.train_step(x, y, 0.01); m.predict(x); m.synchronize()\n"
    "ks = [o for o in gc.get_objects() if type(o).__name__ == 'CUDADispatcher']\n"
    "counts = {}\n"
    "for k in ks:\n"
    "    try:\n"
    "        s = k.stats\n"
    "    except AttributeError:\n"  # a device function: compiled into its kernels
    "        continue\n"
    "    h, mi = sum(s.cache_hits.values()), sum(s.cache_misses.values())\n"
    "    if h or mi:\n"
    "        name = k.py_func.__qualname__ + ':' + str(k.py_func.__code__.co_firstlineno)\n"
    "        old = counts.get(name, [0, 0])\n"
    "        counts[name] = [old[0] + h, old[1] + mi]\n"
    "print(json.dumps(counts))\n"
)
SMALL_SPEC = (
    '{"config": {"in_channels": 1, "height": 8, "width": 8, "c1": 2, "c2": 4, "hidden": 16, '
    '"num_classes": 10, "bn_eps": 1e-05, "bn_momentum": 0.1}, "train_sizes": [4], '
    '"eval_sizes": [4], "conv1": "direct"}'
)


def _gpu_env(cache):
    return {**os.environ, "NUMBA_CACHE_DIR": str(cache), "NUMBA_ENABLE_CUDASIM": "0"}


@pytest.mark.gpu
@pytest.mark.skipif(
    common.is_simulator(), reason="needs a real GPU (the simulator compiles nothing)"
)
def test_a_second_process_loads_the_cached_kernels(tmp_path):
    # A fresh process fills an empty cache (every kernel compiled: a miss); a second
    # process with the same cache then loads every kernel (no miss at all).
    env = _gpu_env(tmp_path)
    first = json.loads(_run(_STEP_AND_COUNT, env))
    second = json.loads(_run(_STEP_AND_COUNT, env))
    assert sum(m for _, m in first.values()) >= 10, first
    compiled_again = {k: v for k, v in second.items() if v[1]}
    assert not compiled_again, f"compiled again in the second process: {compiled_again}"
    assert set(second) == set(first), (first, second)


@pytest.mark.gpu
@pytest.mark.skipif(
    common.is_simulator(), reason="needs a real GPU (the simulator compiles nothing)"
)
def test_precompile_workers_leave_every_kernel_in_the_cache(tmp_path):
    # Three workers share the step's kernels; none launches anything. A process
    # running the same step afterwards compiles nothing.
    env = _gpu_env(tmp_path)
    compiled = []
    for k in range(3):
        out = _run(
            ["-m", "final_project.precompile", "--worker", f"{k}/3", "--spec", SMALL_SPEC], env
        )
        compiled.append([name for name, _, _ in json.loads(out)])
    assert all(compiled), compiled  # each worker had a share
    after = json.loads(_run(_STEP_AND_COUNT, env))
    compiled_again = {k: v for k, v in after.items() if v[1]}
    assert not compiled_again, f"left for the run to compile: {compiled_again}"
    assert sum(h for h, _ in after.values()) >= 10, after


# -- compile_only and the precompile bookkeeping, without a GPU ------------------------


def _factory():
    def kernel(x):  # one source function: every FakeDispatcher of it shares its code
        pass

    return kernel


class FakeDispatcher:
    """Stands in for numba's CUDADispatcher: records compiles and real launches.
    ``function`` names its source function: dispatchers built with the same name
    share one code object, as the kernels of one factory do."""

    compiles: list = []
    launches: list = []
    _functions: dict = {}

    def __init__(self, name, function=None):
        self.name = self.__name__ = name
        self.function = function or name
        self.py_func = FakeDispatcher._functions.setdefault(function or name, _factory())
        # the same code object for one function, another for each other function
        self.py_func.__code__ = self.py_func.__code__.replace(
            co_firstlineno=1000 + list(FakeDispatcher._functions).index(function or name)
        )

    def typeof_pyval(self, value):
        return type(value).__name__

    def compile(self, types):
        FakeDispatcher.compiles.append((self.name, types))

    def call(self, args, launch_config=None):
        FakeDispatcher.launches.append(self.name)


class FakeIndexFile:
    """Stands in for numba's IndexDataCacheFile: compile_only locks its saves."""

    def real_save(self, key, data):
        pass

    save = real_save


def _launch_sequence():
    FakeDispatcher._functions = {}
    a, b, c = FakeDispatcher("a"), FakeDispatcher("b"), FakeDispatcher("c")
    # two kernels of one factory: one source function, so one process compiles both
    f1, f2 = FakeDispatcher("f1", "factory"), FakeDispatcher("f2", "factory")
    d, e = FakeDispatcher("d"), FakeDispatcher("e")
    # 9 distinct (kernel, types) pairs of 6 source functions, some launched twice
    return [
        (a, (1,)),
        (b, (1.0,)),
        (a, (1,)),
        (f1, (1,)),
        (a, ("s",)),
        (c, (1,)),
        (f2, (1,)),
        (b, (2.0,)),
        (d, (1,)),
        (e, (1,)),
        (c, (1.5,)),
        (f2, (1,)),
    ]


def _types(args):
    return (type(args[0]).__name__,)


@pytest.mark.parametrize("by", ["kernel", "function"])
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
def test_compile_only_shares_every_kernel_once_and_launches_none(shards, by, monkeypatch):
    import common.kernel_cache as kc

    if by == "function":  # a platform without fcntl (Windows): no lock, share by function
        monkeypatch.setattr(kc, "fcntl", None)
    launches = _launch_sequence()
    real_call = FakeDispatcher.call
    FakeDispatcher.compiles, FakeDispatcher.launches = [], []
    shares = []
    for shard in range(shards):
        before = len(FakeDispatcher.compiles)
        with kc.compile_only(shard, shards, FakeDispatcher, FakeIndexFile) as plan:
            assert plan.by == by
            assert FakeIndexFile.save is not FakeIndexFile.real_save or by == "function"
            for d, args in launches:
                d.call(args, None)
        shares.append(FakeDispatcher.compiles[before:])
        assert [(n, t) for n, t, _ in plan.compiled] == shares[-1]
    assert FakeDispatcher.call is real_call  # the launch path is given back
    assert FakeIndexFile.save is FakeIndexFile.real_save  # and the cache's save
    assert FakeDispatcher.launches == []  # nothing ran
    every = [x for share in shares for x in share]
    assert sorted(every) == sorted({(d.name, _types(a)) for d, a in launches})
    assert len(every) == len(set(every)) == 9  # each pair compiled by exactly one shard
    if by == "kernel":
        per_shard = [len(share) for share in shares]
    else:
        function_of = {d.name: d.function for d, _ in launches}
        owners = {}  # source function -> the shards that compiled a version of it
        for shard, share in enumerate(shares):
            for name, _ in share:
                owners.setdefault(function_of[name], set()).add(shard)
        assert all(len(o) == 1 for o in owners.values()), owners  # one process a function
        per_shard = [sum(1 for o in owners.values() if shard in o) for shard in range(shards)]
    assert max(per_shard) - min(per_shard) <= 1  # kernels (functions) evenly shared


_SAVER = """
import os, sys, time
from common.kernel_cache import locked_cache_saves
from numba.cuda.core.caching import IndexDataCacheFile
index = IndexDataCacheFile(sys.argv[1], "kernel-1.py311", "stamp")
open(os.path.join(sys.argv[1], sys.argv[2] + ".ready"), "w").close()
while not os.path.exists(os.path.join(sys.argv[1], "go")):  # start together
    time.sleep(0.001)
with locked_cache_saves():
    for i in range(int(sys.argv[3])):
        index.save((sys.argv[2], i), (sys.argv[2], i))
"""


def test_locked_saves_keep_every_entry_of_processes_saving_at_once(tmp_path):
    """Numba's index is read, added to and written whole by each save: without the
    lock, processes saving versions of one function at once lose entries or give two
    keys one data file. Under locked_cache_saves every key names its own data."""
    from numba.cuda.core.caching import IndexDataCacheFile

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(tmp_path), f"p{k}", "100"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for k in range(2)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("*.ready"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    (tmp_path / "go").touch()
    assert [p.wait(timeout=120) for p in procs] == [0] * 2
    index = IndexDataCacheFile(str(tmp_path), "kernel-1.py311", "stamp")
    overloads = index._load_index()
    keys = {(f"p{k}", i) for k in range(2) for i in range(100)}
    assert set(overloads) == keys
    assert len(set(overloads.values())) == len(keys)  # a data file a key
    assert all(index.load(key) == key for key in keys)  # holding that key's data


def test_compile_only_gives_back_the_launch_path_after_an_error():
    from common.kernel_cache import compile_only

    real_call = FakeDispatcher.call
    with pytest.raises(ZeroDivisionError):
        with compile_only(0, 1, FakeDispatcher):
            raise ZeroDivisionError
    assert FakeDispatcher.call is real_call


@pytest.mark.parametrize("shard,shards", [(0, 0), (2, 2), (-1, 3)])
def test_compile_only_refuses_a_shard_out_of_range(shard, shards):
    from common.kernel_cache import compile_only

    with pytest.raises(ValueError, match="shard must be in"):
        with compile_only(shard, shards, FakeDispatcher):
            pass


@pytest.mark.skipif(not common.is_simulator(), reason="the simulator's refusal")
def test_compile_only_refuses_the_simulator():
    from common.kernel_cache import compile_only

    with pytest.raises(RuntimeError, match="needs a GPU"):
        with compile_only(0, 1):
            pass


def test_precompile_record_key_follows_the_spec_and_the_device():
    from final_project import precompile
    from final_project.model import NetConfig

    spec = precompile.Spec(NetConfig(), (64,), (64, 16))
    assert precompile.Spec.from_json(spec.to_json()) == spec
    key = precompile.record_key(spec, "GPU A", "0.30.4")
    assert key == precompile.record_key(spec, "GPU A", "0.30.4")
    others = {
        precompile.record_key(precompile.Spec(NetConfig(), (256,), (64, 16)), "GPU A", "0.30.4"),
        precompile.record_key(
            precompile.Spec(NetConfig(c2=32), (64,), (64, 16)), "GPU A", "0.30.4"
        ),
        precompile.record_key(spec, "GPU B", "0.30.4"),
        precompile.record_key(spec, "GPU A", "0.31.0"),
    }
    assert key not in others and len(others) == 4


def test_precompile_record_key_follows_the_kernel_sources(monkeypatch, tmp_path):
    from final_project import precompile
    from final_project.model import NetConfig

    spec = precompile.Spec(NetConfig(), (64,))
    for rel in precompile.SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((ROOT / rel).read_bytes())
    monkeypatch.setattr(precompile, "ROOT", tmp_path)
    key = precompile.record_key(spec, "GPU", "v")
    edited = tmp_path / "final_project" / "fast_conv.py"
    edited.write_text(edited.read_text() + "\n# a learner's edit\n")
    assert precompile.record_key(spec, "GPU", "v") != key


@pytest.mark.skipif(not common.is_simulator(), reason="the simulator's behaviour")
def test_precompile_in_the_simulator_starts_nothing_and_says_so():
    from final_project import precompile
    from final_project.model import NetConfig

    job = precompile.start(NetConfig(), (4,), (4,), workers=4)
    assert job.procs == [] and "simulator" in job.wait()
    done = subprocess.run(
        [sys.executable, "-m", "final_project.precompile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"},
    )
    assert done.returncode == 2 and "needs a GPU" in done.stderr


@pytest.mark.parametrize(
    "n,batch,drop_last,want",
    [
        (10, 4, True, (4,)),
        (10, 4, False, (4, 2)),
        (8, 4, False, (4,)),
        (3, 4, False, (3,)),
        (1, 1, False, (1,)),
    ],
)
def test_epoch_batch_sizes(n, batch, drop_last, want):
    import numpy as np

    from final_project.data import EpochBatches

    b = EpochBatches(
        np.zeros((n, 1, 2, 2), np.float32),
        np.zeros(n, np.int32),
        batch,
        drop_last=drop_last,
        pinned=False,
    )
    assert b.batch_sizes() == want


def test_a_broken_copy_of_a_cached_kernel_asks_for_no_cache():
    # tests/mutants.py compiles edited source that has no file: numba cannot cache
    # it ("no locator available" on a GPU), so the copy must not ask to be cached.
    import linecache

    from mutants import mutant

    from final_project import fast_layers

    broken = mutant(fast_layers.mean_reduce_kernel, ("out[0] = s[0]", "out[0] = -s[0]"))
    source = "".join(linecache.getlines(broken.py_func.__code__.co_filename))
    assert "cache=False" in source and "cache=True" not in source
    assert "out[0] = -s[0]" in source
