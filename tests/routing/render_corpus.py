"""The request shapes coding agents send, as test data: the router must render each one to exactly the prompt
token ids the engine computes for it (tests/routing/test_render_parity.py)."""

from __future__ import annotations

from dataclasses import dataclass

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"

SYSTEM = (
    "You are a coding agent working in a Python repository. Follow its conventions and run its tests. " * 4
)
FILE = 'def parse(line: str) -> list[str]:\n    """Split a CSV line."""\n    return line.split(",")\n' * 6

OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "description": "Replace text in a file; each edit is applied in order. Ünïcode stays as it is.",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "edits": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "old": {"type": "string"},
                                "new": {"type": "string"},
                                "mode": {"type": "string", "enum": ["first", "all"]},
                            },
                            "required": ["old", "new"],
                            "additionalProperties": False,
                        },
                    },
                    "options": {"$ref": "#/$defs/options"},
                },
                "required": ["path", "edits"],
                "$defs": {"options": {"type": "object", "properties": {"dry_run": {"type": "boolean"}}}},
            },
        },
    },
    {"type": "function", "function": {"name": "list_dir"}},
]

ANTHROPIC_TOOLS = [
    {
        "name": "Bash",
        "description": "Run a shell command.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"],
        },
    },
    {
        "name": "Read",
        "description": "Read a file.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}},
            "required": ["file_path"],
        },
        "cache_control": {"type": "ephemeral"},
    },
    {
        "name": "Edit",
        "input_schema": {
            "type": "object",
            "properties": {
                "file_path": {"type": "string"},
                "edits": {"type": "array", "items": {"type": "object", "properties": {"old": {}, "new": {}}}},
            },
        },
    },
]


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class RenderCase:
    name: str
    path: str
    payload: dict


OPENAI_CASES = [
    RenderCase(
        "string content",
        CHAT,
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Fix the <|im_end|> bug."},
            ]
        },
    ),
    RenderCase(
        "lists of text parts",
        CHAT,
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Look at"}, {"type": "text", "text": FILE}],
                },
            ]
        },
    ),
    RenderCase(
        "system and developer roles",
        CHAT,
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "developer", "content": "Prefer small commits."},
                {"role": "user", "content": "Go.", "name": "alice"},
            ]
        },
    ),
    RenderCase(
        "assistant tool calls with null content and with text, and tool results",
        CHAT,
        {
            "tools": OPENAI_TOOLS,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Read src/csv.py"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [call("call_1", "read_file", '{"path": "src/csv.py"}')],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": FILE},
                {
                    "role": "assistant",
                    "content": "I will fix the split.",
                    "tool_calls": [
                        call(
                            "call_2",
                            "edit_file",
                            '{"path":"src/csv.py","edits":[{"old":"split","new":"rsplit","mode":"all"}]}',
                        )
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "call_2",
                    "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "1 edit"}],
                },
            ],
        },
    ),
    RenderCase(
        "parallel tool calls",
        CHAT,
        {
            "tools": OPENAI_TOOLS,
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "messages": [
                {"role": "user", "content": "Read both files."},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        call("call_a", "read_file", '{"path": "a.py"}'),
                        call("call_b", "read_file", '{"path": "b.py", "limit": 40}'),
                        call("call_c", "list_dir", ""),
                    ],
                },
                {"role": "tool", "tool_call_id": "call_a", "content": "A = 1\n"},
                {"role": "tool", "tool_call_id": "call_b", "content": "B = 2\n"},
                {"role": "tool", "tool_call_id": "call_c", "content": "a.py\nb.py\n"},
            ],
        },
    ),
    RenderCase(
        "tool_choice required",
        CHAT,
        {
            "tools": OPENAI_TOOLS,
            "tool_choice": "required",
            "messages": [{"role": "user", "content": "List."}],
        },
    ),
    RenderCase(
        "tool_choice naming a function",
        CHAT,
        {
            "tools": OPENAI_TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "list_dir"}},
            "messages": [{"role": "user", "content": "List."}],
        },
    ),
    RenderCase(
        "tool_choice none",
        CHAT,
        {
            "tools": OPENAI_TOOLS,
            "tool_choice": "none",
            "messages": [{"role": "user", "content": "Just answer."}],
        },
    ),
    RenderCase(
        "chat_template_kwargs enable_thinking",
        CHAT,
        {
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": "Quick one."}],
        },
    ),
    RenderCase(
        "chat_template_kwargs cannot override the request's own add_generation_prompt",
        CHAT,
        {
            "chat_template_kwargs": {"add_generation_prompt": False, "continue_final_message": True},
            "documents": [{"title": "notes", "text": "The build uses make."}],
            "messages": [{"role": "user", "content": "How is it built?"}],
        },
    ),
    RenderCase(
        "reasoning in history",
        CHAT,
        {
            "tools": OPENAI_TOOLS,
            "messages": [
                {"role": "user", "content": "Why does it fail?"},
                {"role": "assistant", "content": "Let me look.", "reasoning": "The split is wrong."},
                {"role": "user", "content": "And now?"},
                {"role": "assistant", "content": "Fixed.", "reasoning_content": "Checked the tests."},
                {"role": "user", "content": "Thanks."},
            ],
        },
    ),
    RenderCase(
        "arguments that are not valid JSON",
        CHAT,
        {
            "tools": OPENAI_TOOLS,
            "messages": [
                {"role": "user", "content": "Read."},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [call("c1", "read_file", '{"path": "a.py"')],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "error: bad arguments"},
            ],
        },
    ),
    RenderCase(
        "Claude Code's billing header in a system message",
        CHAT,
        {
            "messages": [
                {
                    "role": "system",
                    "content": "x-anthropic-billing-header: cc_version=2.1; cch=93ab\n" + SYSTEM,
                },
                {"role": "user", "content": "Hi."},
            ]
        },
    ),
]


