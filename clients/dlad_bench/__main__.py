"""``python -m dlad_bench``: the same as the ``dlad-bench`` command."""

import sys

from dlad_bench.cli import main

sys.exit(main())
