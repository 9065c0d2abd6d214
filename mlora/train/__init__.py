"""Training: the shared-base actor/critic engine, its optimizer, the RL and SFT/RM/DPO loops, evaluation and
metrics; ``python -m mlora.train`` / ``mlora-train`` is the entry point."""