def text(value: str, **extra) -> dict:
    return {"type": "text", "text": value, **extra}


ANTHROPIC_CASES = [
    RenderCase(
        "system as a string, text blocks",
        MESSAGES,
        {
            "max_tokens": 16,
            "system": SYSTEM,
            "messages": [{"role": "user", "content": [text("Look at this:"), text(FILE)]}],
        },
    ),
    RenderCase(
        "system as blocks with cache_control, billing header dropped",
        MESSAGES,
        {
            "max_tokens": 16,
            "system": [
                text("x-anthropic-billing-header: cc_version=2.1; cch=93ab"),
                text("You are Claude Code."),
                text(SYSTEM, cache_control={"type": "ephemeral"}),
            ],
            "tools": ANTHROPIC_TOOLS,
            "messages": [{"role": "user", "content": "Run the tests."}],
        },
    ),
    RenderCase(
        "tool_use and tool_result with string, list and is_error content",
        MESSAGES,
        {
            "max_tokens": 16,
            "system": [text(SYSTEM, cache_control={"type": "ephemeral"})],
            "tools": ANTHROPIC_TOOLS,
            "metadata": {"user_id": "user_abc_session_1"},
            "messages": [
                {"role": "user", "content": "Run the tests, then read the failing file."},
                {
                    "role": "assistant",
                    "content": [
                        text("Running them."),
                        {
                            "type": "tool_use",
                            "id": "toolu_01",
                            "name": "Bash",
                            "input": {"command": "pytest -q"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_01",
                            "content": "1 failed",
                            "is_error": True,
                        }
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "toolu_02",
                            "name": "Read",
                            "input": {"file_path": "src/csv.py"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_02",
                            "content": [text(FILE), text("(end)")],
                        },
                        text("Now fix it.", cache_control={"type": "ephemeral"}),
                    ],
                },
            ],
        },
    ),
    RenderCase(
        "several tool uses in one turn",
        MESSAGES,
        {
            "max_tokens": 16,
            "tools": ANTHROPIC_TOOLS,
            "messages": [
                {"role": "user", "content": "Read both."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_a", "name": "Read", "input": {"file_path": "a.py"}},
                        {"type": "tool_use", "id": "toolu_b", "name": "Read", "input": {"file_path": "b.py"}},
                        {"type": "tool_use", "id": "toolu_c", "name": "Edit", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_a", "content": "A = 1"},
                        {"type": "tool_result", "tool_use_id": "toolu_b", "content": [text("B = 2")]},
                        {"type": "tool_result", "tool_use_id": "toolu_c", "content": []},
                    ],
                },
            ],
        },
    ),
    RenderCase(
        "thinking blocks",
        MESSAGES,
        {
            "max_tokens": 16,
            "tools": ANTHROPIC_TOOLS,
            "messages": [
                {"role": "user", "content": "Why?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "The test expects rsplit.", "signature": "sig=="},
                        text("Because of the split."),
                        {"type": "tool_use", "id": "toolu_t", "name": "Bash", "input": {"command": "ls"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_t", "content": "a.py"}],
                },
            ],
        },
    ),
    RenderCase(
        "tool_choice any and a named tool",
        MESSAGES,
        {
            "max_tokens": 16,
            "tools": ANTHROPIC_TOOLS,
            "tool_choice": {"type": "tool", "name": "Bash", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": "ls"}],
        },
    ),
]

RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a command in the sandbox.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}},
                "workdir": {"type": "string"},
            },
            "required": ["command"],
        },
    },
    {
        "type": "function",
        "name": "apply_patch",
        "parameters": {"type": "object", "properties": {"input": {}}},
    },
]

