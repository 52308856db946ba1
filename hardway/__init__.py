"""hardway: LLM inference built by hand, exported from the course notebooks.

This file is the only hand-written module: it re-exports the public API. Everything else in hardway/ is
generated from notebooks/ by tools/export.py.
"""
