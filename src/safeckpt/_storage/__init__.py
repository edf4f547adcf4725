"""Bytes in and out of DCP's files: the torch.save archive, the writer and reader, every loaded byte
checked.
"""
