"""`specdec serve BUNDLE`: the OpenAI-compatible server, on this machine or as Ray Serve replicas."""
from __future__ import annotations

import argparse
import sys

from specdec.native_record import ACTIVATIONS, ACTIVATIONS_HELP
from specdec.runtime.config import AUTO_BACKEND, BACKEND_CHOICES
from specdec.serving.options import API_KEY_ENV, SPECULATION, ServeOptions, Speculation, check_replicas


def add_serve_parser(commands) -> None:
    parser = commands.add_parser("serve", help="serve a bundle over an OpenAI-compatible HTTP API")
    parser.add_argument("bundle")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=None,
                        help="rows decoded together (default and limit: the bundle's max_batch)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait for a row; more get 429 (default 64; at most 65536, and with "
                             "--max-body-bytes within this machine's memory)")
    parser.add_argument("--api-key", default=None,
                        help=f"required bearer key (default: ${API_KEY_ENV}; the variable keeps it out of `ps`)")
    parser.add_argument("--model-name", default=None, help="the model id clients send (default: the bundle's name)")
    parser.add_argument("--speculation", choices=SPECULATION, default=Speculation.ADAPTIVE,
                        help="adaptive: γ per round from measured goodput (default); fixed: the bundle's γ; off: γ = 0")
    parser.add_argument("--gamma", type=int, default=None,
                        help="γ of --speculation fixed (default: the bundle's; at most its gamma_max)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20,
                        help="request body cap (default 1 MiB); times --max-connections, within this machine's memory")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads per model call (default: every core; at most 4 per core)")
    _add_connection_args(parser)
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default=AUTO_BACKEND,
                        help="auto (default): cuda on a GPU, else native where it opens, else onnxruntime; native / "
                             "cuda: specdec's own CPU / GPU kernels over the bundle's native weights; onnxruntime: "
                             "every bundle")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda:N (default: cuda:0 for --backend cuda; with auto, a GPU where CuPy sees one)")
    parser.add_argument("--activations", choices=ACTIVATIONS, default=None, help=ACTIVATIONS_HELP)
    parser.add_argument("--no-verify", action="store_true", help="skip checking the bundle's file hashes")
    parser.add_argument("--no-prefix-reuse", action="store_true",
                        help="prefill every prompt whole; by default a request skips the prefix whose K/V its slot "
                             "kept from the previous request (a chat template's system prompt, earlier turns), on "
                             "backends whose K/V of a position do not depend on how the prompt was fed (native)")
    _add_ray_args(parser)
    parser.set_defaults(run=run_serve)


def _add_ray_args(parser) -> None:
    ray = parser.add_argument_group("scale-out on Ray Serve (the [ray] extra)")
    ray.add_argument("--ray", action="store_true", help="deploy as Ray Serve replicas behind Ray's HTTP proxy")
    ray.add_argument("--replicas", type=int, default=2,
                     help="replicas (default 2); on a local instance, times --cpus-per-replica at most the cores this "
                          "process may use")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves per replica (default 1)")
    ray.add_argument("--ray-address", default=None,
                     help="an existing cluster ('auto' on one of its nodes); default: start a local Ray instance")


def _add_connection_args(parser) -> None:
    group = parser.add_argument_group("connections")
    group.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a connection may take to send a request's headers (default 10, at most 3600)")
    group.add_argument("--body-timeout", type=float, default=30.0,
                       help="seconds a request's body may take to arrive after its headers (default 30, at most 3600)")
    group.add_argument("--keep-alive", type=int, default=5,
                       help="seconds an idle connection stays open (default 5, at most 3600)")
    group.add_argument("--max-connections", type=int, default=1000,
                       help="open connections at once (default 1000, fewer where the open-file limit is lower; times "
                            "--max-body-bytes within this machine's memory); at the cap the oldest connection that has "
                            "not sent a request makes way for a new one")
    group.add_argument("--drain-timeout", type=float, default=5.0,
                       help="on SIGTERM, seconds running requests may go on before they end with an error (default 5, "
                            "at most 3600)")
    prompts = parser.add_argument_group("prompt workers (processes that render chat templates and tokenize long "
                                        "prompts, each prompt on a budget)")
    prompts.add_argument("--prompt-workers", type=int, default=2,
                         help="worker processes (default 2; at most 4 per core, and times --prompt-worker-memory "
                              "within this machine's memory)")
    add_prompt_budget_args(prompts, "past it the request gets a 500 and the worker is replaced")


def add_prompt_budget_args(group, past: str) -> None:
    """--prompt-timeout and --prompt-worker-memory: the budget of one chat prompt's rendering (serve, generate)."""
    group.add_argument("--prompt-timeout", type=float, default=2.0,
                       help=f"seconds one prompt may take to render and tokenize; {past} (default 2, at most 3600)")
    group.add_argument("--prompt-worker-memory", type=int, default=1024, metavar="MB",
                       help="data memory of a prompt worker, its tokenizer included (default 1024; at least 256, at "
                            "most this machine's memory)")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(bundle=args.bundle, host=args.host, port=args.port, max_batch=args.max_batch,
                        max_queue=args.max_queue, api_key=args.api_key, model_name=args.model_name,
                        speculation=args.speculation, gamma=args.gamma, max_body_bytes=args.max_body_bytes,
                        threads=args.threads, verify_files=not args.no_verify, backend=args.backend, device=args.device,
                        activations=args.activations,
                        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                        keep_alive_s=args.keep_alive,
                        max_connections=args.max_connections, drain_s=args.drain_timeout,
                        reuse_prefix=not args.no_prefix_reuse, prompt_workers=args.prompt_workers,
                        prompt_timeout_s=args.prompt_timeout, prompt_memory_mb=args.prompt_worker_memory)


def run_serve(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    if args.ray:
        return _run_ray(options, args)
    from specdec.serving.server import serve

    print(f"specdec: serving {options.bundle} on http://{options.host}:{options.port}/v1", file=sys.stderr)
    serve(options)
    return 0


def _run_ray(options: ServeOptions, args: argparse.Namespace) -> int:
    from specdec.serving.ray_app import run_ray

    check_replicas(args.replicas, args.cpus_per_replica, local=args.ray_address is None)

    return run_ray(options, args.replicas, args.cpus_per_replica, args.ray_address)
