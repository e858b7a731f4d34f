"""Audits of datasets and of produced completions and shards: distributions, placeholder and stub shares, a
gate on the stub share (`dflash-queue audit`)."""
