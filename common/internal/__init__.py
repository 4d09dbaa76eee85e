"""The course's machinery: what makes the simulator as strict as a GPU, and the tools.

Nothing here is needed to follow the course; the helpers learners use are in
``common`` itself (``pick``, ``ceil_div``, ``check``, ``guarded``,
``run_versions``, ``benchmark``, ...).

* :mod:`.simulator` -- launch limits, constant shared-array shapes and the
  speed-ups, patched into Numba's CUDA simulator (``common`` calls its
  ``install()`` once, after all its imports, when the simulator is the runtime).
* :mod:`.racecheck` -- the deterministic race detector.

The errors they raise live in :mod:`common.errors`, which imports nothing of the
course; they re-export them.
* :mod:`.float32_purity` -- float64 promotion in float32 kernels, found by the
  CUDA front end's type inference.
* :mod:`.exercises` -- loading chapter modules and the learner's exercises.
* :mod:`.readme_sync` -- the README tables the scripts' figures come from.
"""
