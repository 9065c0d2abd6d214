"""Bytes of file formats, with no LoRA or model knowledge: safetensors reading (per-rank slices) and
writing (streamed or pre-sized), HF ``config.json`` and the HF <-> megatron tensor map, Hub FP8
checkpoints, GGUF conversion, and durable atomic writes."""
