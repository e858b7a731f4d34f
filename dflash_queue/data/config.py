"""The `[dataset]` section: how datasets become samples and shards."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from dflash_queue.config.sections import PositiveInt, Section


class DatasetConfig(Section):
    shard_size: PositiveInt = 256
    """Samples per shard, and so per task of each lane."""
    thinking: Literal["always", "never", "auto"] = "always"
    """"auto": rules on the content decide per sample (code, math, reasoning -> on; chit-chat, classification,
    extraction -> off)."""
    regenerate: Literal["last", "all"] = "last"
    """"last": regenerate the last assistant turn from the conversation before it (earlier ones stay as context);
    "all": regenerate every assistant turn in order, each conditioned on the regenerated history."""
    history: Literal["as-served", "as-generated"] = "as-served"
    """With regenerate = "all", the history each later turn is generated from. "as-served": the chat template's
    rendering of the conversation so far, the regenerated replies as messages (what a serving stack sends;
    reasoning stripped where the template strips it), one training sequence per turn where a reply is not in the
    final prompt as generated. "as-generated": the exact ids generated so far plus the template's continuation
    (earlier reasoning kept), one sequence."""
    staging_processes: Annotated[int, Field(ge=0)] = 0
    """Processes that parse the records and count their prompt tokens at staging time (1: the producer's own
    process, tokenizing on a second thread). 0: on 4 cores or more, one per core but one when the dataset
    files hold 64 MiB or more; else 1."""
    max_record_bytes: PositiveInt = 4 * 1024 * 1024
    """A record (JSONL line, array element, Parquet row) larger than this is reported and skipped."""
    max_bad_share: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    """Staging is refused when a dataset file's bad records are more than this share of its records (a file in
    another format, a broken export): nothing of the datasets is enqueued when it is known before the first
    message (the first 1024 records, or the datasets' end where the share is over until then). 1: any share
    goes. Datasets with no usable sample at all are refused whatever this says."""
    length_filter: bool = True
    """Skip prompts whose chat-templated token count leaves less than `generation_budget` tokens inside
    `max_model_len`; counted with the target's own tokenizer at staging time."""
    max_model_len: Annotated[int, Field(ge=0)] = 0
    """0: the model's max_position_embeddings (config.json)."""
    generation_budget: Annotated[int, Field(ge=0)] = 0
    """0: generate.sampling.max_tokens."""
