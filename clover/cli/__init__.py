"""The command line: `clover ...` (`commands`: init, convert, export, info, check and the dispatch), generation
and serving (`generate`), data, training and plots (`train`), evaluations and the serving benchmark
(`evaluate`). The top layer: it may import all others.
"""

from clover.cli.commands import main

__all__ = ["main"]
