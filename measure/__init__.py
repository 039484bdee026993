"""The measuring kit: every benchmark, the GPU check and the parity tools, in one place above
what they measure (``rlvla3 bench NAME`` is ``commands.bench``; nothing below imports this).

Packages:
    gpu      the GPU check (``rlvla3 bench gpu``), the packing benchmark, a step's profile;
             torch, numpy and the core only, so it runs on a GPU machine without Ray
    parity   our networks against LeRobot's reference implementations (fixtures)
    cluster  benchmarks of the RL pipeline on Ray: async ablation, batcher, engine, learning,
             scale, soak, storage, reference bands
    envs     what a simulator step costs (``rlvla3 bench env --sim libero|metaworld|isaaclab``)

Module:
    lake     ``rlvla3 bench lake``: the lake against a torch DataLoader feeding VLA training steps

Example::

    python -m rlvla3 bench env --sim metaworld --suite mt10 --task-ids 0 --json
"""
