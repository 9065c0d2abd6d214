"""A pool of CPU ranks for tests: the imports are paid once, every case runs in processes of its own.

Why: a ``torchrun`` launch on the 2-core build machine spends ~16 s before the case's first line runs:
the agent imports torch, then every rank imports torch, megatron-core, transformers and mlora. A test
session launches dozens. The pool starts one *zygote* process per session that imports those once and
then forks the ranks of each case from it (copy-on-write, milliseconds). A case still gets what a
torchrun launch gives it: fresh processes with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_PORT``, ...), so its own process group and megatron groups, the seeds of a new process, its
own working directory and its own output; a failure, a monkey-patch or a hung collective ends with its
processes and never reaches the next case.

    pool = RankPool(log_dir)
    result = pool.run(4, "tests/dist/hf_equivalence.py", [model_dir, out], timeout=600)
    result.ok, result.returncodes, result.stdout, result.failure_report()

Like torchrun, the first rank that fails ends the case: the other ranks get SIGTERM, then SIGKILL
(a rank blocked in a collective would otherwise wait for its peer until the group's timeout), and so
do the processes the ranks started (each rank leads a process group of its own). The zygote must not
run threads when it forks (a lock held by a thread would stay locked in the child forever): it checks
that it has one thread after its imports and refuses to start otherwise. ``OMP_NUM_THREADS=1`` (what
torchrun sets for several ranks) keeps torch's OpenMP pool from starting in it, and
``JE_ARROW_MALLOC_CONF=background_thread:false`` pyarrow's jemalloc from starting its background thread when
pandas (skyrl-gym's) imports it.

    python -m mlora.testing.rank_pool   # the zygote; speaks JSON lines on stdin/stdout
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mlora.parallel.mesh import _free_port

# What the zygote starts with so that its imports start no thread (see the module docstring)
ZYGOTE_ENV = {"OMP_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}
# What the torchrun workers of mlora's tests import; anything else a case imports itself.
PRELOAD = ("torch", "torch.distributed", "numpy", "safetensors.torch", "megatron.core.parallel_state",
           "megatron.core.tensor_parallel", "megatron.core.models.gpt", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.mistral.modeling_mistral", "peft", "mlora", "mlora.train.engine",
           "mlora.train.rl_stage", "mlora.testing")
TORCH_DEFAULT_SEED = 67280421310721  # torch.initial_seed() of a process that never seeded
TERM_GRACE_S = 5.0  # SIGTERM -> SIGKILL, for the ranks left when one failed or the case timed out


@dataclass
class CaseResult:
    """What the ranks of one case did: exit codes (negative: killed by that signal), their output."""

    target: str
    returncodes: list[int]
    logs: list[tuple[Path, Path]]  # (stdout, stderr) per rank
    seconds: float
    timed_out: bool = False
    first_failed: int | None = None  # the rank that failed first (its traceback is the case's)
    stdout: str = field(default="", repr=False)
    stderr: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.returncodes)

    def failure_report(self, tail: int = 8000) -> str:
        """The failing rank's stderr (its traceback) first, then every other rank's that said anything."""
        if self.ok:
            return ""
        head = (f"{self.target} timed out after {self.seconds:.0f} s" if self.timed_out
                else f"{self.target} failed: exit codes by rank {self.returncodes}")
        order = ([self.first_failed] if self.first_failed is not None else []) + \
                [r for r in range(len(self.returncodes)) if r != self.first_failed]
        parts = [head]
        for rank in order:
            out, err = (p.read_text(errors="replace") if p.exists() else "" for p in self.logs[rank])
            if out.strip() or err.strip():
                parts.append(f"--- rank {rank} (exit {self.returncodes[rank]}) stdout ---\n{out[-tail // 4:]}"
                             f"\n--- rank {rank} stderr ---\n{err[-tail:]}")
        return "\n".join(parts)


class RankPool:
    """The test session's side of the pool: starts the zygote on first use, runs cases one at a time."""

    def __init__(self, log_dir: str | os.PathLike, preload: tuple[str, ...] = PRELOAD,
                 env: dict[str, str] | None = None, python: str = sys.executable) -> None:
        self.log_dir = Path(log_dir)
        self.preload = preload
        self.env = {**os.environ, **ZYGOTE_ENV, **(env or {})}  # the zygote's
        self.python = python
        self._proc: subprocess.Popen | None = None
        self.cases = 0

    def _start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._zygote_log = open(self.log_dir / "zygote.log", "ab")
        self._proc = subprocess.Popen([self.python, "-m", "mlora.testing.rank_pool", *self.preload],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._zygote_log,
                                      env=self.env, text=True, bufsize=1)
        reply = self._read()
        if reply.get("status") != "ready":
            raise RuntimeError(f"the rank pool's zygote did not start: {reply.get('error', reply)}")

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            self._proc = None
            log = (self.log_dir / "zygote.log").read_text(errors="replace")[-4000:]
            return {"status": "dead", "error": f"the zygote exited with {code}:\n{log}"}
        return json.loads(line)

    def run(self, nproc: int, target: str | os.PathLike, args: list = (), *, module: bool = False,
            env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
            timeout: float = 600, torchrun: bool = True) -> CaseResult:
        """Run ``target`` (a script, or a module with ``module=True``) on ``nproc`` ranks with ``args``,
        as ``torchrun --nproc_per_node nproc`` would (``torchrun=False``: as ``python`` would, one process
        without torchrun's variables). The ranks' environment is this process's now, with
        ``OMP_NUM_THREADS=1`` and ``env`` added (variables that the preloaded modules read when imported
        keep the values the zygote started with)."""
        if not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"nproc={nproc!r} must be a positive integer")
        if not torchrun and nproc != 1:
            raise ValueError(f"nproc={nproc}: without torchrun a case runs in one process")
        for attempt in range(2):
            result = self._run_once(nproc, target, args, module, env, cwd, timeout, torchrun)
            # the free port picked for the case's store was taken before rank 0 bound it (another process on this
            # machine picked it too): nothing of the case ran past its first collective; once more on a new port
            lost_port = (not result.ok and result.first_failed == 0 and "EADDRINUSE" in result.logs[0][1].read_text(
                errors="replace"))
            if not lost_port or attempt:
                return result
        return result

    def _run_once(self, nproc: int, target, args, module: bool, env, cwd, timeout: float, torchrun: bool
                  ) -> CaseResult:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        self.cases += 1
        case = f"case{self.cases:03d}-{Path(str(target)).stem}"
        request = {"case": case, "nproc": nproc, "target": str(target), "module": module,
                   "args": [str(a) for a in args], "torchrun": torchrun,
                   "env": {**os.environ, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in (env or {}).items()}},
                   "cwd": str(cwd or os.getcwd()), "timeout": timeout, "log_dir": str(self.log_dir / case),
                   "port": _free_port(), "run_id": uuid.uuid4().hex[:12]}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        reply = self._read()
        if reply.get("status") != "done":
            raise RuntimeError(f"the rank pool lost case {case}: {reply.get('error', reply)}")
        logs = [(Path(o), Path(e)) for o, e in reply["logs"]]
        return CaseResult(target=str(target), returncodes=reply["returncodes"], logs=logs,
                          seconds=reply["seconds"], timed_out=reply["timed_out"], first_failed=reply["first_failed"],
                          stdout="".join(o.read_text(errors="replace") for o, _ in logs),
                          stderr="".join(e.read_text(errors="replace") for _, e in logs))

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()  # the zygote ends at EOF
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if getattr(self, "_zygote_log", None) is not None:
            self._zygote_log.close()


