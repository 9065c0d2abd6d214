"""The Tinker service (``python -m mlora.service``) with several clients, measured side by side in one run.

    .venv/bin/python bench/tinker.py [--only clients,dispatch] [--model smollm2|tiny] [--clients 4] [--steps 3]
                                     [--reps 3] [--targets all-linear,lm_head] [--max-tokens 512]

Sections (``--only``, comma-separated; default: both):

- ``clients``: cookbook-style RL clients, each a LoRA (rank 16, ``train_unembed`` on, the SDK's default) doing
  ``--steps`` steps of: ``save_weights_and_get_sampling_client``, ``sample`` (4 samples of 16 tokens on each of 4
  prompts, through the server's vLLM engine), ``forward_backward(importance_sampling)`` on those samples with the
  sampler's log-probs, ``optim_step``. One server; first one client alone, then ``--clients`` clients one after
  another, then all at once (a thread each, as separate programs would). Time: all at once vs one after another
  (goal <= 0.7x). Memory: the server's peak resident set (the server and its engine process, summed PSS, sampled
  every 0.25 s) while all clients run at once vs while one client runs alone (goal <= 1.2x). The server packs a
  batch into micro-batches of ``--max-tokens`` tokens (``--max-tokens-per-microbatch``; 512: about one client's
  batch). Where the time goes: the seconds the clients waited on each phase.
- ``dispatch``: in one process, ``--clients`` adapters' forward+backward on one base as one mixed-adapter
  micro-batch (each adapter's LoRA on its rows only, the base once over all rows: what the service runs) vs one
  dispatch per adapter with that adapter swapped in (SkyRL's Megatron backend), at a small micro-batch (1 row of
  32 tokens per adapter) and a large one (4 rows of 128 tokens per adapter), and the mixed batch's rows with one
  adapter, unrouted (what that batch costs without mixing); at the large size also the mixed rows in micro-batches of
  one row per adapter (every micro-batch mixes all adapters, at a quarter of the tokens: what the service runs with
  ``--max-tokens-per-microbatch``). ``--targets``: the adapters' target modules. Variants
  alternate in rotating order; the medians' ratios are printed (swap / mixed: above 1, mixing is faster).

The machine comes first (CPU model, ISA, BLAS), as in every bench here.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lora_overhead import machine  # noqa: E402  (bench/ is sys.path[0] when run as a script)

# this file is bench/tinker.py: with bench/ on the path, `import tinker` would import it, not the SDK
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 12 + 30?", "Name a colour.", "Count to five.", "What is the capital of France?"]


def _model(kind: str, tmp: Path) -> Path:
    if kind == "tiny":
        from mlora.testing import build_tiny_model

        return build_tiny_model("llama", tmp / "llama")
    from mlora.models.smollm2 import smollm2_dir

    return smollm2_dir("float32", progress=False)


# ------------------------------------------------------------------ clients
class Memory:
    """Peak summed PSS of a process and its descendants, sampled every 0.25 s in a thread."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _now(self) -> int:
        import psutil

        total = 0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            self.peak = max(self.peak, self._now())

    def __enter__(self):
        self.peak = self._now()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


PHASES = ("sampler weights", "sample", "forward_backward", "optim_step")


