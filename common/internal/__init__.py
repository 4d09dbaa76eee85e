"""The course's machinery: what makes the simulator as strict as a GPU, and the tools.

Nothing here is needed to follow the course; the helpers learners use are in
``common`` itself (``pick``, ``ceil_div``, ``check``, ``guarded``,
``run_versions``, ``benchmark``, ...).

* :mod:`.simulator` -- launch limits, constant shared-array shapes and the
  speed-ups, patched into Numba's CUDA simulator.
* :mod:`.racecheck` -- the deterministic race detector.
* :mod:`.float32_purity` -- float64 promotion in float32 kernels, found by the
  CUDA front end's type inference.
* :mod:`.exercises` -- loading chapter modules and the learner's exercises.
* :mod:`.readme_sync` -- the README tables the scripts' figures come from.
"""