RESPONSES_CASES = [
    RenderCase(
        "a string input with instructions", RESPONSES, {"instructions": SYSTEM, "input": "Fix the bug."}
    ),
    RenderCase(
        "Codex-style items: messages, function calls and their outputs, reasoning",
        RESPONSES,
        {
            "instructions": SYSTEM,
            "tools": RESPONSES_TOOLS,
            "reasoning": {"effort": "medium"},
            "input": [
                {
                    "type": "message",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "Sandbox: on."}],
                },
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Run the tests."}],
                },
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Run pytest first."}]},
                {
                    "type": "function_call",
                    "call_id": "call_r1",
                    "name": "shell",
                    "arguments": '{"command": ["pytest", "-q"]}',
                },
                {"type": "function_call_output", "call_id": "call_r1", "output": "1 failed"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "One test fails.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_r2",
                    "name": "shell",
                    "arguments": '{"command": ["cat", "a.py"]}',
                },
                {"type": "function_call", "call_id": "call_r3", "name": "apply_patch", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_r2", "output": FILE},
                {"type": "function_call_output", "call_id": "call_r3", "output": "Done!"},
                {"role": "user", "content": "Now commit."},
            ],
        },
    ),
]

# Edges: what a template may do with the final message, thinking switched off, roles out of the usual order.
EDGE_CASES = [
    RenderCase(
        "continue_final_message on a partial assistant message",
        CHAT,
        {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "partial"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ),
    RenderCase(
        "reasoning_effort none, an empty tool_calls list, a developer message first and a system one later",
        CHAT,
        {
            "reasoning_effort": "none",
            "tools": OPENAI_TOOLS,
            "messages": [
                {"role": "developer", "content": "Developer rules first."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "x", "tool_calls": []},
                {"role": "system", "content": "A later system message."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        },
    ),
    RenderCase(
        "Anthropic thinking disabled, an inline system reminder, an empty text block",
        MESSAGES,
        {
            "max_tokens": 8,
            "system": "S",
            "thinking": {"type": "disabled"},
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "reminder: be brief"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "go"}]},
            ],
        },
    ),
    RenderCase(
        "Anthropic prefilled assistant turn under tool_choice any",
        MESSAGES,
        {
            "max_tokens": 8,
            "tools": ANTHROPIC_TOOLS,
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "partial"}]},
            ],
        },
    ),
    RenderCase(
        "Responses reasoning content, a tool output as parts, a built-in tool beside functions",
        RESPONSES,
        {
            "tools": [{"type": "web_search_preview"}, *RESPONSES_TOOLS],
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "think"}],
                },
                {
                    "type": "function_call",
                    "call_id": "c",
                    "name": "shell",
                    "arguments": '{"command": ["ls"]}',
                },
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_text", "text": "x"}, {"type": "input_text", "text": "y"}],
                },
            ],
        },
    ),
    RenderCase(
        "Responses partial assistant message to continue",
        RESPONSES,
        {
            "instructions": "I",
            "input": [
                {"role": "user", "content": "hi"},
                {
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [{"type": "output_text", "text": "part", "annotations": []}],
                },
            ],
        },
    ),
]

# --- What the coding-agent CLIs themselves send (docs/agent-traffic shapes; literal captures to follow) -----

