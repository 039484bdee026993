"""The SFT job: supervised fine-tuning of a registered policy on LeRobot v3.0 datasets.

Modules:
    sft_job     the job: checks datasets, config and run directory, then starts Ray Train
    sft_config  ``SFTConfig`` (frozen) and the learning-rate schedule
    sft_worker  the Ray Train worker: data lake shard in, packed steps, checkpoints out

The module names keep their ``sft_`` prefix so that no two modules of the project share a
file name (``rlvla3/config.py``, the roles' workers). The command is ``commands.sft``.
"""
