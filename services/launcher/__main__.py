"""``python -m services.launcher`` and the ``asyncgrpo`` command (pyproject's script): see :mod:`.cli`."""

from __future__ import annotations

import sys

from services.launcher.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
