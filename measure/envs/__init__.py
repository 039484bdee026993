"""What a simulator step, reset and process cost (``rlvla3 bench env --sim NAME``): ``libero``
(latency with fast rendering on and off, env steps/s per process count), ``metaworld`` (latency
and env steps/s per process count, with and without cameras) and ``isaaclab`` (one Isaac Lab
server per sub-env count: start, chunk and reset latency, env steps/s per slot and per core).
"""
