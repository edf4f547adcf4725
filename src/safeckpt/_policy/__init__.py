"""Pure policies: which checkpoints to keep (retention) and when to save (schedule). No clock, file or
rank.
"""
