"""``python -m mlora.service --model HF_DIR --data-dir DIR [--port 8000]``: serve the Tinker API on one base.

Point the Tinker SDK or the tinker-cookbook at it with ``TINKER_BASE_URL=http://HOST:PORT`` and any
``TINKER_API_KEY`` starting ``tml-`` (the key names the owner of sessions, models and checkpoints).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    """The server's command-line parser; runs nothing."""
    ap = argparse.ArgumentParser(prog="python -m mlora.service", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the base: an HF checkpoint directory")
    ap.add_argument("--data-dir", required=True, help="where the state (SQLite) and checkpoints live")
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    ap.add_argument("--port", type=int, default=8000, help="the port to listen on")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the base's dtype")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (under torchrun; world = tp x pp x dp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (under torchrun; world = tp x pp x dp)")
    ap.add_argument("--model-name", default=None, help="another name clients may give as base_model")
    ap.add_argument("--session-timeout", type=float, default=120.0,
                    help="seconds without a heartbeat after which a session's models are freed")
    ap.add_argument("--batch-window", type=float, default=0.01,
                    help="seconds a ready forward_backward waits for other clients' to run in one batch (and an idle "
                         "sampling engine for the rest of a burst of sample requests)")
    ap.add_argument("--max-tokens-per-microbatch", type=int, default=None,
                    help="tokens of one micro-batch: a forward_backward batch's rows (split over the DP replicas) are "
                         "packed into micro-batches of at most this many tokens, which bounds activation memory "
                         "however many clients' requests a batch holds; a longer datum is refused (default: sized at "
                         "start from the trainer's memory, a longer datum alone; 0: each batch in one micro-batch)")
    ap.add_argument("--max-resident-clients", type=int, default=None,
                    help="clients whose adapters stay in the model; the least recently used others wait in host "
                         "memory (factors, gradients, AdamW state) and come back when they call (default: all stay)")
    sampling = ap.add_argument_group("sampling (a vLLM engine in a child process; each client's sampler weights a "
                                     "LoRA adapter of it)")
    sampling.add_argument("--no-sampling", action="store_true", help="serve training calls only (no engine)")
    sampling.add_argument("--max-lora-rank", type=int, default=64,
                          help="the largest LoRA rank a client may create (the engine's adapter slots)")
    sampling.add_argument("--max-loras", type=int, default=4,
                          help="adapters one engine step mixes (more wait their turn)")
    sampling.add_argument("--kv-cache-bytes", type=int, default=None,
                          help="the engine's KV cache (default: sized by mlora from what is free beside the trainer, "
                               "printed at start-up)")
    sampling.add_argument("--max-model-len", type=int, default=None,
                          help="the engine's context length (default: the model's)")
    return ap


def listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before the engine and the trainer load: while they do (tens of seconds), their own
    connections take ephemeral ports, and a free port chosen before the start could be taken by then."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); give a free port") from e
    return sock


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)

    import uvicorn

    import mlora
    from mlora.service.app import Service, build_app
    from mlora.service.tenants import Tenants

    if args.max_tokens_per_microbatch is not None and args.max_tokens_per_microbatch < 0:
        print(f"--max-tokens-per-microbatch={args.max_tokens_per_microbatch} must be >= 0 (0: each batch in one "
              "micro-batch)", file=sys.stderr)
        return 2
    if args.max_resident_clients is not None and args.max_resident_clients < 1:
        print(f"--max-resident-clients={args.max_resident_clients} must be >= 1", file=sys.stderr)
        return 2
    if args.max_lora_rank < 1 or args.max_loras < 1:
        print(f"--max-lora-rank={args.max_lora_rank} and --max-loras={args.max_loras} must be >= 1", file=sys.stderr)
        return 2
    if args.max_model_len is not None:
        from mlora.rollout.model_len import read_context_limit

        limit = read_context_limit(args.model)
        if limit is not None and not 1 <= args.max_model_len <= limit:
            print(f"--max-model-len={args.max_model_len}: give at most the model's context, {limit} tokens",
                  file=sys.stderr)
            return 2
    http = None
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 serves HTTP
        try:
            http = listen(args.host, args.port)
        except OSError as e:
            print(f"python -m mlora.service: {e}", file=sys.stderr)
            return 2
    mesh = mlora.init_parallel(tp=args.tp, pp=args.pp)
    sampler, sizing, log = None, None, logging.getLogger("mlora.service")
    from mlora.service.sizing import engine_sizing, microbatch_sizing

    if not args.no_sampling and mesh.rank == 0:  # started first: the engine loads while the trainer does
        from mlora.service.sampler import Sampler

        try:
            sizing = engine_sizing(args.model, args.dtype, mesh, args.max_lora_rank, args.max_loras,
                                   args.max_model_len, args.kv_cache_bytes)
        except ValueError as e:
            print(f"python -m mlora.service: {e}", file=sys.stderr)
            return 2
        log.info(sizing.line())
        sampler = Sampler(args.model, None, dtype=args.dtype, max_lora_rank=args.max_lora_rank,
                          max_loras=args.max_loras, kv_cache_memory_bytes=sizing.engine.kv_cache_memory_bytes,
                          max_model_len=args.max_model_len, batch_window=args.batch_window,
                          gpu_memory_utilization=sizing.engine.gpu_memory_utilization)
    max_tokens = args.max_tokens_per_microbatch
    if max_tokens is None:  # every rank the same budget: rank 0's (its engine's share, or the host's memory now)
        budget = microbatch_sizing(args.model, args.dtype, mesh, args.max_lora_rank, args.max_model_len,
                                   None if sizing is None else sizing.trainer_share) if mesh.rank == 0 else None
        if mesh.world_size > 1:
            import torch.distributed as dist

            shared = [budget]
            dist.broadcast_object_list(shared, src=0)
            budget = shared[0]
        if mesh.rank == 0:
            log.info(budget.line())
        max_tokens = budget.tokens
    model = mlora.from_pretrained(args.model, mesh, dtype=DTYPES[args.dtype])
    tenants = Tenants(model, args.max_resident_clients, max_tokens, strict=args.max_tokens_per_microbatch is not None)
    if mesh.rank != 0:  # rank 0 serves HTTP and sends every model call here (mlora.service.mesh)
        from mlora.service.mesh import follow

        follow(tenants)
        return 0
    if mesh.world_size > 1:
        from mlora.service.mesh import Broadcast

        tenants = Broadcast(tenants)
        log.info("serving on %d ranks (TP %d x PP %d x DP %d)", mesh.world_size, mesh.tp, mesh.pp, mesh.dp)
    service = Service(tenants, args.model, args.data_dir, args.model_name, args.session_timeout, args.batch_window,
                      sampler)
    try:
        config = uvicorn.Config(build_app(service), host=args.host, port=args.port, log_level="warning")
        uvicorn.Server(config).run(sockets=[http])
    finally:
        service.close()
        if mesh.world_size > 1:
            tenants.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
