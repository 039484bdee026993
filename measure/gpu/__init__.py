"""What the models cost to run: the GPU check (``rlvla3 bench gpu``: ``bench_gpu`` runs the
entries of ``gpu_checks``, ``act_check``, ``fp8_check``, ``cost_check``, ``groot_check`` with the
sizes and context of ``check_context``; timing from ``rlvla3.model.timing``), the packing
benchmark (``rlvla3 bench packing``: ``bench_packing``), a training step's FLOPs and kernels by
kind (``step_profile``) and the LIBERO-like batches they all run on (``synthetic_obs``).
Imports torch, numpy and the core only: it runs on a GPU machine without Ray.
"""
