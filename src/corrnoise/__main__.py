"""``python -m corrnoise``: the ``corrnoise`` command (the console script's entry point,
pyproject.toml [project.scripts] ``corrnoise = "corrnoise.cli:main"``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
