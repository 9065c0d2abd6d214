"""Run state of every stage, mesh-independent: checkpoint directories (atomic commit, ``latest`` pointer,
pruning, which one to resume, base-model identity), what an RL or SFT/RM/DPO checkpoint holds, optimizer
state as canonical pieces, RNG states."""
