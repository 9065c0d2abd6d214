"""Adapters out to the HF ecosystem: PEFT files, merged checkpoints, export plans."""
