"""The `capsulert` command line.

    capsulert demo [ARGS...]                              the main job on the embedded default model
    capsulert serve [--model M] [--port P] [--keys F] ... an OpenAI-compatible HTTP server (Ray Serve)
    capsulert capsules ls DIR [--namespace NS] [--json]   list the capsule files in DIR (headers only)
    capsulert capsules rm DIR NAME [--namespace NS]       delete one capsule file
    capsulert bench [NAME [ARGS...]]                      run bench/<name>.py (from a repository checkout)
    capsulert --version                                   the installed version

`demo` and `bench` pass ARGS through untouched (`capsulert demo --help` shows the demo's own options).
Exit status: 0 on success, 1 when capsulert refuses (a typed error from capsulert.errors, printed as one
line, never a traceback), 2 on a usage error. Heavy imports (torch) wait until a command needs them, so
`capsulert --help` answers at once.
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from capsulert.errors import CapsuleRTError, InvalidRequestError
from capsulert.protocol.names import DEFAULT_NAMESPACE

PROG = "capsulert"
PASSTHROUGH = ("demo", "bench")  # commands whose remaining arguments belong to the script they run


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="capsulert: a latency-first session runtime for hybrid LLMs.",
                                 epilog="commands:\n" + __doc__.split("\n\n")[1] if __doc__ else None)
    ap.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # add_help=False: `--help` after these commands is passed to the script they run
    sub.add_parser("demo", add_help=False, help="run the demo (the main job) on the embedded default model")
    bench = sub.add_parser("bench", add_help=False, help="run a benchmark of bench/ (repository checkout only)")
    bench.add_argument("name", nargs="?", help="benchmark to run; without it, list them")

    _add_serve(sub)

    caps = sub.add_parser("capsules", help="inspect or delete disk capsules without starting an engine")
    verbs = caps.add_subparsers(dest="verb", required=True, metavar="VERB")
    ls = verbs.add_parser("ls", help="list the capsules in a directory of capsule files")
    ls.add_argument("dir", type=Path, help="a disk_dir, a store.save() directory or a worker's pinned/")
    ls.add_argument("--namespace", help="only this namespace (default: all)")
    ls.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    rm = verbs.add_parser("rm", help="delete one capsule file (refused in a directory a live engine or orchestrator owns)")
    rm.add_argument("dir", type=Path)
    rm.add_argument("name", help="capsule name (a name, never a path)")
    rm.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="namespace of the capsule (default: %(default)s)")
    rm.add_argument("--force", action="store_true",
                    help="delete the capsule's file even if its header does not verify (a damaged file)")
    return ap


def _version() -> str:
    import capsulert

    return capsulert.__version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if rest and args.command not in PASSTHROUGH:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "demo":
            return _demo(rest)
        if args.command == "bench":
            return _bench(args.name, rest)
        if args.command == "serve":
            return _serve(args)
        if args.verb == "ls":
            return _ls(args.dir, args.namespace, args.json)
        return _rm(args.dir, args.name, args.namespace, args.force)
    except CapsuleRTError as e:
        print(f"{PROG}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------------------------- demo
@contextmanager
def _prog_name(name: str) -> Iterator[None]:
    """argparse names a program after sys.argv[0]; make the demo's usage read `capsulert demo`."""
    saved = sys.argv[0] if sys.argv else ""
    if not sys.argv:
        sys.argv.append(saved)
    sys.argv[0] = name
    try:
        yield
    finally:
        sys.argv[0] = saved


def _demo(args: list[str]) -> int:
    from capsulert import demo

    with _prog_name(f"{PROG} demo"):
        return demo.main(args)


