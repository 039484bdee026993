"""How an evaluated policy acts and what it is told: ``rlvla3 eval --sampled`` and
``--language``.

Each sampled episode's noise is a fixed function of (seed, task, initial state), so an episode
reads the same whichever worker runs it and after a resume; the option overrides reach the
policy's config and bad ones are refused before an episode runs. ``--language`` tells the
policy another instruction than the env's, and an evaluation records what it was told."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from actors.eval.evaluate import acting
from actors.eval.worker import ActionSource, EvalWorker, given_instructions
from commands.eval import parse_args
from rlvla3.config import ConfigError, Named

ENV = Named("reach", {"image_size": 16})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from envs import env_spec
    from rlvla3.checkpoint.files import CheckpointMeta, save_checkpoint
    from rlvla3.policies import build_policy

    choice = Named("vla", {"preset": "tiny", "noise_level": 0.5})
    spec = env_spec(ENV)
    path = tmp_path_factory.mktemp("sampled") / "ckpt"
    save_checkpoint(path, build_policy(choice, spec), CheckpointMeta(choice, spec, 1))
    return str(path)


def _frames(worker: EvalWorker, task: int, init_state: int) -> np.ndarray:
    outcome = worker.run_episode(task, init_state, record=True)
    assert outcome.frames is not None and not outcome.fault
    return outcome.frames


def test_a_sampled_episode_is_a_fixed_function_of_seed_task_and_state(checkpoint):
    sampled = ActionSource("checkpoint", checkpoint, (("noise_level", 0.3),), seed=5)
    first, second = EvalWorker(ENV, sampled, seed=0), EvalWorker(ENV, sampled, seed=1)
    assert first.policy.cfg.noise_level == 0.3 and first.policy.cfg.init_noise == 1.0
    reported = first.describe()["sampling"]  # what the fingerprint records: values in effect
    assert reported["noise_level"] == 0.3 and reported["init_noise"] == 1.0
    episode = _frames(first, 0, 3)
    _frames(first, 1, 0)  # what a worker ran before does not leak into the next episode
    assert np.array_equal(_frames(first, 0, 3), episode)
    assert np.array_equal(_frames(second, 0, 3), episode)  # another worker, another seed
    other_seed = EvalWorker(ENV, ActionSource("checkpoint", checkpoint, (("noise_level", 0.3),),
                                              seed=6))
    assert not np.array_equal(_frames(other_seed, 0, 3), episode)
    mode = EvalWorker(ENV, ActionSource("checkpoint", checkpoint))
    assert mode.policy.cfg.noise_level == 0.5 and "sampling" not in mode.describe()
    deterministic = _frames(mode, 0, 3)
    assert not np.array_equal(deterministic, episode)
    # Sampling with no starting noise and a vanishing SDE noise is the deterministic chain.
    near = ActionSource("checkpoint", checkpoint, (("noise_level", 1e-9), ("init_noise", 0.0)))
    np.testing.assert_allclose(_frames(EvalWorker(ENV, near), 0, 3), deterministic, atol=1)


def test_sampling_options_are_checked_before_an_episode_runs(checkpoint):
    worker = EvalWorker(ENV, ActionSource("checkpoint", checkpoint))
    with pytest.raises(ConfigError, match="noise_levl.*noise_level"):
        worker.set_source(ActionSource("checkpoint", checkpoint, (("noise_levl", 0.1),)))
    with pytest.raises(ConfigError, match="init_noise"):
        worker.set_source(ActionSource("checkpoint", checkpoint, (("init_noise", -1.0),)))
    with pytest.raises(ConfigError, match="denoise_steps"):  # an int: not a sampling option
        worker.set_source(ActionSource("checkpoint", checkpoint, (("denoise_steps", 2.0),)))
    assert worker.source.sampling is None  # a refused source leaves the previous one in place
    with pytest.raises(ValueError, match="nothing to sample"):
        EvalWorker(ENV, ActionSource("random", sampling=()))


def test_eval_cli_sampling_flags(capsys):
    base = ["--checkpoint", "ck", "--episodes-per-task", "2"]
    assert acting(parse_args(base)) == "deterministic"
    assert acting(parse_args([*base, "--sampled"])) == "sampled"
    args = parse_args([*base, "--sampled", "--noise-level", "0.01", "--init-noise", "0"])
    assert acting(args) == "sampled noise_level=0.01 init_noise=0"
    for argv, why in (([*base, "--noise-level", "0.01"], "add --sampled"),
                      (["--policy", "random", "--sampled"], "need a checkpoint"),
                      (["--policy", "random", "--language", "blank"], "need a checkpoint")):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2 and why in capsys.readouterr().err


def test_acting_is_part_of_what_an_evaluation_is(tmp_path):
    from actors.eval.compare import compare_results
    from actors.eval.output_dir import IDENTITY_KEYS, EvalOutput

    identity = {k: None for k in IDENTITY_KEYS} | {"acting": "deterministic", "policy": "ab12"}
    EvalOutput(tmp_path / "mode", identity).close()
    sampled = {**identity, "acting": "sampled noise_level=0.01", "seed": 0}
    with pytest.raises(SystemExit, match="acting: 'deterministic' != 'sampled noise_level=0.01'"):
        EvalOutput(tmp_path / "mode", sampled)
    # A directory written before sampled evaluation existed (no ``acting``) was never sampled:
    # it continues under deterministic acting and is refused under sampled acting.
    legacy = {k: v for k, v in identity.items() if k != "acting"}
    output = EvalOutput(tmp_path / "legacy", legacy)
    assert output.set_fingerprint({"image_size": [64, 64]}) == []
    output.close()
    output = EvalOutput(tmp_path / "legacy", identity)
    assert output.set_fingerprint({"image_size": [64, 64], "acting": "deterministic"}) == []
    output.close()
    with pytest.raises(SystemExit, match="acting: None != 'sampled"):
        EvalOutput(tmp_path / "legacy", sampled)

    def results(fp):
        return {"policy": "p", "tasks": {"0": {"by_init_state": [
            {"init_state": 0, "success": True}]}}, "fingerprint": fp}

    mode, noisy = {"acting": "deterministic"}, {"acting": "sampled"}
    assert compare_results(results(mode), results({}))["fingerprint_differences"] == []
    assert compare_results(results(noisy), results(mode))["fingerprint_differences"] == [
        "acting: 'sampled' != 'deterministic'"]
    assert compare_results(results({}), results(noisy))["fingerprint_differences"] == [
        "acting: '<missing>' != 'sampled'"]


def test_given_instructions_name_what_each_evaluated_task_is_told():
    suite = ("reach red", "reach green", "reach blue")
    assert given_instructions("own", suite, [0, 2]) is None
    assert given_instructions("blank", suite, [0, 2]) == ("", "")
    assert given_instructions("shifted", suite, [0, 2]) == ("reach green", "reach red")
    with pytest.raises(ValueError, match="distinct"):
        given_instructions("shifted", ("a", "a"), [0])
    with pytest.raises(ValueError, match="unknown language mode"):
        given_instructions("swapped", suite, [0])


def test_the_policy_acts_on_the_instruction_it_is_told(checkpoint):
    from envs.reach import instruction

    told = given_instructions("shifted", [instruction(t) for t in range(4)], [0, 1])
    worker = EvalWorker(ENV, ActionSource("checkpoint", checkpoint, instructions=told))
    seen: list[tuple[str, ...]] = []
    act = worker.policy.act

    def recording_act(batch, **kw):
        seen.append(batch.instruction)
        return act(batch, **kw)

    worker.policy.act = recording_act
    outcome = worker.run_episode(1, 2)
    assert seen and set(seen) == {(instruction(2),)}
    assert outcome.instruction == instruction(1)  # results name the task's own instruction
    # The instruction changes this policy's actions, so the ablation measures something.
    from rlvla3.types import ObsBatch

    obs = worker.env.reset(1, 2)
    actions = [act(ObsBatch.stack([replace(obs, instruction=text)]), deterministic=True).actions
               for text in (instruction(1), instruction(2))]
    assert not np.allclose(actions[0], actions[1])


def test_what_the_policy_is_told_is_part_of_what_an_evaluation_is(tmp_path):
    from actors.eval.compare import compare_results
    from actors.eval.output_dir import IDENTITY_KEYS, EvalOutput

    identity = {k: None for k in IDENTITY_KEYS} | {"acting": "deterministic", "language": "own"}
    # A directory written before --language existed told each task its own instruction.
    legacy = {k: v for k, v in identity.items() if k != "language"}
    EvalOutput(tmp_path / "legacy", legacy).close()
    EvalOutput(tmp_path / "legacy", identity).close()
    with pytest.raises(SystemExit, match="language: 'own' != 'shifted'"):
        EvalOutput(tmp_path / "legacy", {**identity, "language": "shifted"})

    def results(fp):
        return {"policy": "p", "tasks": {"0": {"by_init_state": [
            {"init_state": 0, "success": True}]}}, "fingerprint": fp}

    assert compare_results(results({}), results({"language": "own"}))[
        "fingerprint_differences"] == []
    assert compare_results(results({}), results({"language": "shifted"}))[
        "fingerprint_differences"] == ["language: 'own' != 'shifted'"]
