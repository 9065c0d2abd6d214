"""One engine, several adapters (vLLM multi-LoRA, issue 25): prompts of different adapters and different
sampling configs share one batch and sample exactly as each adapter's prompts alone; a hand-off replaces one
adapter and leaves the others; adapters from tensor segments and shipped images serve as from files."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft_refs import random_peft_adapter

from mlora.rollout.generator import SamplingConfig, per_prompt_configs
from mlora.rollout.vllm_engine import EngineGroup, LocalVLLMEngine

CLOSE = 1e-5  # |log-prob| of the same token in a mixed batch and alone (float32; only GEMM shapes differ)
AGREE = 1e-3  # |vLLM log-prob - HF+PEFT log-prob| per sampled token (float32)
PROMPTS = [[5, 17, 250, 33], [7, 8, 9, 400, 12], [900, 3, 44, 61, 2, 70], [11, 12, 13]]
# each adapter's own batch: prompts and one config; they differ in temperature, seed, samples, length, stops
GROUPS = {
    "a": ([PROMPTS[0], PROMPTS[1]], SamplingConfig(temperature=1.0, max_generate_length=10, n_samples_per_prompt=2,
                                                   seed=3)),
    "b": ([PROMPTS[2]], SamplingConfig(temperature=0.7, max_generate_length=8, seed=11, stop_token_ids=(40,))),
    "c": ([PROMPTS[3], PROMPTS[0]], SamplingConfig(temperature=1.3, max_generate_length=12, n_samples_per_prompt=3,
                                                   seed=5)),
}
MIXED = [("a", 0), ("c", 0), ("b", 0), ("a", 1), ("c", 1)]  # (adapter, its prompt) at each place of one batch


@pytest.fixture(scope="module")
def adapter_dirs(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Random PEFT adapters (non-zero B) of the tiny Llama; ranks 8 and 4."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: random_peft_adapter(tiny_models / "llama", root / name, r=r, alpha=2 * r, seed=seed)
            for name, r, seed in (("a", 8, 1), ("b", 4, 2), ("c", 8, 3), ("d", 8, 4))}


@pytest.fixture(scope="module")
def engine(tiny_models):
    """One engine for three adapters; it also takes tensors (weight_sync=tensors)."""
    eng = LocalVLLMEngine(tiny_models / "llama", max_lora_rank=8, max_loras=3, kv_cache_memory_bytes=64 << 20,
                          tensor_lora=True)
    yield eng
    eng.close()


def _load(engine, dirs: dict[str, Path], names: str = "abc") -> None:
    for name in names:
        engine.update_adapter(dirs[name], name)


def _mixed_batch(places=MIXED) -> tuple[list[list[int]], list[SamplingConfig], list[str]]:
    """The prompts, per-prompt configs (seeded as in their adapter's own batch) and adapter names of one batch."""
    prompts, configs, names = [], [], []
    for name, j in places:
        group_prompts, config = GROUPS[name]
        prompts.append(group_prompts[j])
        configs += per_prompt_configs(config, [j])
        names.append(name)
    return prompts, configs, names


def _by_prompt(gens) -> dict[int, list]:
    out: dict[int, list] = {}
    for g in gens:
        out.setdefault(g.prompt_index, []).append(g)
    return out


def _assert_same(got: list, want: list, what: str) -> None:
    assert [g.token_ids for g in got] == [g.token_ids for g in want], what
    for g, w in zip(got, want):
        assert max((abs(x - y) for x, y in zip(g.logprobs, w.logprobs)), default=0.0) <= CLOSE, what


def _hf_gap(base: Path, adapter: Path, prompt: list[int], gens: list, temperature: float) -> float:
    """Largest |vLLM - HF+PEFT| log-prob of the sampled tokens under softmax(logits / temperature)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                      str(adapter)).eval()
    gap = 0.0
    with torch.no_grad():
        for g in gens:
            logits = model(input_ids=torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1:-1]
            ref = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
            gap = max(gap, (ref - torch.tensor(g.logprobs)).abs().max().item())
    return gap


def test_mixed_batch_equals_each_adapter_alone(engine, adapter_dirs, tiny_models):
    """Three adapters from disk; one batch (through the engine group) mixing them, with each prompt's own
    temperature, seed, sample count and length, samples exactly what each adapter's batch alone samples; and
    each alone is its adapter (HF+PEFT log-probs of the sampled tokens)."""
    _load(engine, adapter_dirs)
    assert engine.result(engine.submit("adapters")) == ["a", "b", "c"]
    alone = {name: _by_prompt(engine.generate(prompts, config, adapters=[name] * len(prompts)))
             for name, (prompts, config) in GROUPS.items()}
    for name, (prompts, config) in GROUPS.items():
        assert sorted(alone[name]) == list(range(len(prompts)))
        for j, prompt in enumerate(prompts):
            assert len(alone[name][j]) == config.n_samples_per_prompt
            gap = _hf_gap(tiny_models / "llama", adapter_dirs[name], prompt, alone[name][j], config.temperature)
            assert gap < AGREE, (name, j, gap)
    assert alone["a"][0][0].token_ids != alone["c"][1][0].token_ids  # same prompt, other adapter and config

    prompts, configs, names = _mixed_batch()
    mixed = _by_prompt(EngineGroup([engine]).generate(prompts, configs, adapters=names))
    assert sorted(mixed) == list(range(len(MIXED)))
    for m, (name, j) in enumerate(MIXED):
        _assert_same(mixed[m], alone[name][j], f"place {m}: adapter {name} prompt {j}")

    # an engine group's share of the batch (engine 1 of 2: the odd places) is the same prompts' generations
    share = _by_prompt(EngineGroup([engine]).generate(prompts, configs, slots=[1], total=2, adapters=names))
    assert sorted(share) == [1, 3]
    for m in share:
        _assert_same(share[m], mixed[m], f"place {m} on engine 1 of 2")


def test_hand_off_replaces_only_its_adapter(engine, adapter_dirs, tmp_path):
    """Adapter b hot-swapped (d's weights): the batch's b prompts change, a's and c's do not. A sync folder
    rewritten with new weights and loaded again under the same name serves the new weights (vLLM's prefix
    cache, keyed by adapter name and path, must not hand back blocks of the old ones)."""
    _load(engine, adapter_dirs)
    prompts, configs, names = _mixed_batch()
    before = _by_prompt(engine.generate(prompts, configs, adapters=names))
    engine.update_adapter(adapter_dirs["d"], "b")
    assert engine.result(engine.submit("adapters")) == ["a", "b", "c"]
    after = _by_prompt(engine.generate(prompts, configs, adapters=names))
    for m, name in enumerate(names):
        if name == "b":
            assert [g.logprobs for g in after[m]] != [g.logprobs for g in before[m]], m
        else:
            _assert_same(after[m], before[m], f"place {m}: adapter {name} after b's hand-off")

    long_prompt = [(7 * i) % 1000 + 1 for i in range(136)]  # more than one KV block (128 tokens on CPU)
    greedy = SamplingConfig(temperature=0.0, max_generate_length=4)
    sync = tmp_path / "sync"
    shutil.copytree(adapter_dirs["a"], sync)
    engine.update_adapter(sync, "a")
    engine.generate([long_prompt], greedy, adapters=["a"])  # caches the prompt's first block under "a" at `sync`
    shutil.rmtree(sync)
    shutil.copytree(adapter_dirs["d"], sync)
    engine.update_adapter(sync, "a")
    (reloaded,) = engine.generate([long_prompt], greedy, adapters=["a"])
    (fresh,) = engine.generate([long_prompt], greedy, adapters=["b"])  # d's weights from their own folder
    _assert_same([reloaded], [fresh], "adapter a reloaded from its rewritten sync folder")


def _engine_entries(engine, what: str) -> list[str]:
    """This engine process's entries of kind ``what`` in /dev/shm (its own segments, shipped files)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"mlora_*_{engine._proc.pid}_{what}-*"))


def test_tensor_segments_and_shipped_adapters_serve_as_files(engine, adapter_dirs):
    """Two adapters from two trainer segments (weight_sync=tensors) sample what they sample from files; so do
    two adapters shipped as segment images (Ray engines on another node: one engine segment per adapter) and
    as file contents (Ray, memory mode: one folder per adapter); a new image of one keeps both segments."""
    from test_weight_sync_tensors import _write_segment

    from mlora.rollout.tensor_sync import SCHEME, image_size

    _load(engine, adapter_dirs)
    prompts, configs, names = _mixed_batch([("a", 0), ("b", 0), ("a", 1)])
    from_files = _by_prompt(engine.generate(prompts, configs, adapters=names))
    segments = {name: _write_segment(adapter_dirs[name]) for name in "ab"}
    try:
        for name, seg in segments.items():
            engine.update_adapter_tensors(f"{SCHEME}{seg.name}#1", name)
        from_tensors = _by_prompt(engine.generate(prompts, configs, adapters=names))
        for m in from_files:
            _assert_same(from_tensors[m], from_files[m], f"place {m} from a segment")

        if not Path("/dev/shm").is_dir():
            return  # engine segments and shipped files live in /dev/shm
        for name, seg in segments.items():
            image = bytes(seg.shm.buf[:image_size(seg.shm.buf)])
            engine.result(engine.submit("set_adapter_image", image, 2, name))
        assert len(_engine_entries(engine, "engine")) == 2
        shipped = _by_prompt(engine.generate(prompts, configs, adapters=names))
        for m in from_files:
            _assert_same(shipped[m], from_files[m], f"place {m} from a shipped image")
        seg = segments["a"]
        engine.result(engine.submit("set_adapter_image", bytes(seg.shm.buf[:image_size(seg.shm.buf)]), 3, "a"))
        assert len(_engine_entries(engine, "engine")) == 2  # a's own segment refilled, b's kept

        for name in "ab":
            files = {f.name: f.read_bytes() for f in adapter_dirs[name].iterdir() if f.is_file()}
            engine.result(engine.submit("set_adapter_files", files, name))
        assert len(_engine_entries(engine, "files")) == 2
        from_shipped_files = _by_prompt(engine.generate(prompts, configs, adapters=names))
        for m in from_files:
            _assert_same(from_shipped_files[m], from_files[m], f"place {m} from shipped files")
    finally:
        for seg in segments.values():
            seg.unlink()


def test_adapter_name_errors(engine, adapter_dirs):
    """Unknown names, no name with several adapters, more adapters than max_loras, lists of the wrong length:
    each refused with a message naming what was given and what is valid."""
    _load(engine, adapter_dirs)
    with pytest.raises(RuntimeError, match=r"adapters \['nope'\] are not loaded in this engine; "
                                           r"loaded: \['a', 'b', 'c'\]"):
        engine.generate(PROMPTS[:2], GROUPS["a"][1], adapters=["a", "nope"])
    with pytest.raises(RuntimeError, match=r"serves 3 adapters \['a', 'b', 'c'\]: name one per prompt"):
        engine.generate(PROMPTS[:1], GROUPS["a"][1])
    with pytest.raises(RuntimeError, match=r"adapter 'd': this engine serves at most max_loras=3 adapters"):
        engine.update_adapter(adapter_dirs["d"], "d")
    with pytest.raises(RuntimeError, match=r"serves 3 adapters.*use adapters\(\)"):
        engine.result(engine.submit("adapter"))
    group = EngineGroup([engine])
    with pytest.raises(ValueError, match=r"1 adapter names for 2 prompts"):
        group.submit_generate(PROMPTS[:2], GROUPS["a"][1], adapters=["a"])
    with pytest.raises(ValueError, match=r"1 sampling configs for 2 prompts"):
        group.submit_generate(PROMPTS[:2], [GROUPS["a"][1]])
    assert engine.result(engine.submit("adapters")) == ["a", "b", "c"]  # nothing changed


class _FakeLLM:
    """What VLLMServer asks of vLLM's ``LLM``, recorded: adapter loads, prefix-cache resets, generate calls (one
    token per sample)."""

    def __init__(self, budget: int = 2048) -> None:
        self.loads, self.resets, self.calls = [], 0, []
        config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=budget))
        self.llm_engine = SimpleNamespace(add_lora=self.loads.append, vllm_config=config)

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    def generate(self, prompts, params, lora_request, use_tqdm):
        self.calls.append((len(prompts), list(params), list(lora_request)))
        sample = SimpleNamespace(token_ids=[1], logprobs=[{1: SimpleNamespace(logprob=-0.5)}], text="x",
                                 finish_reason="stop")
        return [SimpleNamespace(outputs=[sample] * p.n) for p in params]


