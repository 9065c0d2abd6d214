"""TRL / transformers+PEFT references for the SFT, reward-model and DPO stages, computed once per session.

On the tiny Llama, with random non-zero LoRA factors (and, for the reward model, a random ``score``
head): TRL's own DPOTrainer (reference = an explicit frozen copy of the base, TRL's default) and
RewardTrainer, each on its own collated batch, one ``compute_loss`` + backward; SFT as
transformers' causal-LM loss with the prompt labels at -100. Saved: the batch as the trainer
collated it, the loss, TRL's logged metrics and the LoRA (and head) gradients in PEFT names.
"""

from __future__ import annotations

from pathlib import Path

import torch

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DPO_BETA = 0.5
PAIRS = [  # four pairs of different lengths; responses differ in length and content
    {"prompt": "Ann has 3 apples", "chosen": " and 4 pens.", "rejected": " #### 7"},
    {"prompt": "Bob gets", "chosen": " 12 more", "rejected": " cards and eggs, how many"},
    {"prompt": "How many coins does Eve have?", "chosen": " 5 + 6 = 11", "rejected": " 11"},
    {"prompt": "Cid", "chosen": " has books", "rejected": " has 99 books and 1 more"},
]


def _randomize_lora(model, seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n.replace(".default", "").replace(".modules_to_save", ""): p.grad.detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def _hf(base_dir: Path, cls_name: str = "AutoModelForCausalLM", **kw):
    import transformers

    return getattr(transformers, cls_name).from_pretrained(str(base_dir), dtype=torch.float32,
                                                           attn_implementation="eager", **kw)


def dpo_reference(base_dir: Path, out: Path, loss_type: str, adapter_dir: Path) -> dict:
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    pm = PeftModel.from_pretrained(_hf(base_dir), str(adapter_dir), is_trainable=True)
    args = DPOConfig(output_dir=str(out / f"trl_dpo_{loss_type}"), beta=DPO_BETA, loss_type=[loss_type],
                     per_device_train_batch_size=len(PAIRS), report_to="none", use_cpu=True, bf16=False, fp16=False,
                     dataloader_drop_last=False, seed=0)
    trainer = DPOTrainer(model=pm, ref_model=_hf(base_dir), args=args, train_dataset=Dataset.from_list(PAIRS),
                         processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"batch": {k: v.detach().clone() for k, v in batch.items() if torch.is_tensor(v)}, "loss": float(loss),
            "metrics": metrics, "grads": _grads(pm)}


def rm_reference(base_dir: Path, out: Path) -> dict:
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    hf = _hf(base_dir, "AutoModelForSequenceClassification", num_labels=1)
    pm = get_peft_model(hf, LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, target_modules=ALL_SEVEN,
                                       modules_to_save=["score"]))  # the agreed reward-adapter format
    _randomize_lora(pm, seed=11, scale=0.1)
    with torch.no_grad():
        score = pm.base_model.model.score.modules_to_save["default"]
        score.weight.copy_(torch.randn(score.weight.shape, generator=torch.Generator().manual_seed(12)) * 0.3)
    pm.save_pretrained(str(out / "reward_adapter"))  # the SEQ_CLS directory mlora loads
    args = RewardConfig(output_dir=str(out / "trl_rm"), per_device_train_batch_size=len(PAIRS), report_to="none",
                        use_cpu=True, bf16=False, fp16=False, seed=0)
    trainer = RewardTrainer(model=pm, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"batch": {k: v.detach().clone() for k, v in batch.items() if torch.is_tensor(v)}, "loss": float(loss),
            "metrics": metrics, "grads": _grads(pm)}


def sft_reference(base_dir: Path, adapter_dir: Path) -> dict:
    """transformers + PEFT: the causal-LM loss with labels -100 on the prompt and the padding."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from mlora.train.preference_data import collate, tokenize_example

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    examples = [tokenize_example(tok, r["prompt"], (r["chosen"],), "sft") for r in PAIRS]
    batch = collate(examples, tok.pad_token_id, pairs=False)
    labels = batch.input_ids.masked_fill((batch.response_mask * batch.attention_mask) == 0, -100)
    pm = PeftModel.from_pretrained(_hf(base_dir), str(adapter_dir), is_trainable=True)
    pm.train()
    loss = pm(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss
    loss.backward()
    return {"batch": {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                      "response_mask": batch.response_mask}, "loss": float(loss), "grads": _grads(pm)}


def build_preference_refs(base_dir: Path, out: Path) -> Path:
    """``out/refs.pt`` and the adapters: ``policy`` (causal LM, r 8) and ``reward_adapter`` (SEQ_CLS + score)."""
    from peft import LoraConfig, get_peft_model

    out.mkdir(parents=True, exist_ok=True)
    pm = get_peft_model(_hf(base_dir), LoraConfig(r=8, lora_alpha=16, target_modules=ALL_SEVEN))
    _randomize_lora(pm, seed=10, scale=0.1)  # large enough that the log-ratios are far from 0
    pm.save_pretrained(str(out / "policy"))
    refs = {"dpo_sigmoid": dpo_reference(base_dir, out, "sigmoid", out / "policy"),
            "dpo_ipo": dpo_reference(base_dir, out, "ipo", out / "policy"),
            "rm": rm_reference(base_dir, out),
            "sft": sft_reference(base_dir, out / "policy")}
    torch.save(refs, out / "refs.pt")
    return out
