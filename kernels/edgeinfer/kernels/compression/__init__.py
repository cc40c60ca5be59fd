"""Lossless compression of bf16/fp16 weights: Huffman-coded exponents, raw sign and mantissa.

Entry points: ``checkpoint.compress_dir`` / ``decompress_dir`` for directories, and
``reader.CompressedSafetensorsReader`` / ``reader.is_compressed_checkpoint`` for loaders.
Nothing is imported here so that ``errors`` stays importable without torch.
"""
