"""Error bodies as vLLM's OpenAI-compatible server writes them."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        }

    def anthropic_body(self) -> dict:
        """The error as vLLM's /v1/messages answers it (translate_error_response)."""
        return {"type": "error", "error": {"type": self.kind, "message": self.message}}


def bad_param(message: str, param: str, value) -> ApiError:
    return ApiError(400, f"{message} (parameter={param}, value={value})", param=param)


def invalid(message: str, param: str) -> ApiError:
    """A request field refused by vLLM's request model (its VLLMValidationError)."""
    return ApiError(400, f"{message} (parameter={param})", param=param)


def validation_error(problems: list[dict]) -> ApiError:
    """A request refused by the request model's field types, in pydantic's words as vLLM relays them: each
    problem a dict of type, loc ("body.field"), msg, input (summarised) and ctx, the first one's loc the param."""
    count = len(problems)
    lines = [f"{count} validation error{'s' if count > 1 else ''}:"]
    lines += [f"  {problem}" for problem in problems]
    return ApiError(400, "\n".join(lines), "Bad Request", problems[0]["loc"])


def problem(kind: str, loc: str, msg: str, value, ctx: dict | None = None) -> dict:
    """One pydantic problem as vLLM prints it: a dict or list input summarised, anything else as a string of at
    most 200 characters."""
    if isinstance(value, dict):
        shown = f"<dict of {len(value)} items>"
    elif isinstance(value, list):
        shown = f"<list of {len(value)} items>"
    else:
        try:
            shown = value if isinstance(value, str) else str(value)
        except ValueError:  # an integer past Python's limit on digits
            shown = f"<{type(value).__name__}>"
        if len(shown) > 200:
            shown = shown[:200] + "...[truncated]"
    found = {"type": kind, "loc": loc, "msg": msg, "input": shown}
    if ctx is not None:
        found["ctx"] = ctx
    return found


def literal_choices(values: tuple[str, ...]) -> str:
    """pydantic's list of a Literal's values: 'a', 'b' or 'c'."""
    quoted = [f"'{value}'" for value in values]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def literal_problem(loc: str, value, values: tuple[str, ...]) -> dict:
    choices = literal_choices(values)
    return problem("literal_error", loc, f"Input should be {choices}", value, {"expected": choices})
