"""Build csrc/ (the CUDA C++ kernels) with nvcc into the library `minisgl.kernels.native` loads.

Usage: python -m minisgl.tools.build_csrc [OUT_DIR]     (default csrc/build; prints the library's path)
"""

from __future__ import annotations

import sys
from pathlib import Path

from minisgl.kernels.native import CSRC, build


def main() -> None:
    if len(sys.argv) > 2 or sys.argv[1:2] in (["-h"], ["--help"]):
        sys.exit(__doc__)
    print(build(Path(sys.argv[1]) if len(sys.argv) == 2 else CSRC / "build"))


if __name__ == "__main__":
    main()
