"""Reference adapters and HF+PEFT results for the LoRA tests, computed once per session."""

from __future__ import annotations

from pathlib import Path

import torch

from mlora.testing import right_padded_batch

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_peft_adapter(base_dir: Path, out_dir: Path, r: int, alpha: float, seed: int,
                        target_modules=ALL_SEVEN, dropout: float = 0.0) -> Path:
    """Save a PEFT LoRA adapter with random, non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    pm = get_peft_model(hf, LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=dropout))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    pm.save_pretrained(str(out_dir))
    return out_dir


def padded_batch(vocab: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    return right_padded_batch(vocab, (19, 13, 6), seed)


def build_refs(base_dir: Path, out: Path) -> Path:
    """Adapters ``policy`` (r8), ``sft`` (r4), ``r3`` (rank 3) and the HF+PEFT results mlora must match."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    policy = random_peft_adapter(base_dir, out / "policy", r=8, alpha=16, seed=1)
    sft = random_peft_adapter(base_dir, out / "sft", r=4, alpha=8, seed=2)
    r3 = random_peft_adapter(base_dir, out / "r3", r=3, alpha=6, seed=3)
    ids, mask = padded_batch(1001)

    def hf():
        return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, attn_implementation="eager")

    refs = {"ids": ids, "mask": mask}
    with torch.no_grad():
        refs["policy_logits"] = PeftModel.from_pretrained(hf(), str(policy))(input_ids=ids, attention_mask=mask).logits
        refs["r3_logits"] = PeftModel.from_pretrained(hf(), str(r3))(input_ids=ids, attention_mask=mask).logits
        merged = PeftModel.from_pretrained(hf(), str(sft)).merge_and_unload()
        refs["stack_logits"] = PeftModel.from_pretrained(merged, str(policy))(input_ids=ids, attention_mask=mask).logits
    pm = PeftModel.from_pretrained(hf(), str(policy), is_trainable=True)
    logits = pm(input_ids=ids, attention_mask=mask).logits
    (logits * mask[..., None]).sum().backward()
    refs["policy_grads"] = {n.replace(".default", ""): p.grad.detach().clone()
                            for n, p in pm.named_parameters() if "lora_" in n}
    torch.save(refs, out / "refs.pt")
    return out
