"""Two SkyRL-Gym text environments (``skyrl_gym`` ``BaseTextEnv``s, registered by :mod:`mlora.rollout.envs`):
a calculator tool and a number-guessing game.

``calculator``: the model answers an arithmetic question and may call a calculator first. A turn that
holds ``<tool>EXPRESSION</tool>`` is a tool call: the environment answers with ``<result>VALUE</result>``
(or ``<result>error: ...</result>``) and the trajectory goes on. A turn without a call is the answer: its
``#### N`` (or else its last number) is compared with ``reward_spec.ground_truth``: reward 1, else 0, and
the trajectory ends. An empty call (``<tool></tool>``) applies the calculator to the question's own
expression (``reward_spec.expression``), the tool's default argument. The calculator is a SkyRL tool group
(:class:`CalculatorToolGroup`, ``skyrl_gym.tools.core``) run through ``BaseTextEnv._execute_tool``. Reaching ``max_turns`` without an
answer ends the trajectory with reward 0.

``guess_number``: a hidden integer in ``[low, high]`` (``reward_spec``: ``target``, ``low``, ``high``);
each turn's last integer is a guess and the environment says "higher" or "lower". Guessing it gives reward
1 (SkyRL-style turn rewards: 0 on the other turns) and ends the game; ``max_turns`` guesses at most.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.tools.core import ToolGroup, tool

TOOL_CALL = re.compile(r"<tool>(.*?)(?:</tool>|$)", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION = 200  # characters
MAX_MAGNITUDE = 1e15


def evaluate_expression(text: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); ValueError otherwise.

    Parsed with :mod:`ast` and walked here (never ``eval``); exponents above 64 and values beyond 1e15
    are refused, so a model cannot make the environment compute for long."""
    text = text.strip().replace("×", "*").replace("÷", "/")
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {text[:40]!r}") from None

    def walk(node: ast.AST):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            try:
                value = _OPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
            if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
                raise ValueError("value out of range")
            return value
        raise ValueError(f"not an arithmetic expression: {text[:40]!r}")

    return walk(tree)


def format_number(value: int | float) -> str:
    """``12`` for 12.0, else the shortest float text."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def final_answer(text: str) -> str | None:
    """The number after ``####``, else the last number of ``text``, normalised (``12.0`` -> ``12``)."""
    marked = re.search(r"####\s*(-?\d+(?:\.\d+)?)", text)
    found = [marked.group(1)] if marked else _NUMBER.findall(text)
    return format_number(float(found[-1])) if found else None


class CalculatorToolGroup(ToolGroup):
    """The calculator as a SkyRL tool group: ``calculate(expression)`` -> the value's text or ``error: ...``."""

    def __init__(self) -> None:
        super().__init__(name="CalculatorToolGroup")

    @tool
    def calculate(self, expression: str) -> str:
        try:
            return format_number(evaluate_expression(expression))
        except ValueError as exc:  # the model's bad expression is its turn's answer, not an environment fault
            return f"error: {exc}"


class CalculatorEnv(BaseTextEnv):
    """Arithmetic with a calculator tool (module docstring). ``extras``: the prompt row, with
    ``reward_spec.ground_truth`` and optionally ``reward_spec.expression``; ``max_turns`` from the row,
    else ``env_config.max_turns`` (environment.skyrl_gym.calculator.max_turns), else 3."""

    def __init__(self, env_config: Any = None, extras: dict | None = None) -> None:
        super().__init__()
        env_config, extras = env_config or {}, extras or {}
        spec = extras.get("reward_spec") or {}
        if "ground_truth" not in spec:
            raise ValueError("calculator: the prompt row's reward_spec needs 'ground_truth'")
        self.ground_truth = format_number(float(spec["ground_truth"]))
        self.expression = spec.get("expression")
        self.max_turns = int(extras.get("max_turns") or env_config.get("max_turns", 3))
        self.tool_calls = 0
        self.init_tool_groups([CalculatorToolGroup()])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        call = TOOL_CALL.search(action)
        if call is None:  # the answer
            answer = final_answer(action)
            correct = answer == self.ground_truth
            return BaseTextEnvStepOutput(observations=[], reward=float(correct), done=True,
                                         metadata={"answer": answer, "tool_calls": self.tool_calls})
        self.tool_calls += 1
        expression = call.group(1).strip() or (self.expression or "")
        result = self._execute_tool("CalculatorToolGroup", "calculate", [expression])
        done = self.turns >= self.max_turns
        return BaseTextEnvStepOutput(observations=[] if done else [{"role": "user",
                                                                    "content": f"<result>{result}</result>"}],
                                     reward=0.0, done=done,
                                     metadata={"tool_calls": self.tool_calls, "result": result})

    def get_metrics(self) -> dict[str, Any]:
        """Per episode (averaged over a batch by SkyRL's default ``aggregate_metrics``)."""
        return {"tool_calls": self.tool_calls, "turns": self.turns}


class GuessNumberEnv(BaseTextEnv):
    """The number-guessing game (module docstring); ``max_turns`` as :class:`CalculatorEnv` (default 5)."""

    def __init__(self, env_config: Any = None, extras: dict | None = None) -> None:
        super().__init__()
        env_config, extras = env_config or {}, extras or {}
        spec: dict[str, Any] = extras.get("reward_spec") or {}
        if "target" not in spec:
            raise ValueError("guess_number: the prompt row's reward_spec needs 'target'")
        self.target = int(spec["target"])
        self.low, self.high = int(spec.get("low", 1)), int(spec.get("high", 100))
        if not self.low <= self.target <= self.high:
            raise ValueError(f"guess_number: target {self.target} outside [{self.low}, {self.high}]")
        self.max_turns = int(extras.get("max_turns") or env_config.get("max_turns", 5))

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        numbers = re.findall(r"-?\d+", action)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.target:
            return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={"guesses": self.turns})
        if guess is None:
            hint = f"Please answer with one whole number between {self.low} and {self.high}."
        else:
            hint = f"The number is {'higher' if guess < self.target else 'lower'} than {guess}."
        done = self.turns >= self.max_turns
        return BaseTextEnvStepOutput(observations=[] if done else [{"role": "user", "content": hint}], reward=0.0,
                                     done=done, metadata={"guesses": self.turns})
