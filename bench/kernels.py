"""Kernel benchmark; the same as ``quill bench kernels`` (see docs/BENCHMARKS.md).

    python bench/kernels.py --quick
    python bench/kernels.py --json bench/out/kernels.json --plot bench/out/kernels.png
"""

import sys

from quill.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "kernels", *sys.argv[1:]]))
