"""MkDocs hook: the folder READMEs become pages of the site's developer section, at build time.

The READMEs stay where a developer opens the folder; MkDocs can only publish files under docs_dir,
so each one is added as a generated page (`developer/<folder>.md`) with its text unchanged. The
list is FOLDER_READMES; tests/test_docs.py fails when a folder README exists that is not in it. A README's
relative links point into the repository, not the site: they become links to the published page of
another README, or the path as code.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

# README path (relative to the repository root) -> page under docs/developer/
FOLDER_READMES = {
    "configs/README.md": "developer/configs.md",
    "crypto/attestation/README.md": "developer/crypto-attestation.md",
    "crypto/secagg/README.md": "developer/crypto-secagg.md",
    "deploy/README.md": "developer/deploy.md",
    "examples/README.md": "developer/examples.md",
    "examples/compliance_sft/README.md": "developer/examples-compliance-sft.md",
    "examples/credit-risk/README.md": "developer/examples-credit-risk.md",
    "federation/README.md": "developer/federation.md",
    "federation/config/README.md": "developer/federation-config.md",
    "federation/coordinator/README.md": "developer/federation-coordinator.md",
    "federation/ops/README.md": "developer/federation-ops.md",
    "federation/protocol/README.md": "developer/federation-protocol.md",
    "federation/site/README.md": "developer/federation-site.md",
    "site_trainer/README.md": "developer/site-trainer.md",
    "site_trainer/pii/README.md": "developer/site-trainer-pii.md",
    "tests/fuzzing/README.md": "developer/tests-fuzzing.md",
}
# Files of the repository root published as they are, their links into docs/ made relative to the site
ROOT_PAGES = {"CHANGELOG.md": "changelog.md"}


LINK = re.compile(r"\[([^\]]+)\]\((?!https?://|mailto:|#)([^)\s]+)\)")


def site_links(text: str, readme: str) -> str:
    """Relative links of a README made to work on the site: to another published README, its page;
    to any other file of the repository (not part of the site), the path as code."""
    here = posixpath.dirname(readme)

    def one(match: re.Match) -> str:
        label, target = match.groups()
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(here, path))
        page = FOLDER_READMES.get(resolved) or FOLDER_READMES.get(posixpath.join(resolved, "README.md"))
        if page:
            return f"[{label}]({posixpath.basename(page)}{'#' + anchor if anchor else ''})"
        return f"{label} (`{resolved}`)"

    return LINK.sub(one, text)


LIST_ITEM = re.compile(r"^( *)(?:[-*+]|\d+\.) ")


def python_markdown_lists(text: str) -> str:
    """Lists as Python-Markdown reads them, from text written for GitHub: a list right after a
    paragraph line gets the blank line before it, and items nested by 2 or 3 spaces are indented
    by 4 (Python-Markdown's nesting step). Fenced code is left alone."""
    out: list[str] = []
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        item = None if fenced else LIST_ITEM.match(line)
        if item:
            depth = len(item.group(1))
            if 0 < depth < 4:
                line = "    " + line.lstrip(" ")
            prev = out[-1] if out else ""
            if prev.strip() and not prev.startswith((" ", "\t")) and not LIST_ITEM.match(prev) and depth == 0:
                out.append("")
        out.append(line)
    return "\n".join(out)


def page_text(readme: str, root: Path) -> str:
    """The page for one README: a line saying where it lives, then its text."""
    text = python_markdown_lists(site_links((root / readme).read_text(encoding="utf-8"), readme))
    return f"<!-- the text of {readme}, published by docs/hooks/folder_readmes.py -->\n\n{text}\n\n" \
           f"*This page is `{readme}` in the repository.*\n"


def on_files(files, config):
    root = Path(config["config_file_path"]).resolve().parent
    for readme, page in FOLDER_READMES.items():
        files.append(File.generated(config, page, content=page_text(readme, root)))
    for name, page in ROOT_PAGES.items():
        text = (root / name).read_text(encoding="utf-8").replace("](docs/", "](")  # links into docs/ from the root
        text = python_markdown_lists(text)
        files.append(File.generated(config, page, content=text))
    return files
