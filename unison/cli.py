"""Command line: `unison generate ...` (and, as they land, `serve` and `bench`)."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from unison import Engine

    engine_opts = {"model_path": args.model_path}
    if args.num_threads:
        engine_opts["num_threads"] = args.num_threads
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.seed is not None:
        params["sampling_seed"] = args.seed
    with Engine(**engine_opts) as engine:
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        if not args.stream:
            print(engine.generate(prompt, params)["text"])
            return 0
        shown = 0
        for chunk in engine.generate(prompt, params, stream=True):
            sys.stdout.write(chunk["text"][shown:])
            sys.stdout.flush()
            shown = len(chunk["text"])
        sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unison", description="Unison LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--model-path", default=None, help="HF directory or GGUF file (default: embedded)")
    gen.add_argument("--num-threads", type=int, default=None)
    gen.set_defaults(func=_generate)
    bench = sub.add_parser("bench", help="benchmarks (figures, beside a baseline)")
    from unison.bench.offline import add_parser as add_offline

    add_offline(bench.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ConnectionRefusedError) as e:
        print(f"unison: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
