"""Real data: tokenizers, `dilocod data prepare`, the prepared dataset's shard format and its reader.

A prepared dataset is a directory: index.json (its sha256 is the dataset's identity), tokenizer.json and
fixed-size token shards per split (see dilocod.data.shards).
"""
