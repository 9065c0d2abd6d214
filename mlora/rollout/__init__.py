"""Rollouts: prompt data, reward environments, generators (vLLM) and adapter hand-off."""
