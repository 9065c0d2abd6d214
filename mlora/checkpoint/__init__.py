"""Run state of every stage, mesh-independent: checkpoint directories (atomic commit, ``latest`` pointer,
pruning, which one to resume, base-model identity), what a checkpoint of any stage holds (one writer and
one reader), optimizer state as canonical pieces, RNG states."""
