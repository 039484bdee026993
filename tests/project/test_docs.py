"""The docs cannot drift from the code: every ``rlvla3`` command in README.md and docs/ parses
with the real parser, every ``--set`` builds against the real config, and every relative
link resolves.

Commands are taken from fenced code blocks (continuation lines joined, comments dropped,
shell variables assigned earlier on the same page expanded, ``$(seq ...)`` expanded) and from
inline code spans. A command in a code block is parsed whole, unless it is a usage line
(``[--opt]``); a command whose module has ``config_from_args`` then builds its config (presets
and ``--set`` overrides, with the env's and the policy's options checked by their own
dataclasses). Inline code (usage lines, an option named in prose, ``rlvla3 eval
--checkpoint``) is checked option by option: each ``--flag`` must exist under that spelling,
and each unbracketed ``--set a.b=c`` must build. Files a command names (``--config my.yaml``,
``--resume RUN_DIR``) need not exist. No Ray, no simulator: seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlvla3.__main__ import BENCHMARKS, COMMANDS, command_module, command_parser
from rlvla3.cli_options import DEPRECATED
from rlvla3.config import ConfigError, build

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"(?<!!)\[[^\]]+\]\(([^)\s]+)\)")
ASSIGN = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")
SEQ = re.compile(r"\$\(seq( -s,)? (\d+) (\d+)\)")
ERROR_OUTPUT = re.compile(r"^rlvla3 [a-z ]+: ")  # a transcript's error line: not checked
REDIRECT = re.compile(r"^\d*[<>]|[;&|]$")
# What a command needs that a docs command may leave to a saved config or to the prose.
STAND_INS = {"sft": ("--dataset", "demos")}


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    argv: tuple[str, ...]
    synopsis: bool

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: rlvla3 {' '.join(self.argv)}"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _expand(text: str, variables: dict[str, str]) -> str:
    def seq(match: re.Match) -> str:
        sep = "," if match[1] else " "
        return sep.join(str(i) for i in range(int(match[2]), int(match[3]) + 1))

    text = SEQ.sub(seq, text)
    for name, value in variables.items():
        text = text.replace(f'"${name}"', shlex.quote(value)).replace(f"${name}", value)
    return text


def _rlvla3_argv(tokens: list[str]) -> list[str] | None:
    """The arguments after ``rlvla3`` / ``python -m rlvla3`` in a shell command, if it runs one
    (after environment assignments, or after ``--`` as in ``ray job submit ... -- python ...``),
    up to the first redirection."""
    for i, token in enumerate(tokens):
        if token == "rlvla3" and (i == 0 or tokens[i - 1] == "--" or "=" in tokens[i - 1]):
            start = i + 1
        elif token in ("python", "python3") and tokens[i + 1:i + 3] == ["-m", "rlvla3"]:
            start = i + 3
        else:
            continue
        argv = []
        for arg in tokens[start:]:
            if REDIRECT.match(arg):
                break
            argv.append(arg)
        return argv
    return None


def _logical_lines(block: str) -> list[tuple[int, str]]:
    """The block's lines with continuations joined, each with the offset of its first line."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for offset, raw in enumerate(block.splitlines()):
        start, text = pending if pending else (offset, "")
        text += raw[:-1] + " " if raw.endswith("\\") else raw
        pending = (start, text) if raw.endswith("\\") else None
        if pending is None:
            joined.append((start, text))
    if pending:
        joined.append(pending)
    return joined


def _shell_commands(block: str, variables: dict[str, str]) -> list[tuple[int, list[str]]]:
    """The commands of a code block as token lists, each with the offset of its line in the
    block; assignments update ``variables``. In a block with ``$ `` prompts only the prompted
    lines are commands (the rest is output)."""
    lines = _logical_lines(block)
    if any(line.startswith("$ ") for _, line in lines):  # a transcript: commands and output
        shown = zip(lines, lines[1:] + [(0, "")], strict=True)
        lines = [(offset, line[2:]) for (offset, line), (_, after) in shown
                 if line.startswith("$ ") and not ERROR_OUTPUT.match(after)]
    commands = []
    for offset, line in lines:
        assignment = ASSIGN.match(line.strip())
        if assignment:
            variables[assignment[1]] = shlex.split(assignment[2])[0] if assignment[2] else ""
            continue
        try:
            tokens = shlex.split(_expand(line, variables), comments=True)
        except ValueError:
            continue  # not shell (an output listing)
        part: list[str] = []
        for token in tokens + ["&&"]:
            if token in ("&&", "||", ";", "|"):
                if part:
                    commands.append((offset, part))
                part = []
            else:
                part.append(token)
    return commands