def _server(max_loras: int, budget: int = 2048):
    from mlora.rollout.vllm_engine import VLLMServer

    server = VLLMServer.__new__(VLLMServer)  # no engine: the adapter bookkeeping and the request building run
    server.llm, server._loras, server._max_loras = _FakeLLM(budget), {}, max_loras
    server._segments, server._shipped, server._merged = {}, {}, None
    server._running, server._finished, server._generate_calls = {}, [], 0
    return server


def test_one_adapter_engine_as_before():
    """max_loras=1 (today's callers): before a hand-off prompts go to the base; generation names no adapter;
    a new name replaces the adapter under the same id; a folder loaded again resets the prefix cache."""
    server = _server(max_loras=1)
    config = SamplingConfig(seed=7, n_samples_per_prompt=2)
    assert server.adapter() is None and len(server.generate(PROMPTS[:2], config)) == 4
    assert server.llm.calls[-1][2] == [None, None]
    for name, path in (("policy", "/sync/p"), ("sft", "/sync/s"), ("sft", "/sync/s")):
        server.set_adapter(path, name)
        assert server.adapters() == [name] and server.adapter() == name
        load = server.llm.loads[-1]
        assert (load.lora_name, load.lora_int_id, load.lora_path, load.load_inplace) == (name, 1, path, True)
    assert server.llm.resets == 1  # only the reload of the same folder
    gens = server.generate(PROMPTS[:2], config, indices=[4, 9])
    _, params, loras = server.llm.calls[-1]
    assert [g.prompt_index for g in gens] == [0, 0, 1, 1]
    assert [p.seed for p in params] == [11, 16]  # seed + the prompt's place in the whole batch
    assert [(r.lora_name, r.lora_int_id, r.load_inplace) for r in loras] == [("sft", 1, False)] * 2


