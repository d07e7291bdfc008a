"""`python -m minisgl --model PATH_OR_ID`: serve a model (see --help)."""

import sys

from minisgl.server.args import parse_args


def main() -> int:
    args = parse_args()
    from minisgl.models.loader import ModelLoadError

    try:
        if args.shell:
            from minisgl.server.shell import run_shell

            return run_shell(args)
        from minisgl.server.launch import serve

        return serve(args)
    except ModelLoadError as exc:  # a wrong --model: its reason in one line (the operator reports it), no traceback
        print(f"minisgl: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
