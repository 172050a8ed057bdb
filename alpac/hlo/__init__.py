"""The HLO IR: shapes, instructions, computations, modules; text parser and printer."""

from alpac.hlo.ir import Alias, Computation, Instruction, Module
from alpac.hlo.parser import parse_hlo
from alpac.hlo.printer import print_module
from alpac.hlo.shape import Shape

__all__ = ["Alias", "Computation", "Instruction", "Module", "Shape", "parse_hlo", "print_module"]
