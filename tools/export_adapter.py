#!/usr/bin/env python
"""`mlora export-adapter` from the tools/ folder: the same implementation (mlora.cli), flags and exit codes.

    python tools/export_adapter.py --help
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when mlora is not installed

from mlora.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["export-adapter", *sys.argv[1:]]))
