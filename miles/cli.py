"""The `miles` command: one sub-command per job (see `miles --help`)."""

from __future__ import annotations

import argparse
import sys

from miles.errors import MilesError


def cmd_generate(args: argparse.Namespace) -> int:
    from miles.models import registry
    from miles.rollout import Engine, Request, SamplingParams

    model, tokenizer = registry.load(args.model)
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(prompt_ids, "input_ids") or isinstance(prompt_ids, dict):
            prompt_ids = prompt_ids["input_ids"]
    else:
        prompt_ids = tokenizer(args.prompt).input_ids
    engine = Engine(model, tokenizer, max_batch_size=1, max_seq_len=len(prompt_ids) + args.max_new_tokens + 1)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
    sample = engine.generate([Request(list(prompt_ids), params)])[0]
    print(sample.response if args.chat else args.prompt + sample.response)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import time

    from miles.models import registry
    from miles.rollout.engine import Engine
    from miles.rollout.server import EngineServer

    model, tokenizer = registry.load(args.model)
    engine = Engine(
        model, tokenizer, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, seed=args.seed
    )
    server = EngineServer(engine, host=args.host, port=args.port, model_path=args.model).start()
    print(
        f"miles serve: {args.model} on {server.url} (POST /generate, GET /health); Ctrl-C stops", flush=True
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles",
        description="miles: RL post-training for LLMs (GRPO/PPO with verifiable rewards), CPU to GPU cluster.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="continue a prompt with the rollout engine",
        description="Print the continuation of --prompt by --model (greedy unless --temperature > 0).",
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
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser(
        "serve",
        help="serve the rollout engine over HTTP (SGLang-compatible /generate)",
        description="Run the rollout engine behind HTTP: POST /generate (text or input_ids, sampling_params, "
        "return_logprob, return_routed_experts), GET /health, POST /flush_cache, GET /get_model_info, "
        "POST /update_weights_from_disk. See docs/rollout.md.",
    )
    serve.add_argument(
        "--model", default="tiny", help="checkpoint directory, .gguf file, or tiny / tiny-random / smollm2"
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=int, default=30000, help="port (default 30000, SGLang's)")
    serve.add_argument(
        "--max-batch-size", type=int, default=64, help="requests decoded together (KV-cache slots)"
    )
    serve.add_argument("--max-seq-len", type=int, default=2048, help="prompt + response tokens per request")
    serve.add_argument("--seed", type=int, default=0, help="engine seed; a request's own seed overrides it")
    serve.set_defaults(func=cmd_serve)
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
