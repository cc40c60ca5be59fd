"""The inference engine: paged KV cache, continuous batching, prefix caching (no HTTP here).

Entry points: :class:`edgeinfer.daemon.engine.llm_engine.LLMEngine` (step-wise, one thread)
and :class:`edgeinfer.daemon.engine.async_engine.AsyncEngine` (for an asyncio owner).
"""
