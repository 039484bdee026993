"""The RL job: from a validated config to a summary, wiring the roles of ``actors.roles``.

Modules:
    preflight      ``rlvla3 rl --print-plan``: placement and per-node memory before any actor
    plan_job       a cluster planned from GPU costs and env latencies (``rlvla3 plan``, ``--plan``)
    controller     ``Controller``: one run in sequence (start, drive, checkpoint, stop, summary)
    topology       which actors exist, their resources and placement, and how they are wired
    schedule       the sync and async schedules: each owns the run's loop (and the async stop)
    drivers        rollout drivers (lockstep, pipelined, autoreset, async) chosen by config
    capacity       which actors do not run, since when, and what the run does about it
    failures       when a learner error rebuilds the learner group and when it ends the run
    checkpointer   when the run saves its state, and what a resume restores beside the learner
    periodic_eval  evaluation beside rollout and training, never pausing them
    step_log       the learner's per-step objective figures: file, progress row, summary
    budget         when a run stops: env steps, minutes, target success, a stop asked for
    summary        the summary's pure figures: batch sizes, memory estimated vs measured, split

``controller`` and ``topology`` are the only modules that know the topology. The commands that
start a run, print its plan or plan a cluster are ``commands.rl`` and ``commands.plan``.
"""
