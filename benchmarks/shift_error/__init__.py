"""The error of repeated shift-RoPE-K on float16/int8/int4 caches against discard-and-re-evaluate
(``measure``)."""
