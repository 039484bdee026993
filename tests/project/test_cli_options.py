"""One spelling per option across commands (image size, output directory, run directory,
resume), the old spellings as deprecated aliases, and ``rlvla3 sft``'s presets and run
directory handling, through the real parsers (no Ray)."""

from __future__ import annotations

import argparse
import json

import pytest

from commands import sft
from rlvla3.__main__ import BENCHMARKS, COMMANDS, command_module, command_names, command_parser
from rlvla3.config import ConfigError, to_dict

LIBERO10 = ("env.options={suite: libero_spatial, task_ids: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "
            "image_size: [64, 64], chunk_len: 5}")
SHAPES = ("policy.options.shapes={conv_stem: 3, vision_width: 64, vision_depth: 2, "
          "vision_mlp: 128, width: 128, mlp: 256, head_dim: 32, expert_width: 64, "
          "expert_mlp: 128}")


def _parse(words: tuple[str, ...], argv: list[str]):
    return command_parser(words).parse_args(argv)


def test_every_command_has_a_parser_and_one_spelling_per_option():
    spellings: dict[str, set[str]] = {}
    for words in command_names():
        parser = command_parser(words)
        assert parser.prog == "rlvla3 " + " ".join(words)
        parsers = [parser] + [sub for action in parser._actions
                              if isinstance(action, argparse._SubParsersAction)
                              for sub in action.choices.values()]
        for p in parsers:
            for action in p._actions:
                for option in action.option_strings:
                    if action.help != "==SUPPRESS==":
                        spellings.setdefault(option, set()).add(p.prog)
    for old in ("--image", "--size", "--out"):  # hidden aliases only
        assert old not in spellings, (old, spellings.get(old))
    assert {"rlvla3 eval", "rlvla3 datalake record", "rlvla3 bench env",
            "rlvla3 bench lake"} <= spellings["--image-size"]
    assert {"rlvla3 rl", "rlvla3 sft"} <= spellings["--run-dir"] & spellings["--resume"]
    assert {"rlvla3 eval", "rlvla3 datalake record",
            "rlvla3 bench learning"} <= spellings["--output-dir"]


def test_the_command_table_is_the_commands_package():
    """Each entry of the table names a module of ``commands`` that defines ``parser()`` (its
    prog the command's words) and ``main``; every module there has an entry. The parser comes
    from ``parser()`` alone: ``argparse`` is left as it was."""
    import pkgutil

    import commands
    import commands.bench

    parse_args = argparse.ArgumentParser.parse_args
    named = set()
    for words in command_names():
        table = BENCHMARKS if words[0] == "bench" else COMMANDS
        module = command_module(words)
        assert module.__name__ == table[words[-1]][0], words
        assert callable(module.main), words
        assert module.parser().prog == command_parser(words).prog == "rlvla3 " + " ".join(words)
        named.add(module.__name__)
    assert argparse.ArgumentParser.parse_args is parse_args
    defined = {f"{package.__name__}.{info.name}" for package in (commands, commands.bench)
               for info in pkgutil.iter_modules(package.__path__) if not info.ispkg}
    assert defined == named


def test_image_size_takes_n_or_h_w_and_square_commands_refuse_h_w(capsys):
    assert _parse(("eval",), ["--policy", "random", "--image-size", "64"]).image_size == (64, 64)
    record = _parse(("datalake",), ["record", "--output-dir", "d", "--image-size", "48", "64"])
    assert record.image_size == (48, 64)
    assert _parse(("bench", "env"), []).image_size == (128, 128)
    with pytest.raises(SystemExit):
        _parse(("bench", "env"), ["--image-size", "48", "64"])
    assert "renders square images" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(("eval",), ["--policy", "random", "--image-size", "1", "2", "3"])
    assert "give N (square) or H W" in capsys.readouterr().err


def test_old_spellings_still_work_with_one_warning_line(capsys):
    cases = [(("bench", "env"), ["--image", "64"], "image_size", (64, 64), "--image"),
             (("bench", "lake"), ["--size", "96"], "image_size", (96, 96), "--size"),
             (("datalake",), ["record", "--out", "demos"], "output_dir", "demos", "--out"),
             (("bench", "learning"), ["--out", "curves"], "output_dir", "curves", "--out")]
    for words, argv, dest, value, old in cases:
        assert getattr(_parse(words, argv), dest) == value
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and old in err[0] and "deprecated" in err[0], err


