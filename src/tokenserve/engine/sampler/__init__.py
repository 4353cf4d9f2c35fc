"""The host sampler, the one that picks every token the engine emits, by concern: `masks`
(what a row may not pick, or must weigh down: grammar masks, penalties, NaN and +inf),
`draw` (each sequence's draws: greedy, by noise, or by walking the distribution with `walk`;
batches and logprobs) and `verify` (which token a sequence takes where a draft was
proposed)."""