def test_per_prompt_configs_and_adapters_reach_vllm():
    """Per-prompt configs keep their seeds, sample counts and temperatures; each prompt carries its adapter's
    request (ids stable per name); a call's prompt tokens x samples stay within vLLM's batch budget."""
    server = _server(max_loras=3, budget=15)
    for name in "abc":
        server.set_adapter(f"/sync/{name}", name)
    server.set_adapter("/sync/b2", "b")
    assert [(r.lora_name, r.lora_int_id) for r in server.llm.loads] == [("a", 1), ("b", 2), ("c", 3), ("b", 2)]
    prompts, configs, names = _mixed_batch()
    gens = server.generate(prompts, configs, adapters=names)
    assert [g.prompt_index for g in gens] == [m for m, c in enumerate(configs)
                                              for _ in range(c.n_samples_per_prompt)]
    calls = server.llm.calls
    # tokens x samples per place: 8, 9, 6, 10, 12 -> calls of at most 15, in order
    assert [n for n, _, _ in calls] == [1, 2, 1, 1]
    params = [p for _, ps, _ in calls for p in ps]
    assert [(p.seed, p.n, p.temperature, p.max_tokens) for p in params] == [
        (c.seed, c.n_samples_per_prompt, c.temperature, c.max_generate_length) for c in configs]
    assert [c.seed for c in configs] == [3, 5, 11, 4, 6]
    loras = [r for _, _, rs in calls for r in rs]
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in loras] == [
        ("a", 1, "/sync/a"), ("c", 3, "/sync/c"), ("b", 2, "/sync/b2"), ("a", 1, "/sync/a"), ("c", 3, "/sync/c")]
    server.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens = 100
    server.generate(prompts, configs, adapters=names)
    assert server.llm.calls[-1][0] == len(prompts)  # all in one call when they fit


