"""Evaluation: closed-loop episodes of a policy on LIBERO or MetaWorld, results, comparisons.

Modules:
    evaluate    ``rlvla3 eval``'s run and ``--compare`` (the command: ``commands.eval``)
    suites      what a ``--suite`` evaluates: a LIBERO suite or a MetaWorld benchmark
    output_dir  an evaluation's output directory: its identity (what a resume must match),
                finished episodes, wall time over invocations
    rounds      ``EvalRound``: the episodes of one policy spread over eval workers (also used
                by periodic evaluation during RL)
    worker      ``EvalWorker``: whole episodes on one process-isolated env with a CPU policy copy
    recheck     ``rlvla3 eval --recheck DIR``: re-run a random subset, say whether it reproduces
    compare     paired statistics and tables of two evaluations (pure functions)
    media       MP4 videos of episodes and the success chart
"""
