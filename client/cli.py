"""Wire-side commands: `tinyloop generate --server`, `tinyloop resume`, `tinyloop info`."""
from __future__ import annotations

import json
import sys

DEFAULT_SERVER = "127.0.0.1:50051"


def _client(args):
    from tinyloop.client import TinyLoopClient
    def read(name):
        path = getattr(args, name, None)
        return open(path, "rb").read() if path else None
    return TinyLoopClient(args.server, caller=getattr(args, "caller", None), token=getattr(args, "token", None),
                          root_certificates=read("tls_ca"), private_key=read("tls_key"),
                          certificate_chain=read("tls_cert"))


def _common(p) -> None:
    p.add_argument("--server", default=DEFAULT_SERVER, help=f"HOST:PORT of `tinyloop serve` (default {DEFAULT_SERVER})")
    p.add_argument("--caller", default=None, help="caller identity (x-tinyloop-caller)")
    p.add_argument("--token", default=None, help="bearer token, when the gateway enforces auth")
    p.add_argument("--tls-ca", default=None, help="PEM file of the CA that signed the gateway's certificate (TLS)")
    p.add_argument("--tls-cert", default=None, help="PEM file of this client's certificate (mutual TLS)")
    p.add_argument("--tls-key", default=None, help="PEM file of this client's private key (mutual TLS)")


def register(sub) -> None:
    r = sub.add_parser("resume", help="build a resume handle at --l-used and resume it at each --new-L (gRPC)")
    _common(r)
    r.add_argument("--prompt", required=True)
    r.add_argument("--l-used", type=int, default=4)
    r.add_argument("--new-L", type=int, nargs="+", default=[8], dest="new_L")
    r.add_argument("--max-loops", type=int, default=None)
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--temperature", type=float, default=None)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--keep", action="store_true", help="do not free the handle (print its id)")
    r.set_defaults(handler=_resume)

    i = sub.add_parser("info", help="the served model and its workers (gRPC ModelInfo)")
    _common(i)
    i.set_defaults(handler=_info)


def _print_stream(stream) -> None:
    for chunk in stream:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    c = stream.complete
    print(f"\n[finish: {c.finish_reason}, {c.usage['completion_tokens']} tokens, worker {c.worker_id}]",
          file=sys.stderr)


def generate_remote(args) -> int:
    """`tinyloop generate --server HOST:PORT ...` (called by tinyloop.worker.cli)."""
    with _client(args) as c:
        sys.stdout.write(args.prompt)
        _print_stream(c.generate(args.prompt, loops=args.loops, max_tokens=args.max_tokens,
                                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                 repetition_penalty=args.repetition_penalty, seed=args.seed,
                                 cache_window=args.cache_window, include_text=True,
                                 kv_mode=args.kv_mode or ""))
    return 0


def _resume(args) -> int:
    with _client(args) as c:
        h = c.build_resume_handle(args.prompt, l_used=args.l_used, max_loops=args.max_loops)
        print(f"[handle {h.handle_id}: {h.seq_len} tokens at L={h.loops_used}, max_loops {h.max_loops}, "
              f"{h.nbytes} bytes on {h.worker_id}]", file=sys.stderr)
        try:
            for L in args.new_L:
                print(f"--- new_L={L}", file=sys.stderr)
                sys.stdout.write(args.prompt)
                _print_stream(c.resume(h.handle_id, L, max_tokens=args.max_tokens, temperature=args.temperature,
                                       seed=args.seed, include_text=True))
        finally:
            if not args.keep:
                c.free_handle(h.handle_id)
    if args.keep:
        print(h.handle_id)
    return 0


def _info(args) -> int:
    with _client(args) as c:
        print(json.dumps(c.model_info(), indent=2))
    return 0
