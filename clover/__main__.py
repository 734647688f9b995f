"""`python -m clover ...` is the `clover` command."""

import sys

from clover.cli import main

sys.exit(main())
