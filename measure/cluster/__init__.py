"""Benchmarks of the RL pipeline: what ``rlvla3 bench NAME`` measures (the commands, with their
options and output, are ``commands.bench``).

Modules:
    bands           reference bands of success against env steps: the rule and the band file
    bench_async     the RL-VLA3 ablation: pipeline modes, throughput on this machine
    bench_band      a preset's band over seeds (``make``), new seeds against it (``check``)
    bench_batcher   adaptive batching against a grid of fixed B_max / T_max settings
    bench_engine    DDP and FSDP2 learner groups (one process a rank, no Ray) against one
                    rank: parameters after N steps, bytes held per rank
    bench_learning  sync vs async: success against env steps and wall time
    bench_scale     the GPU regime simulated at 8-32 GPUs: modes, planner, dilation check
    bench_soak      a long run with periodic kills: recovery time, memory over time
    bench_storage   checkpoint save / restore on a run's storage against a local disk

The ``bench_`` prefix stays: ``async`` is a Python keyword, and ``rlvla3/rollout/batcher.py`` and
``rlvla3/checkpoint/storage.py`` would otherwise share a file name with these.
"""
