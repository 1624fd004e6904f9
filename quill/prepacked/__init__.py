"""The prepacked cache: a loaded model's kernel layouts, saved once and read back on later loads.

``store`` (the cache directory, keys, list / prune / clear), ``file`` (one cache file: safetensors
with checksums over its header and data, memory-mapped), ``digest`` (a checkpoint's content digest,
remembered by its files' fingerprint), ``leftovers`` (writers' temporary files, and killed writers'
ones).  What a model saves is ``quill.layers.snapshot``'s business; when the cache is used,
``quill.engine.startup``'s.
"""
