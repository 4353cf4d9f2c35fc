"""Models for phones and embedded devices: TFLite conversion (`convert`), the batch-1 graphs
it converts (`graph`) and a LiteRT runner (`runner`)."""
