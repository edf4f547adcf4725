"""Process helpers with no checkpoint knowledge: argument checks, pausing the garbage collector."""
