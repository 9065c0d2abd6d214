"""``python -m mlora.service --model HF_DIR --data-dir DIR [--port 8000]``: serve the Tinker API on one base.

Point the Tinker SDK or the tinker-cookbook at it with ``TINKER_BASE_URL=http://HOST:PORT`` and any
``TINKER_API_KEY`` starting ``tml-`` (the key names the owner of sessions, models and checkpoints).
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlora.service", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the base: an HF checkpoint directory")
    ap.add_argument("--data-dir", required=True, help="where the state (SQLite) and checkpoints live")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--model-name", default=None, help="another name clients may give as base_model")
    ap.add_argument("--session-timeout", type=float, default=120.0,
                    help="seconds without a heartbeat after which a session's models are freed")
    ap.add_argument("--batch-window", type=float, default=0.01,
                    help="seconds a ready forward_backward waits for other clients' to run in one mixed batch")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)

    import uvicorn

    import mlora
    from mlora.service.app import Service, build_app

    mesh = mlora.init_parallel()
    if mesh.world_size > 1:
        print("python -m mlora.service runs on one process for now (a mesh of several ranks is not served yet)",
              file=sys.stderr)
        return 2
    model = mlora.from_pretrained(args.model, mesh, dtype=DTYPES[args.dtype])
    service = Service(model, args.model, args.data_dir, args.model_name, args.session_timeout, args.batch_window)
    try:
        uvicorn.run(build_app(service), host=args.host, port=args.port, log_level="warning")
    finally:
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
