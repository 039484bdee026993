"""Our networks against LeRobot's reference implementations, stage by stage, from fixtures a
committed script made in a scratch environment: ``vla`` (pi0.5, LeRobot 0.6.1's ``pi05``) and
``groot`` (GR00T-N1.5, LeRobot 0.5.1's ``groot``); each also checks an export round trip
(``python -m measure.parity.vla``, ``python -m measure.parity.groot``).
"""
