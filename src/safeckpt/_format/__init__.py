"""What is on disk: the layout of a root, the record, checksums, the catalog (the one definition of
committed).
"""
