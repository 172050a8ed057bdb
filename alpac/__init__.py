"""alpac: an offline auto-parallelizing compiler for XLA HLO modules."""

__version__ = "0.1.0"
