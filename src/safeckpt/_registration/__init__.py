"""Telling a registry about commits, off the commit path."""
