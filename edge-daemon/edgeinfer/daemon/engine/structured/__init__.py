"""Grammar-constrained decoding: a request's constraint spec, compiled grammars, matchers."""

from edgeinfer.daemon.engine.structured.grammars import GrammarCompiler
from edgeinfer.daemon.engine.structured.matcher import GrammarMatcher, apply_token_masks
from edgeinfer.daemon.engine.structured.spec import StructuredSpec

__all__ = ["GrammarCompiler", "GrammarMatcher", "StructuredSpec", "apply_token_masks"]