# --- the zygote -------------------------------------------------------------------------------------

def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rank_main(rank: int, req: dict) -> int:
    """In a forked child: become rank ``rank`` of the case and run it; return its exit code."""
    os.setpgid(0, 0)  # SIGTERM/SIGKILL of the case reach what this rank starts (engines) too
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    log_dir = Path(req["log_dir"])
    out = os.open(log_dir / f"rank{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(log_dir / f"rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # torchrun runs workers with -u
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    n = req["nproc"]
    os.environ.clear()
    os.environ.update(req["env"])
    if req["torchrun"]:
        os.environ.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(req["port"]),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": req["run_id"], "TORCHELASTIC_USE_AGENT_STORE": "False"})
    os.chdir(req["cwd"])
    # the seeds of a new process: Python's and numpy's from the OS, torch's its fixed default
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(TORCH_DEFAULT_SEED)
    import runpy

    target = req["target"]
    sys.argv = [target, *req["args"]]
    try:
        if req["module"]:
            sys.path[0] = req["cwd"]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(target).resolve().parent)
            runpy.run_path(target, run_name="__main__")
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001  (reported as the interpreter would, then exit 1)
        import traceback

        traceback.print_exc()
        return 1


def _kill_groups(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _supervise(pids: list[int], timeout: float) -> tuple[list[int], bool, int | None]:
    """Wait for the ranks; end the case at the first failure or at the timeout, as torchrun does."""
    codes: dict[int, int] = {}
    start = time.monotonic()
    first_failed, timed_out, deadline = None, False, None
    while len(codes) < len(pids):
        for rank, pid in enumerate(pids):
            if rank in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)
                if codes[rank] != 0 and first_failed is None:
                    first_failed = rank
        if len(codes) == len(pids):
            break
        now = time.monotonic()
        if deadline is None and (first_failed is not None or now - start > timeout):
            timed_out = first_failed is None
            _kill_groups([p for r, p in enumerate(pids) if r not in codes], signal.SIGTERM)
            deadline = now + TERM_GRACE_S
        elif deadline is not None and now > deadline:
            _kill_groups([p for r, p in enumerate(pids) if r not in codes], signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.02)
    if first_failed is not None or timed_out:  # what the ranks started (engines) goes with them
        _kill_groups(pids, signal.SIGKILL)
    return [codes[r] for r in range(len(pids))], timed_out, first_failed


def _zygote(preload: list[str]) -> int:
    # the replies get a descriptor of their own; whatever an import prints to stdout goes to the log
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        for name in preload:
            importlib.import_module(name)
        threads = _threads()
        if threads != 1:
            raise RuntimeError(f"the zygote runs {threads} threads after importing {preload}; forking it "
                               "could deadlock its children (set OMP_NUM_THREADS=1, import less)")
    except BaseException as exc:  # noqa: BLE001
        out.write(json.dumps({"status": "error", "error": repr(exc)}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"status": "ready", "threads": threads}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        Path(req["log_dir"]).mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        pids = []
        for rank in range(req["nproc"]):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                out.close()  # the zygote's reply channel is not the rank's
                return _rank_main(rank, req)  # the child leaves the loop and exits normally (atexit runs)
            pids.append(pid)
        codes, timed_out, first_failed = _supervise(pids, req["timeout"])
        logs = [[str(Path(req["log_dir"]) / f"rank{r}.out"), str(Path(req["log_dir"]) / f"rank{r}.err")]
                for r in range(req["nproc"])]
        out.write(json.dumps({"status": "done", "returncodes": codes, "timed_out": timed_out,
                              "first_failed": first_failed, "logs": logs,
                              "seconds": time.perf_counter() - t}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_zygote(sys.argv[1:]))
