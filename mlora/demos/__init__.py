"""Runnable demos (the README's first command)."""
