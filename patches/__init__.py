"""Patches kinfer-rpc carries against upstream libraries (installed as the `kinfer_patches` package).

Each module patches one thing, says why, and says how to drop it; README.md lists them. A patch is
applied at import time from our own code, never by editing site-packages, and does nothing once
upstream does the same.
"""
