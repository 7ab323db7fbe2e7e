"""What a student with its own tokenizer needs of a store: byte tables, alignment of the two tokenizations, first
tokens, the token-level slots, and the alignments' sidecar."""
