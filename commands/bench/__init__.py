"""``rlvla3 bench NAME``: one module per benchmark, each with ``parser()`` and ``main(argv)``.

The measurements live beside what they measure (``actors.bench``, ``rlvla3.compute``,
``datalake.bench``); a benchmark's help is its measuring module's docstring. Modules are named
after the benchmark, ``async_`` with a trailing underscore since ``async`` is a Python keyword.
"""
