"""Bytes autograd saves per part of the model in one training forward, counted with
``torch.autograd.graph.saved_tensors_hooks`` (one count per storage; parameters and buffers
excluded). The memory planner's activation formula is tested against it."""

from __future__ import annotations

import weakref


def saved_bytes_by_module(model, input_ids, adapters: tuple[str, ...], head: str | None = None) -> dict[str, int]:
    """Bytes autograd saves in one training forward of ``model`` (this rank's stage) and still holds at its end, by
    top-level part: ``layers.<i>`` (local index), ``final_layernorm``, ``head``, ``other``. Tensors are
    counted once per storage (views share it) and parameters not at all.

    ``head``: run the named value head on the final hidden states (the critic's forward), else
    the logits forward (their tensors are not counted here: the planner's logits term covers them).
    """
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    stack: list[str] = []
    handles = []
    for name, module in model.gpt.named_modules():
        parts = name.split(".")
        if len(parts) == 3 and parts[:2] == ["decoder", "layers"]:
            key = f"layers.{parts[2]}"
        elif name == "decoder.final_layernorm":
            key = "final_layernorm"
        else:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, key=key: stack.append(key) and None))
        handles.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))
    saved: list[tuple[weakref.ref, str]] = []

    def pack(t):
        saved.append((weakref.ref(t), stack[-1] if stack else ("head" if in_head else "other")))
        return t

    in_head = False
    try:
        with model.use_adapters(*adapters), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.train()
            ids, positions, mask, _ = model._prepare(input_ids, None)
            if head is None:
                output = model.gpt(ids, positions, mask)
            else:
                with model._hidden_states_output():
                    hidden = model.gpt(ids, positions, mask)
                in_head = True
                output = model.heads[head](model._batch_major_hidden(hidden))
        # what the graph still holds: a branch of the forward that does not reach the output (top-k values a router
        # discards) frees its saved tensors as soon as it ends
        seen: set[int] = set()
        out: dict[str, int] = {}
        for ref, key in saved:
            t = ref()
            if t is None:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in params and ptr not in seen and storage.nbytes():
                seen.add(ptr)
                out[key] = out.get(key, 0) + storage.nbytes()
        del output
    finally:
        model.eval()
        for h in handles:
            h.remove()
    return out