def test_record_still_requires_its_output_dir(capsys):
    from commands.datalake import main as datalake_main

    with pytest.raises(SystemExit):
        datalake_main(["record", "--episodes", "1"])
    assert "required: --output-dir" in capsys.readouterr().err


def _sft(argv: list[str]):
    return sft.config_from_args(sft.parser().parse_args(argv))


def test_the_libero_spatial10_preset_is_the_recipe_it_replaces():
    pasted = _sft(["--dataset", "demos10", "--policy", "vla", "--env", "libero", "--run-dir",
                   "sft10", "--max-steps", "16000", "--lr", "5e-4", "--set", LIBERO10, "--set",
                   "policy.options.image_size=64", "--set", SHAPES, "--set",
                   "warmup_steps=500"])
    preset = _sft(["--preset", "libero_spatial10", "--dataset", "demos10", "--run-dir", "sft10"])
    assert to_dict(preset) == to_dict(pasted)
    one_task = ("env.options={suite: libero_spatial, task_ids: [0], image_size: [64, 64], "
                "chunk_len: 5}")
    pasted = _sft(["--dataset", "demos", "--env", "libero", "--run-dir", "sft", "--max-steps",
                   "8000", "--lr", "5e-4", "--set", one_task, "--set",
                   "policy.options.image_size=64", "--set", SHAPES, "--set", "warmup_steps=500"])
    preset = _sft(["--preset", "libero_spatial10", "--set", "env.options.task_ids=[0]",
                   "--max-steps", "8000", "--dataset", "demos", "--run-dir", "sft"])
    assert to_dict(preset) == to_dict(pasted)  # the single-task loop's SFT, as the guide says
    longer = _sft(["--preset", "libero_spatial10", "--dataset", "demos10", "--max-steps", "30000",
                   "--set", "lr_schedule=constant"])
    assert (longer.max_steps, longer.lr_schedule, longer.lr) == (30000, "constant", 5e-4)
    assert longer.run_dir.startswith("runs/sft-")


def test_sft_without_a_preset_is_the_default_tiny_vla():
    cfg = _sft(["--dataset", "d"])
    assert (cfg.policy.name, dict(cfg.policy.options)) == ("vla", {"preset": "tiny"})
    assert cfg.lake.normalize == "none" and cfg.max_steps == 200
    with pytest.raises(ConfigError, match="lake.datasets.*--dataset"):
        _sft([])
    # With init_from the checkpoint's model is the default, not the tiny preset.
    assert dict(_sft(["--dataset", "d", "--init-from", "ckpt"]).policy.options) == {}


def test_sft_resume_continues_the_saved_config(tmp_path):
    first = _sft(["--preset", "libero_spatial10", "--dataset", "demos10", "--run-dir",
                  str(tmp_path / "sft10")])
    (tmp_path / "sft10").mkdir()
    (tmp_path / "sft10" / "config.json").write_text(json.dumps(to_dict(first)))
    resumed = _sft(["--resume", str(tmp_path / "sft10"), "--max-steps", "30000"])
    assert resumed.max_steps == 30000 and resumed.run_dir == str(tmp_path / "sft10")
    assert to_dict(resumed.policy) == to_dict(first.policy) and resumed.lr == first.lr
    with pytest.raises(ConfigError, match="no config.yaml"):
        _sft(["--resume", str(tmp_path)])
    with pytest.raises(ConfigError, match="drop --preset"):
        _sft(["--resume", str(tmp_path / "sft10"), "--preset", "default"])


def test_eval_takes_the_suite_a_checkpoint_trained_on_and_refuses_another_simulators(capsys):
    """The committed Isaac Lab and MetaWorld checkpoints: without ``--suite`` each is judged on
    its own simulator's suite; a suite of another simulator is one line naming the right one
    (it was ``unknown camera 'front'`` from inside LIBERO's config)."""
    from commands.eval import parse_args

    assert parse_args(["--checkpoint", "results/isaaclab/reach_rl4"]).suite == "isaaclab_reach"
    assert parse_args(["--checkpoint", "results/metaworld_mt10/mw_sft"]).suite == "mt10"
    assert parse_args(["--policy", "random"]).suite == "libero_spatial"
    with pytest.raises(SystemExit) as err:
        parse_args(["--checkpoint", "results/isaaclab/reach_rl4", "--suite", "libero_spatial"])
    assert err.value.code == 2
    assert "trained on isaaclab: evaluate it with --suite isaaclab_reach" in capsys.readouterr().err
