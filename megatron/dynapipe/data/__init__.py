"""Training data: variable-length samples (`variable_length`) from the stdlib corpus, `.jsonl`,
Megatron `.bin/.idx` or synthetic sources, selected and split by Megatron's data flags
(`datasets`, tokenized by `tokenizer`), global batches (`sampler`), and the tensors of each
planned micro-batch (`microbatches`); Megatron's fixed-length samples for the baselines
(`megatron_samples`).
"""
