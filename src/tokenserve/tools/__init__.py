"""The commands' workhorses that sit beside the server, above the engine: perplexity
(`evaluate`), the optimize pipeline (`optimize`), and generation through an export's own
signatures (`generate`, picking tokens with `token_stream`)."""