def test_ray_images_cached_per_segment(adapter_dirs, monkeypatch):
    """Ray engines on another node get each adapter's segment through the object store: one put per segment
    version, whichever adapter was handed off last (two adapters' hand-offs do not evict each other)."""
    from test_weight_sync_tensors import _write_segment

    from mlora.rollout.tensor_sync import SCHEME
    from mlora.rollout.vllm_engine import RayVLLMEngine

    puts = []

    def put(image) -> int:  # ray.put: the object ref is the put's number
        puts.append(image)
        return len(puts)

    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(put=put))
    monkeypatch.setattr(RayVLLMEngine, "_shipped_images", {})
    segments = [_write_segment(adapter_dirs[name]) for name in "ab"]
    try:
        paths = [f"{SCHEME}{seg.name}#1" for seg in segments]
        refs = [RayVLLMEngine._put_image(path) for path in paths + paths]
        assert refs == [1, 2, 1, 2] and len(puts) == 2
        assert bytes(puts[0][:8]) == bytes(segments[0].shm.buf[:8])  # the image of a's own segment
        assert RayVLLMEngine._put_image(f"{SCHEME}{segments[0].name}#2") == 3  # a's next version
        assert RayVLLMEngine._put_image(paths[1]) == 2
    finally:
        for seg in segments:
            seg.unlink()


def test_serving_several_adapters(adapter_dirs, tmp_path):
    """The served rank is the largest of the adapters' (rank_pattern included); several adapters share a batch."""
    import json

    from mlora.rollout.serve import largest_adapter_rank, serve_command

    assert largest_adapter_rank([adapter_dirs["b"]]) == 4
    assert largest_adapter_rank(adapter_dirs.values()) == 8
    patterned = tmp_path / "patterned"
    shutil.copytree(adapter_dirs["b"], patterned)
    config = json.loads((patterned / "adapter_config.json").read_text())
    (patterned / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": {"q_proj": 24}}))
    assert largest_adapter_rank([adapter_dirs["a"], patterned]) == 24
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        largest_adapter_rank([tmp_path])
    argv = serve_command(tmp_path, {name: adapter_dirs[name] for name in "abc"}, largest_adapter_rank([patterned]))
    assert argv[argv.index("--max-lora-rank") + 1] == "32" and argv[argv.index("--max-loras") + 1] == "3"