# ----------------------------------------------------------------------------------------------- serve
def _add_serve(sub) -> None:
    sv = sub.add_parser("serve", help="serve the OpenAI API (completions, chat, capsules) over HTTP with Ray Serve",
                        description="An OpenAI-compatible HTTP server in front of the orchestrator; blocks until "
                                    "Ctrl-C. See docs/guide.md, 'The HTTP server'.")
    sv.add_argument("--model", default="default",
                    help="'default' (the embedded model), an HF checkpoint directory or random:<shape YAML>")
    sv.add_argument("--served-model-name", help="the model id clients send (default: from --model)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, loopback only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--keys", help="YAML file mapping API keys to namespaces (default: no auth, one namespace)")
    sv.add_argument("--num-workers", type=int, default=1, help="engine workers (one per GPU)")
    sv.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    sv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    sv.add_argument("--slots", type=int, default=32, help="sessions per worker (default: %(default)s)")
    sv.add_argument("--max-seq", type=int, default=4096, help="tokens per session (default: %(default)s)")
    sv.add_argument("--prefill-chunk", type=int, default=256)
    sv.add_argument("--disk-dir", help="capsule disk tier; pinned capsules persist there across restarts")
    sv.add_argument("--cache-dir", help="where the default model is generated (default ~/.cache/capsulert)")
    sv.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                    help="turn off automatic exact prefix reuse (on by default: a request whose prompt starts like "
                         "an earlier one of its namespace skips the prefill of the shared grid prefix)")
    sv.add_argument("--prefix-cache-mb", type=int, default=2048,
                    help="MiB the prefix cache's entries may hold alone (default: %(default)s)")
    sv.add_argument("--slot-wait", type=float, default=60.0,
                    help="seconds a session may wait at a worker for a free slot (a backstop: requests queue for "
                         "their sessions in the admission queue first; default: %(default)s)")
    sv.add_argument("--max-inflight", type=int, default=256,
                    help="generation requests in flight, running or queued for sessions; more are refused with 429 "
                         "and Retry-After (default: %(default)s)")
    sv.add_argument("--max-n", type=int, help="largest n per request (default: --slots)")
    sv.add_argument("--max-tokens", type=int,
                    help="tokens a reply may generate: the default of a chat request that gives none, and the most "
                         "any request may ask for (default: 1024); a reply also ends where it reaches --max-seq")
    sv.add_argument("--max-body-mb", type=float, default=8.0,
                    help="largest request body in MB; a larger one is refused with 413 (default: %(default)s)")
    sv.add_argument("--capsule-quota", type=int, default=1000,
                    help="capsules per tenant; a request past it is refused with 403 (default: %(default)s; -1: none)")
    sv.add_argument("--capsule-quota-mb", type=int, default=-1,
                    help="MB of capsules per tenant (default: -1, none)")
    for flag, default in (("device", "4096"), ("host", "16384"), ("disk", "65536")):  # config/server.py's
        sv.add_argument(f"--{flag}-budget-mb", type=int,
                        help=f"capsule budget of the {flag} tier in MB, per worker (default: {default}; 0: tier off; "
                             "-1: unlimited)")
    sv.add_argument("--torch-threads", type=int, help="torch threads per worker")
    sv.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    sv.add_argument("--ray-metrics-port", type=int,
                    help="also export Ray's and Ray Serve's own metrics from Ray's metrics agent on this port (off by "
                         "default; capsulert's metrics are at GET /metrics on --host:--port either way)")
    sv.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sv.add_argument("--access-log", action="store_true", help="log every HTTP request")
    sv.add_argument("--serve-proxy", action="store_true",
                    help="listen through Ray Serve's HTTP proxy instead of the replica's own HTTP server (one more "
                         "process and Ray round trip per request; for setups built around Serve's proxy)")


def _unless_negative(value: int, shift: int = 0) -> int | None:
    """A flag's value (times 2**shift: MB to bytes), None (no limit) for a negative one."""
    return None if value < 0 else value << shift


def _serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import jinja2  # noqa: F401
        import ray.serve  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        from capsulert.errors import ConfigError

        raise ConfigError(f"`capsulert serve` needs the serve extra ({e.name} is not installed): "
                          "pip install 'capsulert[serve]'") from None
    from capsulert.config.server import SERVER_TIER_BUDGETS_MB, ServerOptions
    from capsulert.serve.runner import serve_forever

    budgets_mb = {t: getattr(args, f"{f}_budget_mb") for t, f in (("device", "device"), ("host", "host"), ("disk", "disk"))}
    budgets_mb = {t: SERVER_TIER_BUDGETS_MB[t] if mb is None else mb for t, mb in budgets_mb.items()}

    engine = dict(model=args.model, device=args.device, dtype=args.dtype, slots=args.slots, max_seq=args.max_seq,
                  prefill_chunk=args.prefill_chunk, disk_dir=args.disk_dir, cache_dir=args.cache_dir,
                  slot_wait_s=args.slot_wait, prefix_cache=args.prefix_cache,
                  prefix_cache_bytes=args.prefix_cache_mb << 20,
                  capsule_budgets={t: _unless_negative(mb, 20) for t, mb in budgets_mb.items()})
    orchestrator = dict(engine=engine, num_workers=args.num_workers, torch_threads=args.torch_threads,
                        max_queued=args.max_inflight, address=args.ray_address)
    opts = ServerOptions.build(
        orchestrator=orchestrator, served_model_name=args.served_model_name, host=args.host, port=args.port,
        keys_file=args.keys, max_n=args.max_n, ray_metrics_port=args.ray_metrics_port, log_level=args.log_level,
        access_log=args.access_log, direct_ingress=not args.serve_proxy, max_body_mb=args.max_body_mb,
        capsule_quota=_unless_negative(args.capsule_quota), capsule_quota_mb=_unless_negative(args.capsule_quota_mb),
        **({} if args.max_tokens is None else {"max_tokens": args.max_tokens}))
    return serve_forever(opts)