def _client_run(url: str, model: Path, steps: int, seed: int, key: str, waited: dict[str, float]) -> None:
    """One cookbook-style RL client: ``steps`` x (sampler weights, sample, importance-sampling step, AdamW); the
    seconds it waits on each phase are added to ``waited``."""
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    service = tinker.ServiceClient(base_url=url, api_key=key)
    trainer = service.create_lora_training_client(base_model=str(model), rank=16, seed=seed).result()
    prompts = [tok(f"User: {p}\nAssistant:")["input_ids"] for p in PROMPTS]
    params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=seed)

    def timed(phase: str, run):
        t = time.perf_counter()
        out = run()
        waited[phase] += time.perf_counter() - t
        return out

    for _ in range(steps):
        sampler = timed("sampler weights", lambda: trainer.save_weights_and_get_sampling_client().result())
        results = timed("sample", lambda: [f.result() for f in [sampler.sample(types.ModelInput.from_ints(p), 4, params)
                                                                for p in prompts]])
        data = []
        for prompt, res in zip(prompts, results):
            for seq in res.sequences:
                tokens = prompt + list(seq.tokens)
                n = len(tokens) - 1
                lp = [0.0] * (len(prompt) - 1) + list(seq.logprobs)
                adv = [0.0] * (len(prompt) - 1) + [1.0 if len(seq.tokens) % 2 else -1.0] * len(seq.tokens)
                data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": lp[:n],
                                                        "advantages": adv[:n]}))
        timed("forward_backward", lambda: trainer.forward_backward(data, "importance_sampling").result())
        timed("optim_step", lambda: trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result())
    service.close("success").result()


def clients(args, model: Path, tmp: Path) -> None:
    import socket

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "mlora.service", "--model", str(model), "--data-dir",
                               str(tmp / "data"), "--port", str(port), "--kv-cache-bytes", str(512 << 20),
                               "--max-lora-rank", "16", "--max-loras", str(args.clients),
                               "--max-tokens-per-microbatch", str(args.max_tokens)],
                              stdout=log, stderr=log)
    try:
        deadline = time.time() + 300
        while True:
            try:
                health = httpx.get(f"{url}/api/v1/healthz", timeout=2).json()
                if health["sampling"] == "ready":
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the server did not come up: see {tmp / 'server.log'}")
            time.sleep(0.5)

        def run(n: int, together: bool) -> tuple[float, int, dict[str, float]]:
            waited = dict.fromkeys(PHASES, 0.0)
            jobs = [dict(url=url, model=model, steps=args.steps, seed=10 + i, key=f"tml-bench-{i}", waited=waited)
                    for i in range(n)]
            with Memory(server.pid) as mem:
                t = time.perf_counter()
                if together:
                    threads = [threading.Thread(target=_client_run, kwargs=j) for j in jobs]
                    for th in threads:
                        th.start()
                    for th in threads:
                        th.join()
                else:
                    for j in jobs:
                        _client_run(**j)
                seconds = time.perf_counter() - t
            return seconds, mem.peak, waited

        run(1, False)  # warm-up: the engine's first adapters, the tokenizer
        one_t, one_mem, _ = run(1, False)
        seq_t, _, seq_waited = run(args.clients, False)
        together_t, together_mem, together_waited = run(args.clients, True)
        mixed = open(tmp / "server.log").read().count("models' forward_backward in one batch")
        print(f"\n[clients] {args.clients} cookbook-style clients x {args.steps} steps on {model.name} "
              f"(--max-tokens-per-microbatch {args.max_tokens})")
        print(f"  one client alone:          {one_t:7.1f} s   peak memory {one_mem / 2**30:.2f} GiB")
        print(f"  {args.clients} one after another:     {seq_t:7.1f} s")
        print(f"  {args.clients} at once:               {together_t:7.1f} s   peak memory {together_mem / 2**30:.2f} GiB"
              f"   ({mixed} mixed forward_backward batches)")
        for phase in PHASES:  # summed over the clients: at once, each waits while the others' work runs too
            print(f"    {phase:17s} waited {seq_waited[phase]:7.1f} s one after another, "
                  f"{together_waited[phase]:7.1f} s at once (summed over clients)")
        print(f"  time, at once / one after another: {together_t / seq_t:.2f}x (goal <= 0.7x)")
        print(f"  memory, {args.clients} at once / one alone:    {together_mem / one_mem:.2f}x (goal <= 1.2x)")
    finally:
        server.terminate()
        server.wait(60)


