"""Ranks and agreement: the manager's gloo groups, gather/broadcast/agree, one error for every rank."""
