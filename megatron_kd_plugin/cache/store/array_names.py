"""The names of a store's arrays (``format.py`` describes each): the one list the store's schema and every kind of
store (``kinds/``) name them by."""

TOKENS, IDS, LOGPROBS, LOGSUMEXP, PROPOSAL_LOGNORM, RECORDS, SHARD_DONE = (
    "tokens", "teacher_ids", "teacher_logprobs", "teacher_logsumexp", "teacher_proposal_lognorm", "chunk_records",
    "shard_done")
REALISED_LOGPROB, VOCAB_OFFSETS, VOCAB_BYTES = (
    "teacher_realised_logprob", "teacher_vocab_offsets", "teacher_vocab_bytes")
LOSS_MASK, POSITION_IDS = "loss_mask", "position_ids"
ARRAYS = (TOKENS, IDS, LOGPROBS, LOGSUMEXP, PROPOSAL_LOGNORM, REALISED_LOGPROB, VOCAB_OFFSETS, VOCAB_BYTES, LOSS_MASK,
          POSITION_IDS, RECORDS, SHARD_DONE)
VOCAB_TABLE = (VOCAB_OFFSETS, VOCAB_BYTES)
"""The arrays stored once per store (one chunk each, not per sample)."""
