"""The `python` environment: a `python` tool that runs the given code in the code sandbox
(`furlong.rollout.code_sandbox`: a private directory, CPU, memory and wall-time limits, no network)
and answers with what it printed (or its error)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from furlong.rollout.code_sandbox import CodeSandbox, SandboxLimits
from furlong.rollout.environments.tool_environment import ToolEnvironment, ToolError

MAX_CODE_CHARS = 16384
MAX_OUTPUT_CHARS = 2000

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "a Python program"}},
            "required": ["code"],
        },
    },
}


class PythonEnvironment(ToolEnvironment):
    tools = [PYTHON_TOOL]

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        super().__init__()
        self._sandbox = CodeSandbox(limits or SandboxLimits(timeout_s=10.0, cpu_s=10), "auto")

    def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        code = arguments.get("code")
        if name != "python":
            raise ToolError(f"unknown tool {name!r}")
        if not isinstance(code, str) or not code.strip():
            raise ToolError(f"code must be a non-empty string, got {code!r}")
        if len(code) > MAX_CODE_CHARS:
            raise ToolError(f"code has {len(code)} characters, more than {MAX_CODE_CHARS}")
        result = self._sandbox.run(code)
        if result.passed:
            return result.stdout[-MAX_OUTPUT_CHARS:]
        reason = (
            f"exceeded its {result.limit} limit"
            if result.limit
            else f"exited with status {result.returncode}"
        )
        return f"{result.stdout}{result.stderr}"[-MAX_OUTPUT_CHARS:] + f"\n(the program {reason})"