def doc_commands() -> list[Command]:
    found: list[Command] = []
    for path in PAGES:
        text = path.read_text()
        page = path.relative_to(REPO).as_posix()
        variables: dict[str, str] = {}
        for block in FENCE.finditer(text):
            first = text.count("\n", 0, block.start()) + 2
            for offset, tokens in _shell_commands(block[1], variables):
                argv = _rlvla3_argv(tokens)
                if argv and not argv[0].endswith(":"):  # "rlvla3 rl: ..." is output
                    usage = any(arg.startswith("[") for arg in argv)
                    found.append(Command(page, first + offset, tuple(argv), usage))
        prose = FENCE.sub(lambda block: "\n" * block[0].count("\n"), text)  # lines kept
        for span in INLINE.finditer(prose):
            code = span[1].replace("\\|", "|")
            if not re.match(r"(python -m )?rlvla3 [a-z]", code) or " -" not in code:
                continue  # not a command, or only its name
            line = prose.count("\n", 0, span.start()) + 1
            try:
                words = shlex.split(code)
            except ValueError:  # an unbalanced quote in a usage line
                words = code.split()
            found.append(Command(page, line, tuple(_rlvla3_argv(words) or ()), True))
    return found


def _words(argv: tuple[str, ...]) -> tuple[str, ...]:
    if argv and argv[0] == "bench":
        return tuple(argv[:2])
    return tuple(argv[:1])


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            raise AssertionError(err.getvalue().strip().splitlines()[-1]) from None
    if DEPRECATED in err.getvalue():
        raise AssertionError(err.getvalue().strip())
    return args


def _options(parser: argparse.ArgumentParser, sub: str | None) -> set[str]:
    options = {o for a in parser._actions for o in a.option_strings if a.help != argparse.SUPPRESS}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and sub in action.choices:
            options |= _options(action.choices[sub], None)
    return options


def _import(target: str):
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def check_config(command: Command, args: argparse.Namespace) -> None:
    """Build the command's config from its arguments, as the command would, then the env's and
    the policy's options into their own dataclasses."""
    module = command_module(_words(command.argv))
    config_from_args = getattr(module, "config_from_args", None)
    if config_from_args is None:
        assert not getattr(args, "overrides", None), f"no config to check --set against: {command}"
        return
    if getattr(args, "resume", None):  # the config the run saved: its --set items on a preset
        args = _parse(command_parser(_words(command.argv)),
                      [a for a in command.argv[1:] if a not in ("--resume", args.resume)])
    flag, value = STAND_INS.get(_words(command.argv)[0], (None, None))
    if flag and not getattr(args, flag.strip("-").replace("-", "_")):
        setattr(args, flag.strip("-").replace("-", "_"), [value])
    args.config = None  # a file the docs name, not one of this repository
    cfg = config_from_args(args)
    from envs import OPTIONS as ENV_OPTIONS
    from rlvla3.policies import OPTIONS as POLICY_OPTIONS

    for section, table in (("env", ENV_OPTIONS), ("policy", POLICY_OPTIONS)):
        choice = getattr(cfg, section, None)
        if choice is not None:
            build(_import(table[choice.name]), choice.options, f"{section}.options")


def check(command: Command) -> None:
    words = _words(command.argv)
    table = BENCHMARKS if words[0] == "bench" else COMMANDS
    assert words[-1] in table, f"unknown command: {command}"
    parser = command_parser(words)
    rest = list(command.argv[len(words):])
    try:
        if command.synopsis:
            check_synopsis(command, parser, rest)
        else:
            check_config(command, _parse(parser, rest))
    except (AssertionError, ConfigError, ValueError) as exc:
        raise AssertionError(f"{command}\n    {exc}") from None


def check_synopsis(command: Command, parser: argparse.ArgumentParser, rest: list[str]) -> None:
    """Every option named exists under that spelling; every unbracketed ``--set`` builds."""
    sub = rest[0] if rest and not rest[0].startswith(("-", "[")) else None
    known = _options(parser, sub)
    for token in rest:
        flag = token.strip("[]()").split("=")[0]
        if flag.startswith("--"):
            assert flag in known, f"no option {flag}"
    overrides = [value for option, value in zip(rest, rest[1:], strict=False)
                 if option == "--set" and not value.endswith(("]", "...")) and "=" in value]
    if overrides:
        argv = [arg for value in overrides for arg in ("--set", value)]
        check_config(command, _parse(parser, ([sub] if sub else []) + argv))


COMMANDS_IN_DOCS = doc_commands()


def test_the_docs_hold_commands_of_every_kind():
    """The extraction finds what the pages hold (a broken pattern would check nothing)."""
    kinds = {(c.argv[0] if c.argv else "") for c in COMMANDS_IN_DOCS}
    assert {"rl", "sft", "eval", "datalake", "bench", "status"} <= kinds, kinds
    assert any(c.synopsis for c in COMMANDS_IN_DOCS)
    assert sum("--set" in c.argv for c in COMMANDS_IN_DOCS) >= 20


@pytest.mark.parametrize("command", COMMANDS_IN_DOCS, ids=lambda c: c.where)
def test_every_command_in_the_docs_parses_and_builds_its_config(command):
    check(command)


def test_a_wrong_flag_or_field_is_caught():
    """The check fails on what it exists to catch: a field another command has, an unknown
    flag, a bad value, an option's old spelling."""
    bad = [Command("x", 0, ("rl", "--set", "strategy=fsdp"), False),
           Command("x", 0, ("rl", "--set", "policy.name=vla", "--set",
                         "policy.options.logprob=exact"), False),
           Command("x", 0, ("rl", "--set", "env.name=libero", "--set", "env.options.bogus=1"), False),
           Command("x", 0, ("eval", "--policy", "random", "--images", "3"), False),
           Command("x", 0, ("bench", "env", "--image", "64"), False),
           Command("x", 0, ("sft", "--dataset", "d", "--set", "learner.lr=1"), False),
           Command("x", 0, ("sft", "[--dataset PATH]", "[--epochs N]"), True)]
    for command in bad:
        with pytest.raises(AssertionError):
            check(command)
    check(Command("x", 0, ("sft", "--dataset", "d", "--set", "sharding=fsdp"), False))


REPO_PATH = re.compile(r"^(?:actors|commands|datalake|envs|measure|rlvla3|tests|results|docs|\.ci)/[\w./-]*$")
MODULE = re.compile(r"^(?:python -m )?((?:actors|commands|datalake|envs|measure|rlvla3)(?:\.\w+)+)$")


def _names_code(dotted: str) -> bool:
    """A module, or an attribute of one."""
    try:
        if importlib.util.find_spec(dotted) is not None:
            return True
    except ModuleNotFoundError:  # its parent is a module, not a package
        pass
    parent, _, attr = dotted.rpartition(".")
    return importlib.util.find_spec(parent) is not None and hasattr(
        importlib.import_module(parent), attr)


def test_every_repository_path_and_module_the_docs_name_exists():
    """``rlvla3/plan/memory.py``, ``python -m envs.libero.expert``, ``rlvla3.policies.vla.loader`` in
    inline code: a file that moves takes its mentions with it."""
    missing = []
    for path in PAGES:
        for span in INLINE.findall(FENCE.sub("", path.read_text())):
            if REPO_PATH.match(span) and not (REPO / span).exists():
                missing.append(f"{path.relative_to(REPO)}: {span}")
            module = MODULE.match(span)
            if module and not _names_code(module[1]):
                missing.append(f"{path.relative_to(REPO)}: {span}")
    assert not missing, "\n".join(missing)


def _links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


def test_every_relative_link_resolves():
    broken = []
    for path in PAGES:
        for target in _links(path):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            file = target.split("#")[0]
            if not (path.parent / file).exists():
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert not broken, "\n".join(broken)
    assert sum(len(_links(p)) for p in PAGES) > 50


PROGRESS_LABELS = ("steps", "trained", "ep", "return", "success", "lag p50/max", "disc", "batch",
                   "queue", "busy env/roll/learn", "wait")
"""The abbreviations of ``rlvla3 rl``'s progress line, in the order it prints them."""


def test_every_abbreviation_of_the_progress_line_is_explained():
    """The line the monitor prints holds these labels and no other word (besides ``v`` before
    the version and ``/s``), and the metrics page's table explains each one."""
    from actors.observe.monitor import RunMonitor

    row = {"env_steps": 1025, "env_steps_per_s": 12.2, "trained_env_steps_per_s": 1.9,
           "episodes": 4, "episode_return": 0.5, "success_rate": 0.25, "policy_version": 1,
           "staleness_p50": 0.0, "staleness_max": 2.0, "discarded_decision_fraction": 0.01,
           "mean_batch_size": 1.0, "queue_depth": 0, "busy_env": 0.66, "busy_rollout": 0.1,
           "busy_learner": 0.03, "learner_data_wait": 0.9, "env_slots_live": 4,
           "env_slots_waiting": 0}
    rest = RunMonitor.line(None, row, 84.1)
    for label in PROGRESS_LABELS:
        assert label in rest, (label, rest)
        rest = rest.replace(label, "", 1)
    assert not re.search(r"[a-z]{2,}", rest.replace("/s", "")), rest
    page = (REPO / "docs" / "concepts" / "metrics.md").read_text()
    section = page[page.index("## The progress line"):]
    explained = " ".join(line.split("|")[1] for line in section.splitlines()
                         if line.startswith("| `"))  # the first cell of each table row
    for label in PROGRESS_LABELS:
        assert f"`{label}`" in explained, label
