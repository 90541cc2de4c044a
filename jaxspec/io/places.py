"""Where jaxspec's own files are, run from a checkout of its repository or installed from a wheel.

* Package data, present in both: the saved prompt sets (``jaxspec/io/prompts/``) and the shipped
  distilled draft (``checkpoints/drafts/`` in the repository, which the wheel installs as
  ``jaxspec/shipped/``: pyproject's ``package-dir``).
* Converted checkpoints: the checkout's ``checkpoints/``, else the user's cache folder
  (``~/.cache/jaxspec/checkpoints``), so an installed jaxspec never writes into
  ``site-packages``. The CLI passes ``JAXSPEC_HOME`` as the folder (the library reads no
  variable); it also holds the CLI's compilation cache (``xla/``), from a checkout too.
"""

from __future__ import annotations

import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1]  # the jaxspec package folder
REPO = PACKAGE.parent  # the repository root in a checkout; site-packages when installed
USER_CACHE = pathlib.Path("~/.cache/jaxspec")
PROMPTS = PACKAGE / "io" / "prompts"
SHIPPED_IN_WHEEL = PACKAGE / "shipped"


def checkout() -> pathlib.Path | None:
    """The repository root when this jaxspec is its source tree (run from a checkout, or an
    editable install), else None (installed from a wheel)."""
    if (REPO / "pyproject.toml").is_file() and (REPO / "checkpoints").is_dir():
        return REPO
    return None


def home(override: str | pathlib.Path | None = None) -> pathlib.Path:
    """The per-user folder: ``override`` (the CLI's ``JAXSPEC_HOME``), else ``~/.cache/jaxspec``."""
    return pathlib.Path(override or USER_CACHE).expanduser().absolute()


def checkpoints(home_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """Where converted checkpoints go: the checkout's ``checkpoints/``, else
    ``home(home_dir)/checkpoints``."""
    repo = checkout()
    return repo / "checkpoints" if repo is not None else home(home_dir) / "checkpoints"


def shipped_drafts() -> pathlib.Path:
    """The folder of the shipped distilled drafts."""
    repo = checkout()
    return repo / "checkpoints" / "drafts" if repo is not None else SHIPPED_IN_WHEEL
