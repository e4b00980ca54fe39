"""The agent's tools, picked by name: `TOOLS[name](argument) -> ToolResult`.

    >>> TOOLS["calculator"]("(347 + 289) * 3 / 4")
    ToolResult(text='477', status='ok', seconds=2e-05)
    >>> run_calls([("calculator", "1/8"), ("python", "print(2**10)"), ("abacus", "1")],
    ...           max_workers=2)
    [ToolResult('0.125', 'ok', ...), ToolResult('1024', 'ok', ...),
     ToolResult("error: unknown tool 'abacus'; known tools: calculator, python", 'error', 0.0)]

A tool never raises for any argument: what goes wrong is the observation text ('error: ...')
with status 'error', 'timeout' or 'killed'. The one exception is sandbox.SandboxError (the
sandbox cannot be set up at all), which says nothing about the argument and should stop a run.
The call syntax in the descriptions is the one env.py parses: <tool>NAME: ARGUMENT</tool>.
"""
from __future__ import annotations

import ast
import dataclasses
import decimal
import math
import operator
import re
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

from grpo_jax.agent import sandbox

# Longer arguments are refused: this bounds parsing time and the evaluator's recursion depth.
MAX_EXPRESSION_CHARS = 500
# A larger intermediate numerator or denominator is refused ('9**9**9' at once, not in hours).
MAX_BITS = 4096
# What the model sees of a tool's output.
MAX_OBSERVATION_CHARS = 2000
_PROGRAM_LINE = re.compile(r'File "main\.py", line (\d+)')


@dataclasses.dataclass(frozen=True)
class ToolResult:
  text: str  # the observation shown to the model
  status: str  # 'ok', 'error', 'timeout' or 'killed'
  seconds: float


# --- calculator ----------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _checked(value):
  """The value as a Fraction (or float), refused when too large to carry on with."""
  if isinstance(value, int):  # Fraction // Fraction is an int; ** on an int would be a float
    value = Fraction(value)
  if isinstance(value, float):
    if not math.isfinite(value):
      raise ValueError("result too large")
  elif max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
    raise ValueError("result too large")
  return value


def _power(base, exponent):
  if isinstance(exponent, Fraction) and exponent.denominator == 1:
    n = exponent.numerator
    # Bounded before it is computed; 0, 1 and -1 stay small for any exponent.
    if isinstance(base, Fraction) and (abs(base.numerator) > 1 or base.denominator != 1):
      if abs(n) * max(base.numerator.bit_length(), base.denominator.bit_length()) > MAX_BITS:
        raise ValueError("result too large")
    return base ** n  # a float base overflows (OverflowError) or underflows at once
  if base < 0:
    raise ValueError("a negative number to a fractional power is not a real number")
  return float(base) ** float(exponent)  # irrational in general: a float


def _evaluate(node):
  if isinstance(node, ast.Expression):
    return _evaluate(node.body)
  if isinstance(node, ast.Constant) and type(node.value) is int:
    return _checked(node.value)  # math.isfinite would overflow on an int past 1e308
  if isinstance(node, ast.Constant) and type(node.value) is float:
    # Floats from their text, so 0.1 is exactly 1/10 and 0.1 + 0.2 == 0.3.
    return _checked(Fraction(repr(node.value)) if math.isfinite(node.value) else node.value)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    value = _evaluate(node.operand)
    return -value if isinstance(node.op, ast.USub) else value
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
    return _checked(_power(_evaluate(node.left), _evaluate(node.right)))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    return _checked(_BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right)))
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
    raise ValueError("'^' is not a power here; write ** (2**10)")
  raise ValueError(f"not arithmetic: {type(node).__name__} (only numbers, + - * / // % ** and "
                   "parentheses)")


def evaluate(expression: str) -> Fraction | float:
  """The exact value of an arithmetic expression (a float only after a fractional power).

    >>> evaluate("0.1 + 0.2"), evaluate("7 // 2 - 2**-1"), evaluate("2 ** 0.5")
    (Fraction(3, 10), Fraction(5, 2), 1.4142135623730951)
  """
  if not isinstance(expression, str):
    raise ValueError(f"the expression must be text, not {type(expression).__name__}")
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
  try:
    with warnings.catch_warnings():  # '4x' warns on stderr before it fails: noise in the logs
      warnings.simplefilter("ignore", SyntaxWarning)
      tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError as e:
    raise ValueError(f"not an expression ({e.msg})") from None
  return _evaluate(tree)


def format_number(value: Fraction | float) -> str:
  """Integers in full; terminating decimals exactly (12.5); the rest to 12 significant digits."""
  if isinstance(value, float):
    return format(value, ".12g")
  if value.denominator == 1:
    return str(value.numerator)
  twos = (value.denominator & -value.denominator).bit_length() - 1
  rest, fives = value.denominator >> twos, 0
  while rest % 5 == 0:
    rest, fives = rest // 5, fives + 1
  digits = max(twos, fives)
  if rest == 1 and digits <= 20:  # value * 10**digits is an integer
    scaled = abs(value.numerator) * 10**digits // value.denominator
    whole, frac = divmod(scaled, 10**digits)
    return f"{'-' if value < 0 else ''}{whole}.{frac:0{digits}d}".rstrip("0")
  with decimal.localcontext(decimal.Context(prec=12)):
    return str(decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator))