# -------------------------------------------------------------------------------------------- capsules
def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ls(directory: Path, namespace: str | None, as_json: bool) -> int:
    from capsulert.capsule_store.format.inspect import scan

    found, skipped = scan(directory, namespace)
    if as_json:
        print(json.dumps({"directory": str(directory), "capsules": [c.to_dict() for c in found],
                          "skipped": [{"file": s.path.name, "reason": s.reason, "partial": s.partial}
                                      for s in skipped]}, indent=2))
    elif found:
        rows = [("NAMESPACE", "NAME", "TOKENS", "TIER", "SIZE", "CREATED", "MODEL FINGERPRINT")]
        rows += [(c.namespace, c.name, str(c.tokens), c.tier, _size(c.file_bytes),
                  time.strftime("%Y-%m-%d %H:%M", time.localtime(c.created_at)), c.fingerprint) for c in found]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            print("  ".join(v.rjust(w) if i == 2 else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
                  + "  " + r[-1])
    else:
        print(f"no capsules in {directory}" + (f" in namespace {namespace!r}" if namespace else ""))
    for s in skipped:
        print(f"{PROG}: skipped {s.path.name}: {s.reason}", file=sys.stderr)
    # temp files are writes in progress or routine leftovers of a crash; a file that fails to verify is not
    return 1 if any(not s.partial for s in skipped) else 0


def _rm(directory: Path, name: str, namespace: str, force: bool) -> int:
    from capsulert.capsule_store.format.inspect import delete
    from capsulert.errors import CorruptCapsuleError

    try:
        path = delete(directory, name, namespace, force=force)
    except CorruptCapsuleError as e:
        raise CorruptCapsuleError(f"{e}; nothing deleted (--force deletes the damaged file)") from None
    print(f"deleted capsule {namespace}/{name} ({path.name}) from {directory}")
    return 0


# ----------------------------------------------------------------------------------------------- bench
def find_checkout() -> Path | None:
    """The repository checkout whose bench/ to run: the one this package runs from (an editable install,
    or `python -m` inside it), else the current directory or one above it."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd(), *Path.cwd().parents):
        if (root / "bench").is_dir() and (root / "capsulert" / "__init__.py").is_file() \
                and (root / "pyproject.toml").is_file():
            return root
    return None


def benchmarks(root: Path) -> dict[str, Path]:
    """bench/*.py scripts by name; helper modules (common.py) are not scripts: no __main__ guard."""
    return {p.stem: p for p in sorted((root / "bench").glob("*.py"))
            if '__name__ == "__main__"' in p.read_text(encoding="utf-8")}


def _summary(path: Path, width: int = 90) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    line = " ".join(doc.split("\n\n")[0].split())
    return line if len(line) <= width else line[:width - 3].rstrip() + "..."



def _bench(name: str | None, args: list[str]) -> int:
    root = find_checkout()
    if root is None:
        raise InvalidRequestError(
            "`capsulert bench` runs the scripts in bench/ of a capsulert repository checkout, which an "
            "installed package does not ship; run it inside a checkout (or from an editable install)")
    scripts = benchmarks(root)
    if name is None:
        print(f"usage: {PROG} bench NAME [ARGS...]   (NAME --help shows a benchmark's options)\n\n"
              f"benchmarks in {root / 'bench'}:")
        for n, p in scripts.items():
            print(f"  {n:<16}{_summary(p)}")
        return 0
    if name not in scripts:  # also keeps NAME from being a path
        raise InvalidRequestError(f"unknown benchmark {name!r}; benchmarks: {', '.join(scripts)}")
    try:
        return subprocess.call([sys.executable, str(scripts[name]), *args])
    except KeyboardInterrupt:  # the script got the same Ctrl-C and stops itself
        return 130


if __name__ == "__main__":
    sys.exit(main())
