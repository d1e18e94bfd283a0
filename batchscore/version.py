"""The package's version: one string every module may import (the top face, `batchscore`, loads
the runner lazily, so naming the version through it would close an import circle)."""

__version__ = "0.1.0"
