"""Moved to ``rgpu.ops_protocol`` (both ends import it from there); this name re-exports it."""
from rgpu.ops_protocol import *  # noqa: F401,F403