CODEX_INSTRUCTIONS = (
    "You are Codex, a coding agent based on GPT-5. You and the user share the same workspace. " * 3
)
CODEX_PERMISSIONS = (
    "<permissions instructions>Filesystem sandboxing: workspace-write. Approval policy: never. Network: "
    "restricted.</permissions instructions>"
)
CODEX_ENVIRONMENT = (
    "<environment_context>\n  <cwd>/tmp/work</cwd>\n  <shell>bash</shell>\n</environment_context>"
)
CODEX_TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "cmd": {"type": "string", "description": "Shell command to execute."},
                "workdir": {"type": "string"},
                "yield_time_ms": {"type": "number"},
            },
            "required": ["cmd"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "update_plan",
        "description": "Updates the task plan.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "explanation": {"type": "string"},
                "plan": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"step": {"type": "string"}, "status": {"type": "string"}},
                        "required": ["step", "status"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["plan"],
            "additionalProperties": False,
        },
    },
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool.",
        "format": {"type": "text"},
    },
    {
        "type": "namespace",
        "name": "mcp__docs",
        "description": "Tools of the `docs` MCP server.",
        "tools": [
            {
                "type": "function",
                "name": "search",
                "description": "Search the documentation.",
                "strict": False,
                "defer_loading": True,
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}},
                    "required": ["query"],
                },
            },
            {"type": "function", "name": "fetch", "parameters": {"type": "object", "properties": {}}},
            {"type": "custom", "name": "raw", "description": "Not shown: custom tools in a namespace."},
        ],
    },
    {"type": "web_search", "external_web_access": False},
]
CODEX_FIELDS = {
    "instructions": CODEX_INSTRUCTIONS,
    "tools": CODEX_TOOLS,
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "019a5e1c-7d1e-7c03-9f6b-3b0f3e0c2a11",
    "client_metadata": {"x-codex-installation-id": "5c1d"},
}
CODEX_FIRST_INPUT = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": CODEX_PERMISSIONS}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": CODEX_ENVIRONMENT}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the failing test."}]},
]
CODEX_LATER_INPUT = [
    *CODEX_FIRST_INPUT,
    {
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "**Running the tests**"}],
        "content": [{"type": "reasoning_text", "text": "I should run pytest to see what fails."}],
        "encrypted_content": None,
    },
    {
        "type": "function_call",
        "name": "exec_command",
        "arguments": '{"cmd":"pytest -q","workdir":"/tmp/work"}',
        "call_id": "call_A1",
    },
    {
        "type": "function_call",
        "namespace": "mcp__docs",
        "name": "search",
        "arguments": '{"query":"csv split"}',
        "call_id": "call_A2",
    },
    {"type": "function_call_output", "call_id": "call_A1", "output": "1 failed, 3 passed"},
    {"type": "function_call_output", "call_id": "call_A2", "output": "str.rsplit splits from the right."},
    {"type": "reasoning", "summary": [], "encrypted_content": None},
    {
        "type": "custom_tool_call",
        "call_id": "call_A3",
        "name": "apply_patch",
        "input": '*** Begin Patch\n*** Update File: a.py\n-x = "é"\n+x = 2\n*** End Patch\n',
    },
    {"type": "custom_tool_call_output", "call_id": "call_A3", "output": "Success. Updated: a.py"},
    {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Fixed: the test passes now."}],
    },
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Commit it."}]},
]

CLAUDE_CODE_SYSTEM = [
    text("x-anthropic-billing-header: cc_version=2.1.328.e3f; cc_entrypoint=sdk-cli; cch=1f2e3;"),
    text("You are Claude Code, Anthropic's official CLI for Claude.", cache_control={"type": "ephemeral"}),
    text(SYSTEM, cache_control={"type": "ephemeral"}),
]
CLAUDE_CODE_TOOLS = [
    {
        "name": "Bash",
        "description": "Executes a given bash command.",
        "input_schema": {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command to execute"},
                "timeout": {"type": "number"},
                "run_in_background": {"type": "boolean"},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
    {
        "name": "Read",
        "description": "Reads a file from the local filesystem.",
        "input_schema": {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "offset": {"type": "number"}},
            "required": ["file_path"],
            "additionalProperties": False,
        },
    },
    {
        "name": "TodoWrite",
        "description": "Update the todo list for the current session.",
        "input_schema": {"properties": {"todos": {"type": "array", "items": {"type": "object"}}}},
        "cache_control": {"type": "ephemeral"},
    },
]
CLAUDE_CODE_FIELDS = {
    # Claude Code asks for 32000; the test engine's context is 4096 tokens, and the prompt does not depend on it.
    "max_tokens": 1024,
    "stream": True,
    "system": CLAUDE_CODE_SYSTEM,
    "tools": CLAUDE_CODE_TOOLS,
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "medium"},
    "metadata": {"user_id": '{"device_id":"d0","account_uuid":"","session_id":"5f0c1e2a-0b7e-4b39"}'},
}