class Calculator:
  name = "calculator"
  description = ("calculator: exact arithmetic on numbers with + - * / // % ** and parentheses; no "
                 "variables, functions or units. Call it as <tool>calculator: EXPRESSION</tool>, "
                 "e.g. <tool>calculator: (347 + 289) * 3 / 4</tool> gives 477.")

  def __call__(self, argument: str) -> ToolResult:
    start = time.perf_counter()
    try:
      text, status = format_number(evaluate(argument)), "ok"
    except ZeroDivisionError:
      text, status = "error: division by zero", "error"
    except OverflowError:
      text, status = "error: result too large", "error"
    except Exception as e:  # pylint: disable=broad-except  # any argument gives an observation
      text, status = f"error: {e}", "error"
    return ToolResult(text, status, time.perf_counter() - start)


# --- python --------------------------------------------------------------------------------------

def _clip(text: str, limit: int = MAX_OBSERVATION_CHARS) -> str:
  return text if len(text) <= limit else text[:limit] + f"\n... [cut at {limit} characters]"


def _exception_line(stderr: str, exit_code: int | None) -> str:
  """'ZeroDivisionError: division by zero (line 3)' from a traceback: its last line and the
  last line number in the program."""
  lines = stderr.strip().splitlines() or [f"exited with status {exit_code}"]
  at = _PROGRAM_LINE.findall(stderr)
  return lines[-1] + (f" (line {at[-1]})" if at else "")


def _strip_fences(code: str) -> str:
  """Models often wrap code in a ```python fence; the fence is not Python."""
  lines = code.strip().splitlines()
  if lines and lines[0].startswith("```"):
    lines = lines[1:-1] if lines[-1].strip() == "```" else lines[1:]
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Python:
  timeout_s: float = 5.0
  sandbox_mode: str = "strict"  # 'strict' (the kernel's layers) or 'unsafe'; see sandbox.check
  name = "python"

  @property
  def description(self) -> str:
    return ("python: runs a short Python program (math, fractions, statistics, itertools and "
            "other common modules; no network, no files outside its folder, "
            f"{self.timeout_s:g} s at most) and returns what it prints. Call it as "
            "<tool>python: CODE</tool>, e.g. <tool>python: print(sum(range(1, 101)))</tool> "
            "gives 5050; print() what you want to see.")

  def __call__(self, argument: str) -> ToolResult:
    result = sandbox.run_python(_strip_fences(str(argument)), timeout_s=self.timeout_s,
                                mode=self.sandbox_mode)
    out = _clip(result.stdout.rstrip("\n"))
    if result.status == "ok":
      return ToolResult(out or "(no output: print() the result)", "ok", result.seconds)
    if result.status == "error":
      error, status = _exception_line(result.stderr, result.exit_code), "error"
    elif result.status == "timeout":
      error, status = f"timed out after {self.timeout_s:g} s", "timeout"
    elif result.status == "output_limit":
      error, status = "too much output; stopped", "killed"
    else:
      error, status = f"killed by signal {result.signal} (a resource limit)", "killed"
    text = "\n".join(filter(None, (out, "error: " + _clip(error, 500))))
    return ToolResult(text, status, result.seconds)


# --- registry ------------------------------------------------------------------------------------

TOOLS = {"calculator": Calculator(), "python": Python()}


def select(names: Sequence[str], timeout_s: float = 5.0, sandbox_mode: str = "strict",
           check_sandbox: bool = True) -> dict:
  """{name: tool} for the named tools, their time limit set; an unknown name is a ValueError.

  With the python tool, its sandbox is checked here, at the start of a run: a missing layer
  raises sandbox.SandboxUnavailable naming it; sandbox_mode='unsafe' warns instead.
  check_sandbox=False skips that, for callers that only read the descriptions.
  """
  unknown = [n for n in names if n not in TOOLS]
  if unknown:
    raise ValueError(f"unknown tools {unknown}; known tools: {', '.join(TOOLS)}")
  if "python" in names and check_sandbox:
    sandbox.check(sandbox_mode)
  chosen = {}
  for n in names:
    tool = TOOLS[n]
    if hasattr(tool, "timeout_s"):
      tool = dataclasses.replace(tool, timeout_s=timeout_s)
    if hasattr(tool, "sandbox_mode"):
      tool = dataclasses.replace(tool, sandbox_mode=sandbox_mode)
    chosen[n] = tool
  return chosen


def _call(tools: dict, name: str, argument: str) -> ToolResult:
  if name not in tools:
    known = ", ".join(tools)
    return ToolResult(f"error: unknown tool {name!r}; known tools: {known}", "error", 0.0)
  return tools[name](argument)


def run_calls(calls: Sequence[tuple[str, str]], max_workers: int, tools: dict = TOOLS
              ) -> list[ToolResult]:
  """Runs (tool name, argument) calls, at most max_workers at a time; results in call order."""
  if max_workers < 1:
    raise ValueError(f"max_workers={max_workers} must be at least 1")
  with ThreadPoolExecutor(max_workers=max_workers) as pool:
    return list(pool.map(lambda call: _call(tools, *call), calls))
