"""Moved to ``rgpu.ops_substitutes`` (both ends import it from there); this name re-exports it."""
from rgpu.ops_substitutes import *  # noqa: F401,F403
from rgpu.ops_substitutes import SUBSTITUTES, substitute  # noqa: F401
