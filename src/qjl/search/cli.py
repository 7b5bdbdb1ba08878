"""``qjl search-data`` and ``qjl search-bench``: argument parsers and entry points for the main CLI.

Wire them into :mod:`qjl.cli` (or ``qjl.tools.cli``) with::

    from .search.cli import add_search_commands
    add_search_commands(subparsers)        # registers both subcommands; each sets args.func

or run them directly: ``python -m qjl.search.cli search-bench --n 200000``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

__all__ = ["add_search_commands", "main"]


def _data(args) -> int:
    from .corpus import CorpusConfig
    from .data import build_dataset

    out = build_dataset(n=args.n, queries=args.queries, name=args.name, seed=args.seed,
                        config=CorpusConfig(), progress=not args.quiet, max_length=args.max_length)
    print(f"data set ready: {out}")
    return 0


def _bench(args) -> int:
    from .bench import BenchConfig, format_bars, format_results, run_search_bench

    cfg = BenchConfig(n=args.n, queries=args.queries, speed_queries=args.speed_queries, repeats=args.repeats,
                      bits=tuple(args.bits), ours=tuple(args.ours), regimes=tuple(args.regimes), nlist=args.nlist,
                      nprobe=args.nprobe, peers=not args.no_peers, dataset=args.dataset, only=tuple(args.only))
    out = Path(args.out) / time.strftime("search-bench-%Y%m%d-%H%M%S")
    result = run_search_bench(cfg, out, progress=not args.quiet)
    print(format_results(result))
    print(format_bars(result))
    if result["skipped_missing_packages"]:
        print(f"skipped (not installed): {', '.join(result['skipped_missing_packages'])}: pip install 'qjl[search]'")
    print(f"{result['seconds']:.0f} s; wrote {out}/results.json, table.txt, recall10.png")
    return 0


def add_search_commands(subparsers) -> None:
    """Register ``search-data`` and ``search-bench`` on an argparse subparsers object."""
    d = subparsers.add_parser("search-data", help="build the embedded passage corpus (cached, resumable)")
    d.add_argument("--n", type=int, default=200_000, help="corpus passages (default 200000)")
    d.add_argument("--queries", type=int, default=1000, help="held-out query passages (default 1000)")
    d.add_argument("--name", default="minilm-200k", help="data set name under $QJL_CACHE_DIR/search/")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--max-length", type=int, default=64, help="tokens kept per passage (default 64)")
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(func=_data)
    b = subparsers.add_parser("search-bench", help="recall / bits / speed of our index against faiss and rabitqlib")
    b.add_argument("--n", type=int, default=None, help="corpus vectors (default: the whole data set)")
    b.add_argument("--queries", type=int, default=1000)
    b.add_argument("--speed-queries", type=int, default=200)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--bits", type=int, nargs="+", default=[1, 2, 3, 4])
    b.add_argument("--ours", nargs="+", default=["tq-mse", "tq-mse-rn", "tq-mse-rn+c", "tq-mse-rn+ck", "tq-prod", "qjl"],
                   help="our codecs; '+c' centers on the first batch's mean, '+h' uses the padded Hadamard rotation, "
                        "'+k' the unpadded one of order dim")
    b.add_argument("--regimes", nargs="+", default=["flat", "ivf"], choices=["flat", "ivf"])
    b.add_argument("--nlist", type=int, default=1024)
    b.add_argument("--nprobe", type=int, default=32)
    b.add_argument("--no-peers", action="store_true", help="only our codecs")
    b.add_argument("--only", nargs="*", default=[], help="run only methods whose label contains one of these")
    b.add_argument("--dataset", default="minilm-200k", help="data set name, or 'synthetic' for a dry run")
    b.add_argument("--out", default="runs", help="parent of the run directory")
    b.add_argument("--quiet", action="store_true")
    b.set_defaults(func=_bench)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qjl.search.cli")
    add_search_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
