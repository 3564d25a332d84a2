"""Tools, parsers, generate functions and agents the agent tests load by path (tool workers and
the run import them by `module:function`)."""

from __future__ import annotations

import os
import time

from miles.agents.tool_calls import ToolCall
from miles.data.sample import Sample


def echo(text: str) -> str:
    """Return the text as given.

    Args:
        text: what to return
    """
    return text


def suffix(word: str) -> str:
    """Return a word ending that tokenizes differently alone than after the text before it.

    Args:
        word: ignored
    """
    return "ing ing"


def boom(x: int) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise ValueError(f"boom {x}")


def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def hog(gigabytes: int) -> str:
    """Allocate memory.

    Args:
        gigabytes: how much
    """
    block = bytearray(gigabytes * 1024**3)
    return str(len(block))


def big_file(megabytes: int) -> str:
    """Write a file.

    Args:
        megabytes: its size
    """
    with open("out.bin", "wb") as f:
        f.write(b"x" * (megabytes * 1024**2))
    return "written"


def environment(name: str) -> str:
    """Read an environment variable and the working directory.

    Args:
        name: the variable
    """
    return f"{os.environ.get(name)}|{os.getcwd()}"


def always_suffix(text: str) -> list:
    """A parser that calls `suffix` at every turn: the conversations go on to the turn limit."""
    return [ToolCall("suffix", {"word": "x"})]


def two_calls(sample: Sample, client, params) -> Sample:
    """A custom generate function: a first answer, then a second request continuing it."""
    tok = client.tokenizer
    prompt = tok(str(sample.prompt), add_special_tokens=False).input_ids
    first = client.generate(prompt, params)
    middle = tok("\nagain:", add_special_tokens=False).input_ids
    second = client.generate(first.tokens + middle, params)
    sample.tokens = second.tokens
    sample.response_length = len(second.tokens) - len(prompt)
    sample.loss_mask = [1] * first.response_length + [0] * len(middle) + [1] * second.response_length
    sample.rollout_log_probs = first.rollout_log_probs + [0.0] * len(middle) + second.rollout_log_probs
    sample.rollout_routed_experts = second.rollout_routed_experts  # MoE: every token fed, for --use-r3
    sample.response = tok.decode(second.response_tokens, skip_special_tokens=True)
    return sample


def bad_generate(sample: Sample, client, params) -> Sample:
    """Returns a sample without log-probs: a contract error."""
    out = client.generate([1, 2, 3], params)
    out.rollout_log_probs = None
    return out


def flaky_generate(sample: Sample, client, params) -> Sample:
    """Raises for subtraction prompts, else `two_calls`."""
    if "-" in str(sample.prompt):
        raise RuntimeError("flaky")
    return two_calls(sample, client, params)


SEEN: list[dict] = []  # every response the openai client got, for the test to compare


def openai_agent(base_url: str, sample: Sample):
    """A two-turn agent on the standard openai client: asks, sends a tool result back, asks again."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": str(sample.prompt)}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=1.0)
    SEEN.append(first.model_dump())
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "content": "calculator says 408"})
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=1.0)
    SEEN.append(second.model_dump())
    return second.choices[0].message.content


def always_calculator(text: str) -> list:
    """A parser that calls the calculator at every turn (a random policy writes no calls)."""
    return [ToolCall("calculator", {"expression": "12 * 34"})]


def unknown_calls(text: str) -> list:
    """A parser that reads a call to a tool nobody has at every turn: a tool-error storm."""
    return [ToolCall("search", {"query": "x"})]


def calls_half_the_time(text: str) -> list:
    """A parser that reads a calculator call in about half the turns (by a hash of the text)."""
    import zlib

    return [ToolCall("calculator", {"expression": "2 + 2"})] if zlib.crc32(text.encode()) % 2 else []


def forking_agent(base_url: str, sample: Sample):
    """Asks once, continues that reply two ways (a fork), then asks again with its history rewritten."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": str(sample.prompt)}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    history = [*messages, first.choices[0].message.model_dump(exclude_none=True)]
    for follow in ("left", "right"):
        client.chat.completions.create(
            model="policy", messages=[*history, {"role": "user", "content": follow}], max_tokens=4
        )
    rewritten = [{"role": "user", "content": "something else"}]
    client.chat.completions.create(model="policy", messages=rewritten, max_tokens=4)
    return 0.5


def look_twice(sample: Sample, client, params) -> Sample:
    """Two turns with an image each: the prompt's, then an observation that shows another image
    (kept: the second request carries both images' pixels)."""
    from miles.data.images import join_images, shapes_image

    first = client.generate(sample.tokens, params, images=sample.multimodal_train_inputs)
    more, seen = client.process("<image>And here?", [shapes_image(2, __import__("random").Random(7))])
    images = join_images(sample.multimodal_train_inputs, seen)
    second = client.generate(first.tokens + more, params, images=images)
    prompt = len(sample.tokens)
    sample.tokens, sample.response_length = second.tokens, len(second.tokens) - prompt
    sample.loss_mask = [1] * first.response_length + [0] * len(more) + [1] * second.response_length
    sample.rollout_log_probs = first.rollout_log_probs + [0.0] * len(more) + second.rollout_log_probs
    sample.multimodal_train_inputs = images
    sample.response = client.tokenizer.decode(second.response_tokens, skip_special_tokens=True)
    return sample


def forget_images(sample: Sample, client, params) -> Sample:
    """slime's bug: the second turn re-renders the question as text, without its image: the
    model answers it blind (no error: no image token is left to check)."""
    first = client.generate(sample.tokens, params, images=sample.multimodal_train_inputs)
    text = client.tokenizer("How many squares? Again:", add_special_tokens=False).input_ids
    second = client.generate(text, params)
    sample.tokens = list(sample.tokens) + first.response_tokens + second.response_tokens
    sample.response_length = first.response_length + second.response_length
    sample.loss_mask = [1] * sample.response_length
    sample.rollout_log_probs = first.rollout_log_probs + second.rollout_log_probs
    return sample
