import sys

from torch_xaccel.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
