"""HF config -> megatron model: layer spec, attention, recompute, per-rank sharded loading, the TE spec,
megatron-core dist checkpoints. The user-facing :class:`mlora.MLoraModel` is in :mod:`mlora.facade`."""
