"""MkDocs hook: links from a docs page to a file of the repository outside ``docs/``.

Pages link to repository files relatively (``[results](../../results/libero_spatial10/)``), so
the links work where the Markdown is read on a code host. On the site such a file is not a
page: this hook checks that the target exists in the repository (a missing one fails the
build) and rewrites the link to ``repo_url`` (``<repo_url>/tree/HEAD/<path>``) when
``mkdocs.yml`` sets one, else to the path in code, so the reader knows where to look.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def _outside_docs(page_file: Path, target: str, docs_dir: Path, repo: Path) -> Path | None:
    """The repository path ``target`` names, when it lies outside ``docs_dir``."""
    if "://" in target or target.startswith(("mailto:", "/")):
        return None
    resolved = (page_file.parent / target).resolve()
    if resolved.is_relative_to(docs_dir) or not resolved.is_relative_to(repo):
        return None
    return resolved


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    repo = Path(config["config_file_path"]).resolve().parent
    page_file = Path(page.file.abs_src_path)
    repo_url = (config.get("repo_url") or "").rstrip("/")

    def rewrite(match: re.Match) -> str:
        target = match["target"]
        path = _outside_docs(page_file, target, docs_dir, repo)
        if path is None:
            return match[0]
        if not path.exists():
            raise PluginError(f"{page.file.src_uri}: link to {target}: no such file in the "
                              "repository")
        where = path.relative_to(repo).as_posix() + ("/" if path.is_dir() else "")
        if repo_url:
            return f"[{match['text']}]({repo_url}/tree/HEAD/{where})"
        text = match["text"]
        return text if text.strip("`") == where else f"{text} (`{where}` in the repository)"

    return LINK.sub(rewrite, markdown)
