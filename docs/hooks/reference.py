"""MkDocs hook: the CLI and config reference pages, generated at build time from the code.

``reference/cli.md`` and ``reference/config.md`` hold a marker, ``<!-- generated: cli -->`` or
``<!-- generated: config -->``, that this hook replaces with Markdown built from

- every command's real argparse parser (its module's ``parser()`` in ``commands/``), found
  through the command table of ``rlvla3/__main__.py`` (``command_names`` /
  ``command_parser``): usage, sub-commands, and each option with its default and help (hidden
  deprecated aliases left out);
- the config dataclass each command's ``--set`` addresses (the return type of its module's
  ``config_from_args``), walked recursively, with each field's type, default and docstring
  (the string literal under the field in the source);
- the options dataclass of every env, policy, batching policy and cost model, named by the
  registries (``envs.OPTIONS``, ``rlvla3.rollout.batching.OPTIONS``, ``rlvla3.gpu.costs.OPTIONS``,
  ``rlvla3.policies.OPTIONS``), and the presets each command ships (its module's ``PRESETS``).

Nothing here is written by hand, so the reference cannot drift from the code; a command or
field that cannot be rendered fails the build.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import textwrap
import typing
from importlib import resources
from typing import Any

from rlvla3.__main__ import BENCHMARKS, COMMANDS, command_module, command_names, command_parser
from rlvla3.config import Named, preset_names

MARKER = "<!-- generated: {} -->"


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _help_of(words: tuple[str, ...]) -> str:
    return (BENCHMARKS[words[1]] if words[0] == "bench" else COMMANDS[words[0]])[1]


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if (action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction)
                or isinstance(action, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            value = "" if action.nargs == 0 else " " + formatter._format_args(
                action, action.dest.upper())
            name = ", ".join(f"`{option}{value}`" for option in action.option_strings)
        else:
            name = f"`{formatter._format_args(action, action.dest)}`"
        default = action.default
        hidden = default is None or default is False or default == [] \
            or default is argparse.SUPPRESS or action.nargs == 0
        shown = "" if hidden else f"`{default!r}`" if default == "" else f"`{default}`"
        helptext = formatter._expand_help(action) if action.help else ""
        if action.choices and not isinstance(action.choices, dict):
            helptext += f" (one of: {', '.join(map(str, action.choices))})"
        rows.append(f"| {name} | {shown} | {_cell(helptext)} |")
    return rows


def _parser_section(parser: argparse.ArgumentParser, level: int, summary: str) -> list[str]:
    usage = argparse.HelpFormatter(parser.prog, width=96)  # the same width on every machine
    usage.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    lines = ["#" * level + f" `{parser.prog}`", "", summary, "", "```text",
             usage.format_help().strip(), "```", ""]
    rows = _option_rows(parser)
    if rows:
        lines += ["| option | default | what it does |", "|---|---|---|", *rows, ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                lines += _parser_section(sub, level + 1, helps.get(name) or "")
    return lines


def cli_reference() -> str:
    """Markdown for every command of the command table."""
    lines = []
    for words in command_names():
        lines += _parser_section(command_parser(words), 2, _help_of(words))
    return "\n".join(lines)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal right under it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _annotations(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {node.target.id: ast.unparse(node.annotation) for node in tree.body[0].body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        if isinstance(value, Named):
            return f"`{value.name}`" + (f" `{dict(value.options)}`" if value.options else "")
        return "see below"
    return f"`{value!r}`"


def _nested_dataclass(tp: Any) -> type | None:
    for candidate in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(candidate) and candidate is not Named:
            return candidate
    return None


def _dataclass_sections(cls: type, path: str, title: str, seen: set[type],
                        prefix: str) -> list[str]:
    """A table of ``cls``'s fields under ``path``, then one section per nested dataclass (ids
    start with ``prefix``, so two configs can have sections of the same path)."""
    hints, docs, annotations = typing.get_type_hints(cls), field_docs(cls), _annotations(cls)
    lines = [f"### {title} {{ #{_anchor(prefix + (path or 'top'))} }}", "",
             _cell(inspect.cleandoc(cls.__doc__ or "")), "",
             "| field | type | default | what it sets |", "|---|---|---|---|"]
    nested = []
    for f in dataclasses.fields(cls):
        dotted = f"{path}.{f.name}" if path else f.name
        sub = _nested_dataclass(hints[f.name])
        doc = docs.get(f.name, "")
        if sub is not None:
            nested.append((sub, dotted))
            doc = (doc + " " if doc else "") + f"Fields: [`{dotted}`](#{_anchor(prefix + dotted)})."
        elif hints[f.name] is Named or Named in typing.get_args(hints[f.name]):
            doc = (doc + " " if doc else "") + (
                f"`{dotted}.name` picks one, `{dotted}.options` configures it: see "
                f"[{f.name} options](#{f.name}-options).")
        rows = f"| `{dotted}` | `{_cell(annotations.get(f.name, ''))}` | {_default(f)} | "
        lines.append(rows + f"{_cell(doc)} |")
    lines.append("")
    for sub, dotted in nested:
        if sub not in seen:
            seen.add(sub)
            lines += _dataclass_sections(sub, dotted, f"`{dotted}` ({sub.__name__})", seen,
                                         prefix)
    return lines


def _anchor(dotted: str) -> str:
    """The id of the section of the dataclass at ``dotted`` (set with ``attr_list``)."""
    return "cfg-" + dotted.replace(".", "-").replace("_", "-")


def _registry_options(module: str) -> dict[str, type]:
    table = importlib.import_module(module).OPTIONS
    out = {}
    for name, target in table.items():
        mod, attr = target.split(":")
        out[name] = getattr(importlib.import_module(mod), attr)
    return out


def _presets(package: str) -> list[str]:
    lines = []
    for name in preset_names(package):
        text = resources.files(package).joinpath(f"{name}.yaml").read_text()
        lines += [f"#### `{name}`", "", "```yaml", text.rstrip(), "```", ""]
    return lines


def config_reference() -> str:
    """Markdown for every command's config, the env and policy options, and the presets."""
    lines = []
    for words in command_names():
        module = command_module(words)
        build = getattr(module, "config_from_args", None)
        if build is None:
            continue
        cls = typing.get_type_hints(build)["return"]
        command = "rlvla3 " + " ".join(words)
        lines += [f"## `{command}`: {cls.__name__}", "",
                  f"What `{command} --set a.b=value` addresses (and `--config FILE`, and the "
                  f"command's presets). `{command} --print-config` prints the resolved values.",
                  ""]
        lines += _dataclass_sections(cls, "", f"Top level ({cls.__name__})", {cls},
                                     "-".join(words) + "-")
        package = getattr(module, "PRESETS", None)
        if package:
            lines += [f"### Presets of `{command}`", "",
                      f"`{command} --preset NAME` starts from one of these files "
                      f"(`{package}`).", ""] + _presets(package)
    for section, module in (("env", "envs"), ("policy", "rlvla3.policies"),
                            ("batching", "rlvla3.rollout.batching"),
                            ("cost_model", "rlvla3.gpu.costs")):
        lines += [f"## {section} options", "",
                  f"`{section}.name` chooses the component; `{section}.options` is built into "
                  "its own dataclass and checked before any actor starts.", ""]
        for name, cls in _registry_options(module).items():
            lines += _dataclass_sections(cls, f"{section}.options",
                                         f"`{section}.name: {name}` ({cls.__name__})", {cls},
                                         f"{section}-{name}-")
    return "\n".join(lines)


GENERATORS = {"cli": cli_reference, "config": config_reference}


def on_page_markdown(markdown: str, page, config, files) -> str:
    for name, generate in GENERATORS.items():
        marker = MARKER.format(name)
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown
