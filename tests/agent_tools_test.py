"""The calculator against an independent evaluation of random expression trees (exact
Fractions, and Python's own integer arithmetic), refusals that stay fast for any input, the
python tool's observations and run_calls' order and concurrency."""
import operator
import random
import time
from fractions import Fraction

import pytest

from grpo_jax.agent import tools
from grpo_jax.errors import UserError

CALC = tools.TOOLS["calculator"]
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
       "//": operator.floordiv, "%": operator.mod, "**": operator.pow}


def _tree(rng: random.Random, depth: int):
  """('op', left, right) or an int leaf; ** only to a small integer so values stay moderate."""
  if depth == 0 or rng.random() < 0.3:
    return rng.randint(-30, 30)
  op = rng.choice(list(OPS))
  if op == "**":
    return op, _tree(rng, depth - 1), rng.randint(-3, 4)
  return op, _tree(rng, depth - 1), _tree(rng, depth - 1)


def _text(tree) -> str:
  if isinstance(tree, int):
    return f"({tree})" if tree < 0 else str(tree)
  op, left, right = tree
  return f"({_text(left)} {op} {_text(right)})"


def _value(tree) -> Fraction:
  """The tree's exact value, walking the tree (no parsing): the reference."""
  if isinstance(tree, int):
    return Fraction(tree)
  op, left, right = tree
  return OPS[op](_value(left), _value(right))


def _exact_in_python(tree) -> bool:
  """Whether Python's int arithmetic evaluates the tree exactly (no '/', no negative power)."""
  if isinstance(tree, int):
    return True
  op, left, right = tree
  if op == "/" or (op == "**" and right < 0):
    return False
  return _exact_in_python(left) and _exact_in_python(right)


def _short_decimal(x: Fraction) -> bool:
  """Whether x has a decimal expansion of at most 20 places (its denominator divides 10**20)."""
  return 10**20 % x.denominator == 0


def _observation(result: tools.ToolResult) -> tuple[str, str]:
  return result.text, result.status


def test_random_expressions_match_an_independent_evaluation():
  rng = random.Random(0)
  checked = python_checked = errors = 0
  for _ in range(400):
    tree = _tree(rng, depth=4)
    text = _text(tree)
    try:
      want = _value(tree)
    except ZeroDivisionError:
      assert _observation(CALC(text)) == ("error: division by zero", "error")
      errors += 1
      continue
    assert tools.evaluate(text) == want, text
    got = CALC(text)
    assert got.status == "ok", (text, got)
    if want.denominator == 1:
      assert got.text == str(want.numerator)
    elif _short_decimal(want):
      assert Fraction(got.text) == want, (text, got.text)
    else:  # 12 significant digits
      assert float(got.text) == pytest.approx(float(want), rel=1e-11)
    if _exact_in_python(tree):
      assert got.text == str(eval(text)), text  # pylint: disable=eval-used  # our own text
      python_checked += 1
    checked += 1
  assert checked > 250 and python_checked > 50 and errors > 5  # each branch was exercised


@pytest.mark.parametrize("expression,text", [
    ("(347 + 289) * 3 / 4", "477"),
    ("0.1 + 0.2", "0.3"),
    ("25 / 2", "12.5"),
    ("12.50", "12.5"),
    ("1 / 8", "0.125"),
    ("-7 / 4", "-1.75"),
    ("1 / 3", "0.333333333333"),
    ("2 / 3", "0.666666666667"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("-7 % 3", "2"),
    ("2 ** -2", "0.25"),
    ("2 ** 0.5", "1.41421356237"),
    ("4 ** 0.5", "2"),
    ("1e3", "1000"),
    ("1_000 * 3", "3000"),
    ("  2+2 ", "4"),
    ("-" * 499 + "1", "-1"),
    ("1 ** (10 ** 100)", "1"),
    ("2 ** 100", str(2**100)),
    ("9" * 500, "9" * 500),  # past a float's range, far inside MAX_BITS
    ("1" + "0" * 400 + " - 1", "9" * 400),
])
def test_worked_examples(expression, text):
  assert _observation(CALC(expression)) == (text, "ok")


@pytest.mark.parametrize("expression,error", [
    ("1 / 0", "division by zero"),
    ("5 // (3 - 3)", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("9**9**9", "too large"),
    ("2 ** 100000", "too large"),
    ("(10 ** 1000) ** 5", "too large"),
    ("1.5 ** 100000", "too large"),
    ("1e999", "too large"),
    ("2 " + "** 2 " * 60, "too large"),
    ("(10 // 1) ** 100000000", "too large"),  # // gives a Python int: still bounded
    ("(-8) ** (1/3)", "not a real number"),
    ("9" * 600, "longer than"),
    ("x + 1", "not arithmetic: Name"),
    ("abs(-1)", "not arithmetic: Call"),
    ("__import__('os').system('echo hi')", "not arithmetic: Call"),
    ("(1).real", "not arithmetic: Attribute"),
    ("(1).__class__", "not arithmetic: Attribute"),
    ("[1, 2]", "not arithmetic: List"),
    ("1, 000", "not arithmetic: Tuple"),
    ("'a' * 3", "not arithmetic: Constant"),
    ("True + 1", "not arithmetic: Constant"),
    ("1j", "not arithmetic: Constant"),
    ("1 < 2", "not arithmetic: Compare"),
    ("lambda: 1", "not arithmetic: Lambda"),
    ("2 ^ 3", "write **"),
    ("", "not an expression"),
    ("1 +", "not an expression"),
    ("(1", "not an expression"),
    ("1 2", "not an expression"),
    ("1; 2", "not an expression"),
    ("import os", "not an expression"),
    ("(" * 300 + "1" + ")" * 300, "longer than"),
    ("1\x00", "not an expression"),
])
def test_refusals_are_error_observations(expression, error):
  got = CALC(expression)
  assert got.status == "error" and got.text.startswith("error: ") and error in got.text, got
  assert got.seconds < 0.05


def test_any_input_is_an_observation_and_fast():
  rng = random.Random(1)
  alphabet = "0123456789+-*/%().e_ ^xj\n\t'[]"
  for _ in range(300):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
    start = time.perf_counter()
    got = CALC(text)
    assert got.status in ("ok", "error") and time.perf_counter() - start < 0.05, (text, got)
  for weird in (None, 12, b"1+1", ["1"]):
    assert CALC(weird).status == "error"


def test_descriptions_give_the_call_syntax():
  assert "<tool>calculator: " in CALC.description
  assert "<tool>python: " in tools.select(["python"], timeout_s=2.0)["python"].description
  assert "2 s at most" in tools.select(["python"], timeout_s=2.0)["python"].description
  with pytest.raises(ValueError, match="known tools: calculator, python"):
    tools.select(["abacus"])


def test_select_checks_the_python_tools_sandbox(capsys):
  assert tools.select(["python"])["python"].sandbox_mode == "strict"
  assert "warning" not in capsys.readouterr().err
  python = tools.select(["calculator", "python"], sandbox_mode="unsafe")["python"]
  assert python.sandbox_mode == "unsafe"
  assert "agent.sandbox='unsafe'" in capsys.readouterr().err  # at every start
  assert python("print(6 * 7)").text == "42"
  tools.select(["calculator"], sandbox_mode="unsafe")  # no python tool: nothing to warn about
  tools.select(["python"], sandbox_mode="unsafe", check_sandbox=False)  # descriptions only
  assert capsys.readouterr().err == ""
  with pytest.raises(UserError, match="agent.sandbox='lax'"):
    tools.select(["python"], sandbox_mode="lax")


def test_the_python_tool_observations():
  python = tools.select(["python"], timeout_s=1.0)["python"]
  assert python("print(sum(range(1, 101)))").text == "5050"
  assert _observation(python("```python\nprint(3)\n```")) == ("3", "ok")
  assert python("x = 1").text == "(no output: print() the result)"
  assert _observation(python("print('so far')\nx = 0\nprint(1 / x)")) == (
      "so far\nerror: ZeroDivisionError: division by zero (line 3)", "error")
  assert python("x = = 1").text == "error: SyntaxError: invalid syntax (line 1)"
  assert python("import sys; sys.exit(3)").text == "error: exited with status 3"
  assert python("import os\nos.system('ls')").text.startswith(
      "error: PermissionError: sandbox refused: os.system")
  assert _observation(python("while True: pass")) == ("error: timed out after 1 s", "timeout")
  got = python("while True: print('y' * 1000)")
  assert got.status == "killed" and got.text.endswith("error: too much output; stopped")
  assert len(got.text) < tools.MAX_OBSERVATION_CHARS + 100


def test_run_calls_keeps_order_names_unknown_tools_and_runs_in_parallel():
  python = tools.select(["python"], timeout_s=1.0)["python"]
  toolset = {"calculator": CALC, "python": python}
  calls = [("python", f"print({i} * {i})") for i in range(12)]
  calls += [("calculator", "6 * 7"), ("abacus", "1"), ("python", "while True: pass")]
  start = time.monotonic()
  got = tools.run_calls(calls, max_workers=4, tools=toolset)
  wall = time.monotonic() - start
  assert [r.text for r in got[:12]] == [str(i * i) for i in range(12)]
  assert got[12].text == "42"
  assert got[13] == tools.ToolResult(
      "error: unknown tool 'abacus'; known tools: calculator, python", "error", 0.0)
  assert got[14].status == "timeout"
  # 13 sandboxes (~0.1 s each) and one 1 s timeout on 4 workers; one at a time would be > 2 s.
  assert wall < 2.0, wall
  with pytest.raises(ValueError):
    tools.run_calls(calls, max_workers=0)
