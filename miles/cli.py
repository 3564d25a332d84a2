"""The `miles` command: one sub-command per job (see `miles --help`)."""

from __future__ import annotations

import argparse
import sys

from miles.errors import MilesError


def cmd_generate(args: argparse.Namespace) -> int:
    from miles.models import registry
    from miles.models.generate import greedy

    model, tokenizer = registry.load(args.model)
    model.eval()
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(prompt_ids, "input_ids") or isinstance(prompt_ids, dict):
            prompt_ids = prompt_ids["input_ids"]
    else:
        prompt_ids = tokenizer(args.prompt).input_ids
    stop = model.config.eos_token_ids + (
        [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    )
    new = greedy(model, list(prompt_ids), args.max_new_tokens, stop_ids=stop)
    text = tokenizer.decode(new, skip_special_tokens=True)
    print(text if args.chat else args.prompt + text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles",
        description="miles: RL post-training for LLMs (GRPO/PPO with verifiable rewards), CPU to GPU cluster.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="greedy continuation of a prompt",
        description="Print the greedy continuation of --prompt by --model (KV-cache decoding).",
    )
    gen.add_argument(
        "--model",
        default="tiny",
        help="Hugging Face checkpoint directory, .gguf file, or a name: tiny, tiny-random, smollm2 (default: tiny)",
    )
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument(
        "--max-new-tokens", type=int, default=32, help="stop after this many new tokens (default: 32)"
    )
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn"
    )
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except MilesError as e:
        print(f"miles {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