# ------------------------------------------------------------------ dispatch
def dispatch(args, model_dir: Path) -> None:
    import mlora
    from mlora.lora.config import LoraConfig

    model = mlora.from_pretrained(model_dir, mlora.init_parallel(), dtype=torch.float32)
    names = [f"c{i}" for i in range(args.clients)]
    for i, name in enumerate(names):
        model.add_adapter(name, LoraConfig(rank=16, alpha=32, seed=i, target_modules=args.targets.split(",")))
    params = [p for n in names for p in model.adapter_parameters(n)]
    vocab = model.spec.vocab_size
    lo, hi = model.vocab_shard_range()

    def loss_fn(logits, mb):
        return logits[..., : hi - lo].float().logsumexp(-1).mean(), {}

    print(f"\n[dispatch] {args.clients} adapters (r 16, {args.targets}) on {model_dir.name}, forward+backward, "
          f"{torch.get_num_threads()} threads")
    for label, rows, tokens in (("small", 1, 32), ("large", 4, 128)):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (rows * len(names), tokens), generator=g)
        mask = torch.ones_like(ids)
        adapter_rows = {n: list(range(k * rows, (k + 1) * rows)) for k, n in enumerate(names)}

        def mixed():
            with model.use_adapters(*names):
                model.forward_backward([{"input_ids": ids, "attention_mask": mask, "adapter_rows": adapter_rows}],
                                       loss_fn)

        def swap():
            for n, r in adapter_rows.items():
                with model.use_adapters(n):
                    model.forward_backward([{"input_ids": ids[r], "attention_mask": mask[r]}], loss_fn)

        def mixed_micro():  # micro-batch j: row j of every adapter (a bounded micro-batch, still mixing all four)
            mbs = [{"input_ids": ids[rows_j], "attention_mask": mask[rows_j],
                    "adapter_rows": {n: [k] for k, n in enumerate(names)}}
                   for rows_j in ([k * rows + j for k in range(len(names))] for j in range(rows))]
            with model.use_adapters(*names):
                model.forward_backward(mbs, loss_fn)

        def one():  # the mixed batch's rows with one adapter, unrouted: what the batch costs without mixing
            with model.use_adapters(names[0]):
                model.forward_backward([{"input_ids": ids, "attention_mask": mask}], loss_fn)

        variants = {"mixed": mixed, "swap": swap, "one": one, **({"mixed_micro": mixed_micro} if rows > 1 else {})}
        times = {k: [] for k in variants}
        for fn in variants.values():  # warm-up
            fn()
        for rep in range(args.reps):
            order = list(variants)[rep % len(variants):] + list(variants)[:rep % len(variants)]
            for k in order:
                t = time.perf_counter()
                variants[k]()
                times[k].append(time.perf_counter() - t)
                for p in params:
                    p.grad = None
        m, s, o = (statistics.median(times[k]) for k in ("mixed", "swap", "one"))
        print(f"  {label:5s} ({rows} row(s) x {tokens} tokens per adapter): mixed {m * 1e3:8.1f} ms, "
              f"swap {s * 1e3:8.1f} ms, swap / mixed {s / m:.2f}x; the same rows with one adapter {o * 1e3:8.1f} ms "
              f"(mixed / one {m / o:.2f}x)")
        if rows > 1:
            mm = statistics.median(times["mixed_micro"])
            print(f"        mixed in {rows} micro-batches of one row per adapter ({len(names) * tokens} tokens each, "
                  f"as --max-tokens-per-microbatch bounds them): {mm * 1e3:8.1f} ms, swap / that {s / mm:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="clients,dispatch")
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=512,
                    help="the server's --max-tokens-per-microbatch (about one client's batch; 0: a batch in one)")
    ap.add_argument("--targets", default="all-linear,lm_head", help="the dispatch section's adapters' target modules")
    args = ap.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory(prefix="mlora-bench-tinker-") as tmp:
        model = _model(args.model, Path(tmp))
        only = set(args.only.split(","))
        if "clients" in only:
            clients(args, model, Path(tmp))
        if "dispatch" in only:
            dispatch(args, model)


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parent))  # after the SDK: this file is not `tinker`
    import records  # noqa: E402 - the run becomes a record of bench/records.jsonl

    records.main(main, group="Tinker service")
