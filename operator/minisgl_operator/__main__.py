"""`python -m minisgl_operator [--namespace NS | --all-namespaces] [--liveness URL]`."""

from __future__ import annotations

import argparse
import logging

import kopf

import minisgl_operator.handlers  # noqa: F401  (registers the handlers)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m minisgl_operator", description=__doc__)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    where.add_argument("--all-namespaces", action="store_true", help="watch every namespace (the default)")
    p.add_argument("--liveness", help="serve kopf's health check here, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    kopf.configure(verbose=args.verbose)
    if not args.verbose:  # one "handler succeeded" line per watch event is noise; failures still show
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness)


if __name__ == "__main__":
    main()
