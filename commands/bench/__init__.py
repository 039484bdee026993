"""``rlvla3 bench NAME``: one module per benchmark, each with ``parser()`` and ``main(argv)``.

The measurements are the measuring kit's (``measure``: ``measure.cluster``, ``measure.gpu``,
``measure.envs``, ``measure.lake``); a benchmark's help is its measuring module's docstring. Modules are named
after the benchmark, ``async_`` with a trailing underscore since ``async`` is a Python keyword.
"""
