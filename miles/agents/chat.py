"""Chat-template text for agent turns, rendered once and tokenized only where it is new.

The policy's own tokens are never decoded and encoded again (the same text can tokenize
differently alone and in context: re-tokenization drift). What is appended after a turn is the
template's own text between the end of that assistant message and the next generation prompt,
found by rendering the conversation with a sentinel in place of the assistant's content.
"""

from __future__ import annotations

from collections.abc import Sequence

SENTINEL = "\u2063MILES-TURN\u2063"  # never in a real message


def supports_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def tool_instructions(schemas: Sequence[dict]) -> str:
    """The system text describing the tools, for templates without tool support (those with it
    render `tools=` their own way): one line per tool and the call format, kept short because
    small models have small contexts."""
    lines = []
    for schema in schemas:
        f = schema["function"]
        params = f.get("parameters", {}).get("properties", {})
        signature = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in params.items())
        lines.append(f"- {f['name']}({signature}): {f.get('description', '')}".rstrip(": "))
    return (
        "Tools:\n" + "\n".join(lines) + "\n"
        'Call one as <tool_call>{"name": "...", "arguments": {...}}</tool_call>; the result comes back as a message.'
    )


def render(tokenizer, messages: list[dict], tools: Sequence[dict] | None, generation_prompt: bool) -> str:
    """The template's text for `messages` (tools passed to templates that take them, described in
    the system message for those that do not)."""
    if tools and not supports_tools(tokenizer):
        messages = with_tool_system(messages, tools)
    kwargs = {"tools": list(tools)} if tools and supports_tools(tokenizer) else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
    )


def with_tool_system(messages: list[dict], tools: Sequence[dict]) -> list[dict]:
    text = tool_instructions(tools)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def as_messages(prompt) -> list[dict]:
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def prompt_ids(tokenizer, prompt, tools: Sequence[dict] | None) -> list[int]:
    """A conversation's first prompt: the task's messages with the tools, and the generation prompt."""
    return encode(tokenizer, render(tokenizer, as_messages(prompt), tools, generation_prompt=True))


def bridge(
    tokenizer, before: list[dict], after: list[dict], tools: Sequence[dict] | None, generated_tail: str
) -> str:
    """The text the template puts after an assistant message that followed `before`: its closing,
    the `after` messages (tool results, the user's next turn) and the next generation prompt.
    `generated_tail`: the text of the policy's last token, dropped from the front when the
    template's closing starts with it (the EOS the policy generated)."""
    messages = [*before, {"role": "assistant", "content": SENTINEL}, *after]
    text = render(tokenizer, messages, tools, generation_prompt=True)
    cut = text.rfind(SENTINEL)
    if cut < 0:
        raise ValueError("the chat template does not render an assistant message's content as given")
    rest = text[cut + len(SENTINEL) :]
    if generated_tail and rest.startswith(generated_tail):
        rest = rest[len(generated_tail) :]
    return rest
