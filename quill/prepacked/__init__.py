"""The prepacked cache: a loaded model's kernel layouts, saved once and read back on later loads.

``store`` (the cache directory, keys, list / clear), ``file`` (one cache file: safetensors with a
checksum, read whole onto 2 MiB pages), ``digest`` (a checkpoint's content digest, remembered by
its files' fingerprint).  What a model saves is ``quill.layers.snapshot``'s business; when the
cache is used, ``quill.engine.startup``'s.
"""
