"""When an RL run stops: its budget (env steps, minutes, target success) or a stop asked for.

Input: the run's ``RunConfig``; the run's counters as it goes (a resumed run's counters count
the whole run, so both limits do too); success rates from training episodes or held-out
evaluations. Output: ``stop_reason``, the limit that ends the run now (the summary's
``stopped_by``) or None; ``line``, the budget as one sentence said at the start;
``target_reached``, where ``target_success`` was first reached. No Ray: the controller feeds it.

Invariant: the first time the target is reached is kept; later rates never move it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from actors.observe.collect import WaitingForActors
from rlvla3.run_config import RunConfig


class RunBudget:
    """The limits one run stops at, whichever is reached first (see the module docstring)."""

    def __init__(self, cfg: RunConfig, log: Callable[[str], None]):
        self.cfg = cfg
        self._log = log
        self.asked: str | None = None
        """Why a stop was asked for (a signal, a caller); None while none was."""
        self.target_reached: dict | None = None
        """Where the run first reached ``cfg.target_success`` (None: not yet)."""
        self.base: dict = {"env_steps": 0, "wall_s": 0.0}
        """The counters this leg started from (a resumed run's, else zeros)."""
        self.start = time.monotonic()

    def begin(self, counters: dict) -> None:
        """This leg starts now, from ``counters``."""
        self.base = dict(counters)
        self.start = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since this leg began."""
        return time.monotonic() - self.start

    def stop_reason(self, env_steps: Callable[[], int]) -> str | None:
        """The limit that ends the run now, or None; ``env_steps()`` gives this leg's steps
        (it may raise ``WaitingForActors`` before any env worker runs)."""
        cfg = self.cfg
        if self.asked is not None:
            return self.asked
        if self.target_reached is not None:
            return f"target_success={cfg.target_success:g}"
        if cfg.max_minutes and (self.base["wall_s"] + self.elapsed()) / 60 >= cfg.max_minutes:
            return f"max_minutes={cfg.max_minutes:g}"
        try:
            steps = env_steps()
        except WaitingForActors:
            return None
        if self.base["env_steps"] + steps >= cfg.total_env_steps:
            return f"total_env_steps={cfg.total_env_steps}"
        return None

    def line(self, counters: dict) -> str:
        """The limits the run stops at: whichever is reached first ends it."""
        cfg = self.cfg
        limits = [f"{cfg.total_env_steps} env steps (total_env_steps)"]
        if cfg.max_minutes:
            limits.append(f"{cfg.max_minutes:g} min (max_minutes)")
        if cfg.target_success:
            source = ("held-out evaluation" if cfg.eval_every
                      else f"last {cfg.target_window}+ training episodes")
            limits.append(f"success >= {cfg.target_success:g} on the {source} (target_success)")
        line = (f"budget: {limits[0]}" if len(limits) == 1 else
                f"budget: {', '.join(limits[:-1])} or {limits[-1]}, whichever comes first")
        if counters["env_steps"]:  # resumed: both limits count the whole run
            line += (f"; the run has taken {counters['env_steps']} env steps and "
                     f"{counters['wall_s'] / 60:.1f} min before this leg")
        return line

    def check_target(self, source: str, rate: float, episodes: int, version: int,
                     counters: dict) -> None:
        """Record the first time ``rate`` reaches ``cfg.target_success``: the run then stops.
        The env steps and wall time are the run's when the rate became known (for an
        evaluation, when it finished, not when its checkpoint was taken)."""
        target = self.cfg.target_success
        if not target or self.target_reached is not None or rate < target:
            return
        steps, wall = counters["env_steps"], round(counters["wall_s"], 1)
        self.target_reached = {"source": source, "success_rate": round(rate, 4),
                               "episodes": episodes, "policy_version": version,
                               "env_steps": steps, "wall_s": wall}
        self._log(f"target success {target:g} reached: {rate:.2f} over {episodes} {source} "
                  f"episodes at {steps} env steps, {wall}s")
