"""Reward adapters on disk: a LoRA adapter plus a scalar head, as a PEFT sequence-classification adapter.

The format is what PEFT writes for ``task_type="SEQ_CLS"`` on ``AutoModelForSequenceClassification``
with ``num_labels=1``: ``adapter_config.json`` with ``modules_to_save=["score"]`` and
``adapter_model.safetensors`` holding the LoRA factors (PEFT names) plus
``base_model.model.score.weight`` ``[1, hidden]``. So::

    base = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    PeftModel.from_pretrained(base, reward_dir)

scores a sequence like mlora does: HF's ``score`` is ``Linear(hidden, 1, bias=False)`` on the final
hidden state (after the final norm) of the last non-pad token. mlora's head is
:meth:`mlora.MLoraModel.add_value_head` (``bias=False``, or a bias that stayed zero) on the last
pipeline stage.

A reward adapter trained on top of a frozen adapter (``mlora-train --config-name rm`` with
``trainer.policy.model.frozen_adapter_path``, e.g. the SFT adapter) scores what it was trained to
score only with that adapter stacked under it. ``mlora_reward.json`` beside the PEFT files records
it: ``{"frozen_adapter": {"path": ..., "sha256": <hash of its adapter_model.safetensors>}}``, or
``null`` when it was trained on the base alone; :func:`reward_base_adapter` reads and checks it. PEFT
ignores the file (a PEFT user stacks the recorded adapter by hand).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from mlora.export.peft_files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_peft_shapes,
    peft_modules,
    peft_tensor_name,
    read_peft_config,
    write_peft_adapter,
)
from mlora.formats.checkpoint_reader import CheckpointError, CheckpointReader
from mlora.formats.weight_map import read_shard
from mlora.lora.sites import factor_kinds, model_sites
from mlora.lora.targets import attention_projections

SCORE_MODULE = "score"
PEFT_SEQ_CLS_HEADS = ("classifier", "score")  # what PEFT adds to modules_to_save for SEQ_CLS
SCORE_TENSOR = "base_model.model.score.weight"  # PEFT's saved name of modules_to_save=["score"]
TASK_TYPE = "SEQ_CLS"
REWARD_META = "mlora_reward.json"  # what the reward adapter was trained on top of (see the module docstring)


_HEAD_MISSING, _HEAD_BIASED = 1.0, 2.0  # the status entry of the summed buffer; 0 when the head is fine


def _head_weight_everywhere(model, head_name: str) -> tuple[torch.Tensor, float]:
    """``(weight [1, hidden], status)`` on every rank: the head lives on the last stage only.

    A sum over the world in which one rank (last stage, TP 0, DP 0) contributes the weight and a
    status (head missing, non-zero bias): a tensor collective of a known shape, no pickled objects,
    and every rank learns of a bad head, so all raise together instead of some hanging.
    """
    mesh = model.mesh
    owner = mesh.is_last_stage and mesh.tp_rank == 0 and mesh.dp_rank == 0
    buf = torch.zeros(model.spec.hidden_size + 1, dtype=torch.float32, device=mesh.device)
    if owner:
        head = model.heads[head_name] if head_name in model.heads else None
        if head is None:
            buf[-1] = _HEAD_MISSING
        elif head.bias is not None and bool((head.bias.detach() != 0).any()):
            buf[-1] = _HEAD_BIASED
        else:
            buf[:-1] = head.weight.detach().float()[0]
    if mesh.world_size > 1:
        dist.all_reduce(buf)
    buf = buf.cpu()
    return buf[:-1].reshape(1, -1), float(buf[-1])


def reward_adapter_config(lora_config: dict, architecture: str) -> dict:
    """The SEQ_CLS ``adapter_config.json``: the causal-LM one of :func:`peft_adapter_config` with
    the task type, the saved ``score`` module and the sequence-classification base class."""
    config = dict(lora_config)
    config["task_type"] = TASK_TYPE
    config["modules_to_save"] = [SCORE_MODULE]
    if config.get("auto_mapping"):
        config["auto_mapping"] = dict(config["auto_mapping"],
                                      base_model_class=architecture.replace("ForCausalLM", "ForSequenceClassification"))
    return config


def adapter_identity(path: str | os.PathLike) -> dict:
    """``{"path", "sha256"}`` of PEFT adapter directory ``path``: its absolute path and the SHA-256 of
    its ``adapter_model.safetensors`` (the weights; adapters are small enough to hash whole)."""
    path = Path(path).expanduser().resolve()
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no {ADAPTER_WEIGHTS}: not a PEFT adapter directory")
    h = hashlib.sha256()
    with open(weights, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return {"path": str(path), "sha256": h.hexdigest()}


def write_reward_meta(out_dir: str | os.PathLike, frozen_adapter: str | os.PathLike | None) -> Path:
    """Write ``mlora_reward.json`` into reward adapter ``out_dir`` (atomically): the frozen adapter it
    was trained on top of (:func:`adapter_identity`), or null."""
    out = Path(out_dir)
    meta = {"frozen_adapter": None if frozen_adapter is None else adapter_identity(frozen_adapter)}
    tmp = out / f".{REWARD_META}.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / REWARD_META)
    return out / REWARD_META


def reward_base_adapter(reward_dir: str | os.PathLike) -> dict | None:
    """The frozen adapter reward adapter ``reward_dir`` was trained on top of (``{"path", "sha256"}``,
    checked), or None: trained on the base alone, or written without ``mlora_reward.json`` (by PEFT).

    Raises FileNotFoundError when the recorded adapter is gone and ValueError when its weights changed
    (the reward would not be the one trained): both name the path and what to do."""
    reward_dir = Path(reward_dir)
    file = reward_dir / REWARD_META
    if not file.is_file():
        return None
    recorded = json.loads(file.read_text()).get("frozen_adapter")
    if recorded is None:
        return None
    path = Path(recorded["path"])
    where = f"reward adapter {str(reward_dir)!r} was trained on top of the frozen adapter {str(path)!r}"
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{where}, which is missing (recorded in {file}): its scores need that adapter "
                                "under it. Put the adapter back at that path (or retrain the reward model)")
    now = adapter_identity(path)
    if now["sha256"] != recorded["sha256"]:
        raise ValueError(f"{where}, whose {ADAPTER_WEIGHTS} changed since (sha256 {now['sha256'][:12]}… != "
                         f"{recorded['sha256'][:12]}… recorded in {file}): the reward would not be the one trained. "
                         "Restore that adapter (or retrain the reward model)")
    return now


def save_reward_adapter(model, adapter_name: str, head_name: str, out_dir: str | os.PathLike,
                        frozen_adapter: str | os.PathLike | None = None) -> Path:
    """Write adapter ``adapter_name`` and scalar head ``head_name`` as a PEFT SEQ_CLS adapter
    (collective: call on every rank). Returns the directory.

    The LoRA factors are written by :meth:`MLoraModel.save_adapter`; global rank 0 then adds the
    head (``base_model.model.score.weight``), the SEQ_CLS config and ``mlora_reward.json`` naming
    ``frozen_adapter``, the PEFT directory the reward adapter was trained on top of (None: the base
    alone); each file appears atomically. A head with a non-zero bias cannot be saved: HF's
    ``score`` has none.
    """
    model._require(adapter_name)
    mesh = model.mesh
    weight, status = _head_weight_everywhere(model, head_name)
    if status == _HEAD_MISSING:
        raise ValueError(f"no scalar head named {head_name!r} on the last pipeline stage"
                         + (f"; it has {sorted(model.heads) or 'none'}" if mesh.is_last_stage else ""))
    if status == _HEAD_BIASED:
        raise ValueError(f"head {head_name!r} has a non-zero bias; a reward adapter's score head "
                         "(HF's Linear(hidden, 1, bias=False)) has none: build it with add_value_head(bias=False)")
    out = Path(out_dir)
    model.save_adapter(adapter_name, out)
    if mesh.rank == 0:
        from safetensors.torch import load_file

        tensors = load_file(str(out / ADAPTER_WEIGHTS))
        tensors[SCORE_TENSOR] = weight.to(model.adapter_dtype)
        config = reward_adapter_config(json.loads((out / ADAPTER_CONFIG).read_text()), model.spec.architecture)
        write_peft_adapter(out, tensors, config)
        write_reward_meta(out, frozen_adapter)
    if mesh.world_size > 1:
        dist.barrier()
    return out


def read_reward_config(path: Path):
    """The LoraConfig of reward adapter directory ``path``, after checking that it is one: a LoRA
    ``adapter_config.json`` with ``task_type="SEQ_CLS"`` and ``modules_to_save=["score"]``, and the
    weights file. Reads no tensors (config validation calls it before any model loads)."""
    # PEFT's save_pretrained lists its default SEQ_CLS head names ("classifier", "score") next to the given
    # ones, repeats included; which head is really there is decided by the score tensor (checked on load)
    cfg = read_peft_config(path, modules_to_save=PEFT_SEQ_CLS_HEADS)
    task = cfg.extra.get("task_type")
    saved = cfg.extra.get("modules_to_save") or []
    if task != TASK_TYPE or SCORE_MODULE not in saved:
        raise ValueError(f"{path / ADAPTER_CONFIG}: task_type={task!r}, modules_to_save={saved!r}; a reward "
                         f"adapter has task_type={TASK_TYPE!r} and {SCORE_MODULE!r} in modules_to_save (write one "
                         "with save_reward_adapter, or PEFT's save_pretrained of a SEQ_CLS model)")
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{path} has no {ADAPTER_WEIGHTS}")
    return cfg


def load_reward_adapter(model, path: str | os.PathLike, adapter_name: str = "reward",
                        head_name: str = "reward") -> None:
    """Load a reward adapter written by :func:`save_reward_adapter` (or by PEFT for a SEQ_CLS model
    with ``num_labels=1``): the LoRA factors as frozen adapter ``adapter_name``, the ``score``
    weight as frozen bias-free head ``head_name`` on the last stage.

    Everything is checked before anything is created: the task type, the ``score`` tensor and its
    width against the base's hidden size, the factors' shapes and layer count against the base.
    Each rank reads only its slices.
    """
    path = Path(path)
    model._check_new_name(adapter_name)
    if head_name in model.heads:
        raise ValueError(f"a head named {head_name!r} already exists")
    cfg = read_reward_config(path)
    hidden = model.spec.hidden_size
    tp, tp_rank = model.mesh.tp, model.mesh.tp_rank
    with CheckpointReader(path) as reader:
        if SCORE_TENSOR not in reader:
            raise CheckpointError(f"{path / ADAPTER_WEIGHTS} has no {SCORE_TENSOR!r}: not a reward adapter (the "
                                  "scalar head is missing)")
        shape = tuple(reader.entry(SCORE_TENSOR).shape)
        if shape != (1, hidden):
            width = shape[-1] if shape else None
            raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: {SCORE_TENSOR} has shape {shape} (head width {width}), "
                                  f"this base has hidden size {hidden} and needs (1, {hidden}): a reward adapter "
                                  "for another base, or a head with num_labels != 1?")
        lora_names = [n for n in reader.entries if n != SCORE_TENSOR]
        modules = peft_modules(lora_names, model.spec.num_layers, path, model.spec.moe,
                               attention_projections(model.spec))
        check_peft_shapes(reader, modules, model_sites(model.spec, tp), cfg, path)
        score = reader.read(SCORE_TENSOR)

        def factors(site, sub):
            a_kind, b_kind = factor_kinds(site)
            return (read_shard(reader, peft_tensor_name(site.layer, sub, "A"), a_kind, tp, tp_rank),
                    read_shard(reader, peft_tensor_name(site.layer, sub, "B"), b_kind, tp, tp_rank))

        # the same installation as MLoraModel.load_adapter, with the head's tensor set aside
        model._install(adapter_name, cfg, modules, False, factors)
    head = model.add_value_head(head_name, bias=False)
    if head is not None:
        with torch.no_grad():
            head.weight.copy_(score.to(head.weight.dtype))
        head.requires_grad_(False)


def last_token_scores(head: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``[b]`` float32: ``head`` on the final hidden state of each row's last non-pad token.

    ``hidden`` is ``[b, s, h]`` (what the last stage hands a loss with ``hidden_states=True``);
    the last non-pad token is the rightmost position with ``attention_mask`` 1 (HF's sequence
    classifiers take the rightmost non-pad token), the last position without a mask.
    """
    b, s = hidden.shape[:2]
    if attention_mask is None:
        last = torch.full((b,), s - 1, dtype=torch.long, device=hidden.device)
    else:
        mask = attention_mask.to(hidden.device)[:, :s]
        positions = torch.arange(s, device=hidden.device).expand(b, s)
        last = (positions * (mask > 0)).amax(dim=1)  # a row of zeros has no token: position 0, never used
    return head(hidden[torch.arange(b, device=hidden.device), last])[:, 0].float()