AGENT_CASES = [
    RenderCase(
        "Codex first request: developer and user messages, functions, a namespace, custom and hosted tools",
        RESPONSES,
        {**CODEX_FIELDS, "input": CODEX_FIRST_INPUT},
    ),
    RenderCase(
        "Codex later request: reasoning, namespaced and custom tool calls and their outputs",
        RESPONSES,
        {**CODEX_FIELDS, "input": CODEX_LATER_INPUT},
    ),
    RenderCase(
        "Codex with only hosted tools and a developer message last",
        RESPONSES,
        {
            **CODEX_FIELDS,
            "tools": [{"type": "web_search"}],
            "input": [*CODEX_FIRST_INPUT[1:], CODEX_FIRST_INPUT[0]],
        },
    ),
    RenderCase(
        "Claude Code first request: adaptive thinking, context_management, output_config, cached system",
        MESSAGES,
        {
            **CLAUDE_CODE_FIELDS,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        text("<system-reminder>As you answer, use the todo list.</system-reminder>"),
                        text("Fix the failing test.", cache_control={"type": "ephemeral"}),
                    ],
                }
            ],
        },
    ),
    RenderCase(
        "Claude Code later request: thinking blocks, tool_use and tool_result, an error result",
        MESSAGES,
        {
            **CLAUDE_CODE_FIELDS,
            "messages": [
                {"role": "user", "content": [text("Fix the failing test.")]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "", "signature": "EqQBCkYIBxgCKkA=="},
                        text("I'll run the tests."),
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "Bash",
                            "input": {"command": "pytest -q"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "Exit code 1\n1 failed",
                            "is_error": True,
                        }
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Read the file.", "signature": "sig"},
                        {"type": "redacted_thinking", "data": "opaque=="},
                        {
                            "type": "tool_use",
                            "id": "toolu_2",
                            "name": "Read",
                            "input": {"file_path": "/a.py"},
                        },
                        {
                            "type": "tool_use",
                            "id": "toolu_3",
                            "name": "Read",
                            "input": {"file_path": "/b.py"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_2", "content": [text(FILE)]},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_3",
                            "content": [text("x = 1"), text("y = 2", cache_control={"type": "ephemeral"})],
                        },
                    ],
                },
            ],
        },
    ),
]

AGENT_EDGE_CASES = [
    RenderCase(
        "Claude Code tool search: a deferred tool named in a tool result, tools changed by a system message",
        MESSAGES,
        {
            **CLAUDE_CODE_FIELDS,
            "tools": [
                *CLAUDE_CODE_TOOLS,
                {"name": "ToolSearch", "input_schema": {"type": "object", "properties": {"query": {}}}},
                {"name": "Grep", "input_schema": {"type": "object"}, "defer_loading": True},
            ],
            "messages": [
                {"role": "user", "content": "Find the grep tool."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {"query": "grep"}}
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [
                                text("Found 1 tool."),
                                {"type": "tool_reference", "tool_name": "Grep"},
                            ],
                        }
                    ],
                },
                {
                    "role": "system",
                    "content": [
                        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Grep"}},
                        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "TodoWrite"}},
                    ],
                },
                {"role": "assistant", "content": "Grep is loaded."},
                {"role": "user", "content": "Use it."},
            ],
        },
    ),
    RenderCase(
        "Responses: empty text parts, reasoning with an empty encrypted_content, a custom tool call first",
        RESPONSES,
        {
            "tools": [CODEX_TOOLS[2]],
            "reasoning": {"effort": "low", "summary": "auto"},
            "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "high"},
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "input_text", "text": ""},
                        {"type": "input_text", "text": "b"},
                    ],
                },
                {"type": "custom_tool_call", "call_id": "p1", "name": "apply_patch", "input": "x"},
                {"type": "custom_tool_call_output", "call_id": "p1", "output": "ok"},
                {
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": "done"}],
                    "encrypted_content": "",
                },
            ],
        },
    ),
]

CASES = OPENAI_CASES + ANTHROPIC_CASES + RESPONSES_CASES + EDGE_CASES + AGENT_CASES + AGENT_EDGE_CASES
