"""`python -m minisgl --model PATH_OR_ID`: serve a model (see --help)."""

import sys

from minisgl.server.args import parse_args


def main() -> int:
    args = parse_args()
    if args.shell:
        from minisgl.server.shell import run_shell

        return run_shell(args)
    from minisgl.server.launch import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
